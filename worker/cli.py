"""The `worker` command: flags -> WorkerSpec (+ process options) -> the startup sequence in worker/process.py.

Exit codes: kvpact.shared.exit_codes.EXIT_CODES (rendered into `worker --help`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from kvpact.kernels.support import (
    TRITON_BLOCK_SIZES,
    TRITON_DTYPES,
    TRITON_HEAD_SIZES,
    TRITON_MIN_COMPUTE_CAPABILITY,
)
from kvpact.shared.cli import add_log_args, add_paged_attn_arg, host_port, seconds
from kvpact.shared.errors import ConfigError
from kvpact.shared.exit_codes import exit_codes_help
from kvpact.shared.intent import (
    DEFAULT_BLOCK_SIZE,
    CacheDtype,
    PagedAttentionConfig,
    PagedAttentionMode,
    PagedBackend,
    cache_intent,
)
from kvpact.shared.reasons import reasons_help
from kvpact.shared.spec import LayerPlacement, WorkerSpec, parse_device_map
from kvpact.shared.tls import add_tls_args, tls_from_args
from kvpact.worker.engine import DEFAULT_MAX_WAITING
from kvpact.worker.kv.sizing import (
    CPU_DEFAULTS,
    CPU_PAGED_BUDGET_BYTES,
    CPU_PAGED_BUDGET_RAM_FRACTION,
    GPU_DEFAULT_MEMORY_FRACTION,
    GPU_DEFAULTS,
    GiB,
)
from kvpact.worker.process import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_ROUTER_TIMEOUT_S, WorkerOptions, run_worker

DTYPES = ("auto", "float32", "float16", "bfloat16")
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1  # what the WorkerSpec's fields carry on the wire


def _device(value: str) -> str:
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda", "mps") or (kind == "cuda" and index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda, cuda:N or mps, got {value!r}")


def _device_map(value: str) -> tuple[LayerPlacement, ...]:
    try:
        return parse_device_map(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _label(value: str) -> tuple[str, str]:
    key, sep, label = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key.strip(), label


def _whole_number(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum] (minimum 0 or 1)."""

    def parse(value: str) -> int:
        if not value.isdigit() or not minimum <= int(value) <= maximum:
            low = "> 0" if minimum else ">= 0"
            raise argparse.ArgumentTypeError(f"expected a whole number {low} and <= {maximum}, got {value!r}")
        return int(value)

    return parse


_count = _whole_number(0, UINT32_MAX)


def _max_model_len(value: str) -> int | str:
    """A whole number, or "auto" (fit it to the realized KV cache)."""
    return value if value == "auto" else _count(value)


