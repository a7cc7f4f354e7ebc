"""shared/options.py: a field declares its flag once; the parser, the bounds and the values follow it."""

import argparse
from dataclasses import dataclass

import pytest

from kvpact.router.config import RouterConfig
from kvpact.shared.errors import ConfigError
from kvpact.shared.features import FeatureIntents
from kvpact.shared.intent import CacheIntent, PagedAttentionConfig
from kvpact.shared.options import add_options, check_options, option, option_values, options_of
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.cli import build_parser as worker_parser
from kvpact.worker.options import WorkerOptions


@dataclass(frozen=True, slots=True)
class Example:
    count: int = option(2, "--count", "how many (default 2)", minimum=1, maximum=9, group="g")
    name: str | None = option(None, "--name", "a name", group="g")
    quiet: bool = option(False, "--quiet", "say less", action="store_true")

    def __post_init__(self) -> None:
        check_options(self)


def parse(argv):
    parser = argparse.ArgumentParser(prog="example")
    add_options(parser, Example)
    return Example(**option_values(Example, parser.parse_args(argv)))


def test_the_field_default_is_the_flag_default():
    assert parse([]) == Example()
    assert parse(["--count", "9", "--name", "x", "--quiet"]) == Example(count=9, name="x", quiet=True)


@pytest.mark.parametrize("value", ["0", "10", "-1", "two"])
def test_out_of_bounds_on_the_command_line_exits_2_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["--count", value])
    assert exc.value.code == 2
    assert f"argument --count: expected a whole number > 0 and <= 9, got '{value}'" in capsys.readouterr().err


def test_out_of_bounds_in_code_or_from_the_wire_is_refused_by_the_same_bounds():
    with pytest.raises(ConfigError, match="--count: expected a whole number > 0 and <= 9, got 0"):
        Example(count=0)
    with pytest.raises(ConfigError, match="--max-num-seqs: expected a whole number >= 0"):
        WorkerSpec(max_num_seqs=-1)


def test_every_worker_flag_is_a_declared_field_and_every_declared_field_a_flag():
    declared = {
        opt.flag
        for cls in (WorkerSpec, CacheIntent, PagedAttentionConfig, FeatureIntents, WorkerOptions)
        for _, opt in options_of(cls)
    }
    parser = worker_parser()
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    shared = {
        "--help",
        "--log-format",
        "--log-level",
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
        "--tls-server-name",
        "--no-prefix-caching",  # removed: exits 2 naming --prefix-caching off
    }
    assert flags - shared == declared


def test_the_router_config_declares_its_listen_address_as_one_flag():
    (listen,) = [opt for f, opt in options_of(RouterConfig) if f.name == "host"]
    assert listen.flag == "--listen" and listen.into == ("host", "port")
