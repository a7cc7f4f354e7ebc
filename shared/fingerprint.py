"""The realized-config fingerprint: what makes workers that serve one model name interchangeable.

    model                 sha256 over the config (config.json + generation_config.json, or the GGUF
                          metadata but the tokenizer's) and each weight file's name, size and tensor header
    tokenizer             sha256 over the tokenizer (tokenizer.json + its config, or the GGUF vocabulary)
    chat-template         sha256 of the chat template the worker renders with ("none" without one)
    dtype                 what its weights and activations run in, as realized (--dtype: float32, bfloat16)
    cache-dtype           its KV cache's dtype as realized (--pa-cache-dtype; the eager cache: --dtype's)
    max-model-len         the longest sequence it plans
    block-size            its paged KV cache's block size (0: the eager cache, no blocks)
    tensor-parallel-size  its ranks

A worker computes it before reading a weight (worker/loader/fingerprint.py: file headers only; the
dtypes and sizes from its plan), so its plan carries it. `router --uniform LIST` names the fields that
must agree. The default, UNIFORM_DEFAULT, is what changes the tokens a request gets: the files, and both
dtypes (rounding moves greedy near-ties: a float32 and a bfloat16 worker answer one prompt differently);
the sizes are opt-in. A worker that differs from the workers already serving its model name in one of
them is refused, both values named (`mismatch`). Converted to and from protobuf in shared/handshake_pb.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

FIELDS = (
    "model",
    "tokenizer",
    "chat-template",
    "dtype",
    "cache-dtype",
    "max-model-len",
    "block-size",
    "tensor-parallel-size",
)
UNIFORM_DEFAULT = ("model", "tokenizer", "chat-template", "dtype", "cache-dtype")
NOT_REPORTED = ""  # a dtype field of a worker older than the field
NO_CHAT_TEMPLATE = "none"
_DIGEST_SHOWN = 12  # hex digits of a digest an operator reads (the wire and --json carry all 64)


@dataclass(frozen=True, slots=True)
class Fingerprint:
    model: str = ""  # "sha256:<hex>"
    tokenizer: str = ""
    chat_template: str = NO_CHAT_TEMPLATE
    max_model_len: int = 0
    block_size: int = 0  # 0: the eager cache
    tensor_parallel_size: int = 1
    dtype: str = NOT_REPORTED  # "float32", "bfloat16", ... (torch's name without "torch.")
    cache_dtype: str = NOT_REPORTED

    def value(self, name: str) -> str | int:
        """The field that FIELDS calls `name`."""
        result: str | int = getattr(self, name.replace("-", "_"))
        return result

    def shown(self, name: str) -> str:
        """`name`'s value as an operator reads it (a digest shortened, block size 0 said as eager)."""
        value = self.value(name)
        if isinstance(value, str) and value.startswith("sha256:"):
            return value[: len("sha256:") + _DIGEST_SHOWN]
        if name == "block-size" and value == 0:
            return "none (eager cache)"
        if value == NOT_REPORTED:
            return "not reported (a worker older than this router)"
        return str(value)

    def describe(self, names: Iterable[str] = FIELDS) -> str:
        """e.g. `model sha256:1a2b3c4d5e6f, max-model-len 2048`."""
        return ", ".join(f"{n} {self.shown(n)}" for n in names)

    def to_json(self) -> dict[str, Any]:
        return {n: self.value(n) for n in FIELDS}

    @staticmethod
    def from_json(document: dict[str, Any]) -> Fingerprint:
        """From `to_json`'s mapping (worker --plan-only --json); a missing key keeps its default."""
        known = {f.name for f in fields(Fingerprint)}
        return Fingerprint(
            **{k.replace("-", "_"): v for k, v in document.items() if k.replace("-", "_") in known}
        )


def differences(own: Fingerprint, other: Fingerprint, names: Iterable[str]) -> list[str]:
    """The fields of `names` in which the two differ, in FIELDS order."""
    wanted = set(names)
    return [n for n in FIELDS if n in wanted and own.value(n) != other.value(n)]


def mismatch(own: Fingerprint, peer_id: str, peer: Fingerprint, names: Iterable[str]) -> str:
    """Why a worker with `own` cannot serve beside worker `peer_id` (with `peer`), or "" when it can."""
    diff = differences(own, peer, names)
    if not diff:
        return ""
    both = "; ".join(f"{n} {own.shown(n)} here, {peer.shown(n)} on worker {peer_id!r}" for n in diff)
    return (
        f"it is not interchangeable with the workers serving its model name (router --uniform): {both}; "
        f"start it with the same model, tokenizer and flags as those, serve it under another --model-name, "
        f"or drop {', '.join(diff)} from --uniform"
    )


def parse_uniform(text: str) -> tuple[str, ...]:
    """`--uniform`'s argparse type: a comma list of FIELDS, or "none" (nothing must agree)."""
    if text.strip() == "none":
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FIELDS]
    if unknown or not names:
        what = f"unknown name {unknown[0]!r}" if unknown else "an empty list"
        raise argparse.ArgumentTypeError(
            f"{what}: expected a comma list of {', '.join(FIELDS)} (or none), e.g. model,max-model-len"
        )
    return tuple(dict.fromkeys(names))


def merge_uniform(given: list[tuple[str, ...]]) -> tuple[str, ...]:
    """Every --uniform given (repeatable; a cluster file's list), in FIELDS order; none given: the default."""
    if not given:
        return UNIFORM_DEFAULT
    wanted = {n for names in given for n in names}
    return tuple(n for n in FIELDS if n in wanted)