_positive_int = _whole_number(1, UINT32_MAX)
_positive_int64 = _whole_number(1, UINT64_MAX)


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
        f"  --max-num-batched-tokens 0  {cpu.max_num_batched_tokens} "
        "(longer prompts are prefilled in chunks)",
        f"  paged budget (no --pa-*)    min({CPU_PAGED_BUDGET_BYTES / GiB:g} GiB, "
        f"{CPU_PAGED_BUDGET_RAM_FRACTION:.0%} of system RAM), at most max-num-seqs x max-model-len tokens",
    ]
    lines = [
        "Why PagedAttention is not used (auto: recorded as a fallback; on: startup fails with exit 78).",
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


def _port_or_zero(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535] (0 = a free one), got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worker",
        description="A kvpact worker: loads one model, builds its KV cache as --paged-attn says, serves the "
        "Worker gRPC service and registers with a router (--router), or serves standalone.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default="",
        help="Hugging Face model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    model.add_argument(
        "--model-name", default=None, help="the name clients use for this model (default: from the model)"
    )
    model.add_argument(
        "--device", type=_device, default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)"
    )
    model.add_argument(
        "--device-map",
        type=_device_map,
        default=(),
        metavar="DEVICE=NUM_LAYERS[,...]",
        help="place runs of decoder layers on devices in order, e.g. cuda:0=20,cpu=10",
    )
    model.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="weight dtype (default auto: the device's default)"
    )
    model.add_argument(
        "--max-model-len",
        type=_max_model_len,
        default=0,
        metavar="N|auto",
        help="longest sequence in tokens; auto: the longest one sequence can have in the realized KV cache, "
        "up to the model's positions (logged with how it was chosen). A value that cannot fit: under "
        "--paged-attn on startup fails, under auto it falls back to the eager cache; either way the message "
        "names the largest value that fits (0 = default: auto on CUDA, min(model, 2048) on CPU/MPS)",
    )
    model.add_argument(
        "--max-num-seqs", type=_count, default=0, help="most sequences run at once (0 = default)"
    )
    model.add_argument(
        "--max-num-batched-tokens",
        type=_count,
        default=0,
        help="most tokens in one engine step (0 = default)",
    )

    cache = parser.add_argument_group("KV cache and PagedAttention")
    add_paged_attn_arg(cache)
    cache.add_argument(
        "--pa-block-size",
        type=_positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
    )
    budget = cache.add_mutually_exclusive_group()
    budget.add_argument(
        "--pa-memory-fraction",
        type=float,
        metavar="F",
        help="KV cache budget: F x the memory free at startup (GPU memory, or available RAM on CPU), less "
        "the weights and activation headroom; F in (0, 1] is the share of free memory this worker may use "
        f"in all (the CUDA default is {GPU_DEFAULT_MEMORY_FRACTION:g})",
    )
    budget.add_argument("--pa-memory-bytes", type=_positive_int64, help="KV cache budget in bytes")
    budget.add_argument("--pa-context-tokens", type=_positive_int64, help="KV cache budget in tokens")
    cache.add_argument(
        "--pa-cache-dtype",
        choices=[d.value for d in CacheDtype],
        default="auto",
        help="KV element type (default: the model's)",
    )
    cache.add_argument(
        "--pa-backend",
        choices=[b.value for b in PagedBackend],
        default="auto",
        help="paged attention kernels: triton (CUDA) or torch (any device); auto picks (default auto)",
    )
    cache.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse cached blocks of repeated prompt prefixes",
    )
    cache.add_argument(
        "--no-kv-cache", action="store_true", help="recompute attention over the whole sequence every step"
    )

    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--listen",
        type=host_port,
        default=("127.0.0.1", 0),
        metavar="HOST:PORT",
        help="where the Worker service listens (default 127.0.0.1:0, a free port)",
    )
    serving.add_argument(
        "--advertise-host",
        default=None,
        metavar="HOST",
        help="the host (name or IP) the router reaches this worker at, with the port it bound (default: the "
        "--listen host; a wildcard --listen advertises this machine's hostname). kvpact-launch sets the "
        "node's IP as Ray reports it, since other nodes may not resolve a hostname",
    )
    serving.add_argument(
        "--label",
        type=_label,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="shown with this worker in the router's ClusterStatus and failure report; repeatable "
        "(kvpact-launch sets ray.node, ray.node_ip and ray.bundle)",
    )
    serving.add_argument(
        "--router",
        type=host_port,
        default=None,
        metavar="HOST:PORT",
        help="register with this router (default: serve standalone)",
    )
    serving.add_argument(
        "--router-timeout",
        type=seconds,
        default=DEFAULT_ROUTER_TIMEOUT_S,
        metavar="SECONDS",
        help="retry the handshake this long before giving up with exit 1; also how long the router may be "
        f"unreachable before a warning (default {DEFAULT_ROUTER_TIMEOUT_S:.0f})",
    )
    serving.add_argument(
        "--worker-id", default=None, help="this worker's name in the cluster (default HOSTNAME-PID)"
    )
    serving.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the router's shared secret (the first line is sent; re-read on SIGHUP)",
    )
    serving.add_argument(
        "--metrics-port",
        type=_port_or_zero,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics (kvpact_worker_*) at http://HOST:PORT/metrics on the --listen host "
        "(0 = a free port, printed at startup; default: off)",
    )
    add_tls_args(parser, "worker")
    parser.add_argument(
        "--log-prompts",
        action="store_true",
        help="put each request's prompt in its `request` log line (DEBUG); without it no prompt text is "
        "ever logged",
    )
    serving.add_argument(
        "--max-waiting",
        type=_whole_number(1, UINT32_MAX),
        default=DEFAULT_MAX_WAITING,
        metavar="N",
        help="at most N requests accepted and not yet running (being tokenized, queued or waiting for a "
        "place in the batch); past it a new request is refused at once with RESOURCE_EXHAUSTED naming "
        f"this flag (default {DEFAULT_MAX_WAITING})",
    )
    serving.add_argument(
        "--drain-timeout",
        type=seconds,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM, let in-flight requests finish this long (new ones are refused and the router "
        f"shows DRAINING), then deregister and exit 0 (default {DEFAULT_DRAIN_TIMEOUT_S:.0f})",
    )
    add_log_args(parser)
    return parser


def spec_from_args(args: argparse.Namespace) -> WorkerSpec:
    """The CLI mapping: --paged-attn and the --pa-* flags -> CacheIntent via shared.intent.cache_intent."""
    settings = PagedAttentionConfig(
        block_size=args.pa_block_size,
        memory_fraction=args.pa_memory_fraction,
        memory_bytes=args.pa_memory_bytes,
        context_tokens=args.pa_context_tokens,
        cache_dtype=CacheDtype(args.pa_cache_dtype),
        backend=PagedBackend(args.pa_backend),
        prefix_caching=not args.no_prefix_caching,
    )
    return WorkerSpec(
        model=args.model,
        device=args.device,
        device_map=args.device_map,
        dtype=args.dtype,
        max_model_len=0 if args.max_model_len == "auto" else args.max_model_len,
        max_model_len_auto=args.max_model_len == "auto",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cache=cache_intent(PagedAttentionMode(args.paged_attn), settings, no_kv_cache=args.no_kv_cache),
    )


def parse_args(argv: Sequence[str] | None = None) -> WorkerOptions:
    """Flags -> WorkerOptions; bad flags (including a --pa-* value the intent core rejects) exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
        tls = tls_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    host, port = args.listen
    return WorkerOptions(
        spec=spec,
        listen_host=host,
        listen_port=port,
        advertise_host=args.advertise_host,
        labels=tuple(args.label),
        router=f"{args.router[0]}:{args.router[1]}" if args.router else None,
        router_timeout_s=args.router_timeout,
        worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        model_name=args.model_name,
        auth_token_file=args.auth_token_file,
        tls=tls,
        max_waiting=args.max_waiting,
        drain_timeout_s=args.drain_timeout,
        log_format=args.log_format,
        log_level=args.log_level,
        metrics_port=args.metrics_port,
        log_prompts=args.log_prompts,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_args(argv)
    try:
        code = asyncio.run(run_worker(options))
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
