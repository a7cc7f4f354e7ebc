"""Options declared once. A dataclass field made with `option(...)` carries its flag, help text, default
and bounds; `add_options` builds the argparse options from those fields, `option_values` reads them
back, and `check_options` (each dataclass's __post_init__) holds every value, from the CLI, a cluster
file or the wire, to the same bounds the parser checks.

    threads: int | None = option(None, "--threads", "CPU threads ...", minimum=1)

Invariant: a flag exists exactly when a field declares it, so adding an option is adding one field.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass
from typing import Any

from kvpact.shared.errors import ConfigError

UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1  # what the wire's uint32 / uint64 fields carry
_FIELD_DEFAULT: Any = object()  # Option.cli_default unset: argparse starts from the field's default


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option, kept in its field's metadata under "option"."""

    flag: str
    help: str
    type: Callable[[str], Any] | None = None  # argparse type (the text's syntax); None = str
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    group: str = ""  # the --help section ("" = the parser's own options)
    exclusive: str = ""  # options with the same name here may not be given together
    action: str | None = None  # "store_true", "store_false" (a --no-X switch) or "append"
    minimum: int | None = None  # a whole number in [minimum, maximum]
    maximum: int = UINT32_MAX
    convert: Callable[[Any], Any] | None = None  # parsed value -> field value (e.g. text -> an enum)
    into: tuple[str, ...] = ()  # a tuple value spread over these fields (default: just this field)
    cli_default: Any = _FIELD_DEFAULT  # what argparse starts from, when that is not the field's default

    def check(self, value: object) -> str | None:
        """What is wrong with `value` under this option's bounds, or None."""
        if self.minimum is None or value is None:
            return None
        return bounds_problem(value, self.minimum, self.maximum)

    def parse(self, text: str) -> Any:
        """The argparse type: `type` if given, else a bounded whole number when bounded, else the text."""
        if self.type is not None:
            return self.type(text)
        return text if self.minimum is None else whole_number(text, self.minimum, self.maximum)


def bounds_problem(value: object, minimum: int, maximum: int, text: str | None = None) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum:
        return None
    low = "> 0" if minimum == 1 else f">= {minimum}"
    return f"expected a whole number {low} and <= {maximum}, got {text if text is not None else value}"


def whole_number(text: str, minimum: int, maximum: int = UINT32_MAX) -> int:
    """An argparse type's body: `text` as a whole number in [minimum, maximum]."""
    problem = bounds_problem(int(text) if text.isdigit() else text, minimum, maximum, repr(text))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return int(text)


def option(default: Any = MISSING, flag: str = "", help: str = "", **kwargs: Any) -> Any:
    """A dataclass field declaring `flag` (see Option); `default` may be a zero-argument callable's
    result via default_factory=... in kwargs."""
    factory = kwargs.pop("default_factory", MISSING)
    meta = {"option": Option(flag=flag, help=help, **kwargs)}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def options_of(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Option]]:
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def _default(f: dataclasses.Field[Any], opt: Option) -> Any:
    if opt.cli_default is not _FIELD_DEFAULT:
        return opt.cli_default
    if f.default_factory is not MISSING:
        return f.default_factory()
    value = None if f.default is MISSING else f.default
    return getattr(value, "value", value)  # an enum starts from its text, as the choices are written


def add_options(parser: argparse.ArgumentParser, *classes: type) -> None:
    """Add every declared option of `classes` to `parser`, in field order, each in its --help group
    (groups are created in the order they first appear)."""
    groups: dict[str, Any] = {"": parser}
    exclusive: dict[tuple[str, str], Any] = {}
    for cls in classes:
        for f, opt in options_of(cls):
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group)
            target = groups[opt.group]
            if opt.exclusive:
                key = (opt.group, opt.exclusive)
                if key not in exclusive:
                    exclusive[key] = target.add_mutually_exclusive_group()
                target = exclusive[key]
            kwargs: dict[str, Any] = {"dest": f.name, "help": opt.help, "default": _default(f, opt)}
            if opt.action in ("store_true", "store_false"):
                kwargs["action"] = opt.action
            else:
                metavar = opt.metavar or (
                    None if opt.choices else opt.flag.lstrip("-").upper().replace("-", "_")
                )
                kwargs |= {"type": opt.parse, "metavar": metavar, "action": opt.action or "store"}
                if opt.choices:
                    kwargs["choices"] = opt.choices
            if opt.action == "append":
                kwargs["default"] = []
            target.add_argument(opt.flag, **kwargs)


def option_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` that its options set, from parsed `args` (see add_options)."""
    values: dict[str, Any] = {}
    for f, opt in options_of(cls):
        value = getattr(args, f.name)
        if opt.convert is not None and value is not None:
            value = opt.convert(value)
        if opt.into:
            values |= dict(zip(opt.into, value, strict=True))
        else:
            values[f.name] = value
    return values


def check_options(instance: object) -> None:
    """Every declared option's value within its bounds, else ConfigError naming the flag."""
    for f, opt in options_of(type(instance)):
        problem = opt.check(getattr(instance, f.name))
        if problem:
            raise ConfigError(f"{opt.flag}: {problem}")
