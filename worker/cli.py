"""The `worker` command: flags -> WorkerSpec (+ process options) -> the startup sequence in worker/process.py.

Exit codes: kvpact.shared.exit_codes.EXIT_CODES (rendered into `worker --help`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from kvpact.kernels.support import (
    TRITON_BLOCK_SIZES,
    TRITON_DTYPES,
    TRITON_HEAD_SIZES,
    TRITON_MIN_COMPUTE_CAPABILITY,
)
from kvpact.shared.cli import add_log_args
from kvpact.shared.errors import ConfigError
from kvpact.shared.event_loop import loop_factory, run_loop
from kvpact.shared.exit_codes import exit_codes_help
from kvpact.shared.features import FeatureIntents
from kvpact.shared.intent import (
    GPU_DEFAULT_MEMORY_FRACTION,
    CacheIntent,
    PagedAttentionConfig,
    PagedAttentionMode,
    cache_intent,
)
from kvpact.shared.log import configure_logging
from kvpact.shared.options import add_options, option_values, options_of
from kvpact.shared.reasons import reasons_help
from kvpact.shared.spec import WorkerSpec
from kvpact.shared.tls import add_tls_args, tls_from_args
from kvpact.worker.kv.sizing import (
    CPU_DEFAULTS,
    CPU_PAGED_BUDGET_BYTES,
    CPU_PAGED_BUDGET_RAM_FRACTION,
    GPU_DEFAULTS,
    GiB,
)
from kvpact.worker.options import WorkerOptions
from kvpact.worker.process import run_worker


def _listing(values: frozenset[int] | frozenset[str]) -> str:
    return ", ".join(map(str, sorted(values)))


def kernel_limits() -> dict[str, str]:
    """What the Triton kernels take, for the conditions in shared/reasons.py (--help, docs/contract.md)."""
    return {
        "min_cc": ".".join(map(str, TRITON_MIN_COMPUTE_CAPABILITY)),
        "head_sizes": _listing(TRITON_HEAD_SIZES),
        "block_sizes": _listing(TRITON_BLOCK_SIZES),
        "dtypes": _listing(TRITON_DTYPES),
    }


def epilog() -> str:
    """Every reason a worker gives for running without PagedAttention (auto) or refusing to start (on),
    quoted from the constants the checks use, then the exit codes."""
    cpu, gpu = CPU_DEFAULTS, GPU_DEFAULTS
    cuda_defaults = [
        "  --max-model-len 0           auto: the longest sequence the realized KV cache holds, up to the",
        "                              model's max positions (logged as max_model_len_source)",
        f"  --max-num-seqs 0            eager: {gpu.eager_max_num_seqs} slots; "
        f"paged: {gpu.paged_max_num_seqs} sequences",
        f"  --max-num-batched-tokens 0  {gpu.max_num_batched_tokens}",
        f"  paged budget (no --pa-*)    {GPU_DEFAULT_MEMORY_FRACTION:g} x the GPU memory free at startup, "
        "less the weights and activation",
        "                              headroom; at most max-num-seqs x max-model-len tokens",
        "  dtype auto                  bfloat16 (compute capability >= 8.0), else float16",
    ]
    cpu_defaults = [
        f"  --max-model-len 0           the model's max positions, capped at {cpu.max_model_len_cap}",
        f"  --max-num-seqs 0            eager: {cpu.eager_max_num_seqs} slots; "
        f"paged: {cpu.paged_max_num_seqs} sequences",
        f"  --max-num-batched-tokens 0  {cpu.max_num_batched_tokens} (longer prompts are prefilled in "
        f"chunks); at most {cpu.prompt_tokens_beside_decodes}",
        "                              prompt tokens in a step while a sequence decodes (an explicit N: the",
        "                              step's budget whatever runs; --prompt-tokens-beside-decodes sets the",
        "                              bound, with either)",
        f"  paged budget (no --pa-*)    min({CPU_PAGED_BUDGET_BYTES / GiB:g} GiB, "
        f"{CPU_PAGED_BUDGET_RAM_FRACTION:.0%} of system RAM), at most max-num-seqs x max-model-len tokens",
    ]
    lines = [
        "Why a feature is realized off (auto: recorded as a fallback; on: startup fails with exit 78).",
        "Each reason is logged at startup, sent in the handshake and shown in the router's ClusterStatus:",
        *reasons_help(kernel_limits()),
        "",
        "CPU/MPS defaults the engine chooses (worker/kv/sizing.py):",
        *cpu_defaults,
        "",
        "CUDA defaults:",
        *cuda_defaults,
        "",
        exit_codes_help("worker"),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worker",
        description="A kvpact worker: loads one model, builds its KV cache as --paged-attn says, serves the "
        "Worker gRPC service and registers with a router (--router), or serves standalone.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, WorkerSpec, CacheIntent, PagedAttentionConfig, FeatureIntents, WorkerOptions)
    parser.add_argument(
        "--no-prefix-caching", action=_Replaced, nargs=0, help=argparse.SUPPRESS, default=argparse.SUPPRESS
    )
    add_tls_args(parser, "worker")
    add_log_args(parser)
    return parser


class _Replaced(argparse.Action):
    """A removed flag: exit 2 naming the one that replaced it."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error("--no-prefix-caching was replaced: use --prefix-caching off")


def spec_from_args(args: argparse.Namespace) -> WorkerSpec:
    """The spec its options say; --paged-attn and the --pa-* flags -> CacheIntent via
    shared.intent.cache_intent (the mode decides `required` and whether a paged config exists)."""
    settings = PagedAttentionConfig(**option_values(PagedAttentionConfig, args))
    cache = cache_intent(option_values(CacheIntent, args)["mode"], settings)
    features = FeatureIntents(**option_values(FeatureIntents, args))
    return WorkerSpec(**option_values(WorkerSpec, args), cache=cache, features=features)


def refuse_unused_paged_flags(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """An explicit --pa-* flag is a requirement (issue 21: met or the worker fails naming why); with
    --paged-attn off there is no paged cache to meet it, so it is refused (ConfigError), never dropped."""
    if option_values(CacheIntent, args)["mode"] is not PagedAttentionMode.OFF:
        return
    probe = build_parser()  # every default suppressed: what is left was on the command line
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    given = vars(probe.parse_args(list(argv)))
    flags = [opt.flag for f, opt in options_of(PagedAttentionConfig) if f.name in given]
    if flags:
        named, one = ", ".join(flags), len(flags) == 1
        raise ConfigError(
            f"{named} set{'s' if one else ''} the paged KV cache, and --paged-attn off builds none "
            f"({'it' if one else 'they'} would be ignored); drop {named}, or use --paged-attn auto or on"
        )


def parse_args(argv: Sequence[str] | None = None) -> WorkerOptions:
    """Flags -> WorkerOptions; bad flags (including a --pa-* value the intent core rejects, or one given
    with --paged-attn off) exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        refuse_unused_paged_flags(args, sys.argv[1:] if argv is None else argv)
        values = option_values(WorkerOptions, args)
        values["worker_id"] = values["worker_id"] or f"{socket.gethostname()}-{os.getpid()}"
        if values["plan_json"] and not values["plan_only"]:
            raise ConfigError("--json goes with --plan-only (it prints the plan as JSON); add --plan-only")
        loop_factory(values["event_loop"])  # --event-loop uvloop where it is not installed: said here
        return WorkerOptions(
            spec=spec_from_args(args),
            tls=tls_from_args(args),
            log_format=args.log_format,
            log_level=args.log_level,
            **values,
        )
    except ConfigError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_args(argv)
    if options.plan_only:
        from kvpact.worker.plan_only import run_plan_only

        configure_logging(options.log_format, options.log_level, fields={"worker_id": options.worker_id})
        exit_now(run_plan_only(options.spec, options.plan_json, options.model_name))
    try:
        code = run_loop(run_worker(options), loop_factory(options.event_loop))
    except KeyboardInterrupt:  # Ctrl-C before the worker's own handlers were installed: a requested stop
        code = 0
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Exit with `code`. A worker stopped mid-load still has its load running in a daemon thread, inside
    torch's C++ code; the interpreter's finalization would then abort the process (SIGABRT, exit 134)
    instead of exiting with `code`, so skip finalization when such a thread is alive."""
    if any(t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
