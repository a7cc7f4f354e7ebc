"""Every reason a worker gives for not using PagedAttention, as data: who finds it (`component`), when
(`condition`), what it says (`template`, completing "PagedAttention was explicitly requested
(--paged-attn on), but ..."), and what to change (`flag`).

One table, rendered everywhere an operator reads it: the messages (each check calls
`Reason.message(**fields)` and passes `Reason.component` to `disable_paged_attention`), `worker --help`
(`reasons_help`) and docs/contract.md (`reasons_markdown`, through tools/render_docs.py). `condition`
may name the kernels' limits as {head_sizes}, {block_sizes}, {dtypes}, {min_cc}: the worker fills them
from kvpact.kernels.support (shared/ does not import the kernels).

Adding a reason: a `Reason` here, a call where it becomes knowable, a test for auto and for on.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reason:
    name: str  # how --help and the docs list it
    component: str  # device | loader | cache-budget | kernels | scheduler
    condition: str  # when it applies, for the operator
    template: str  # the message, with {fields} the check fills in
    flag: str  # what the operator changes

    def message(self, **fields: object) -> str:
        return self.template.format(**fields)


MIXED_DEVICE_MAP = Reason(
    "mixed device map",
    "device",
    "--device-map puts layers on CPU and on an accelerator (no CPU paged cache for GPU kernels)",
    "device mapping includes CPU and PagedAttention has no CPU KV cache",
    "--device-map (one kind of device)",
)
STAGED_DEVICE_MAP = Reason(
    "staged device map",
    "device",
    "--device-map has two or more entries on one kind of device (the layers run as stages; the paged "
    "cache is not staged)",
    "--device-map {device_map} runs the layers as {num_stages} stages and the paged KV cache does not "
    "span stages",
    "--device-map with one entry, or --device",
)
TENSOR_PARALLEL = Reason(
    "tensor parallel",
    "device",
    "--tensor-parallel-size above 1 (the ranks keep eager caches of their own heads in this build)",
    "--tensor-parallel-size {size} shards the KV cache over {size} ranks and the paged cache is not "
    "sharded across ranks yet",
    "--tensor-parallel-size 1",
)
EAGER_DEFAULT = Reason(
    "CPU/MPS default",
    "device",
    "on CPU and Apple MPS, auto keeps the eager KV cache; on uses the torch paged backend",
    "eager is the {device} default (use --paged-attn on for the torch paged backend)",
    "--paged-attn on",
)
TRITON_OFF_CUDA = Reason(
    "Triton off CUDA",
    "device",
    "--pa-backend triton on a device that is not CUDA",
    "the Triton paged backend needs a CUDA device and this worker runs on {device}",
    "--pa-backend auto or torch",
)
NO_TRITON = Reason(
    "no Triton",
    "device",
    "a CUDA device but Triton cannot be imported, so the Triton paged kernels cannot run",
    "this build has no usable Triton (import failed), so the Triton paged kernels cannot run",
    "install the worker extra's triton, or --pa-backend torch",
)
KERNEL_LIMITS_UNKNOWN = Reason(
    "kernel limits unknown",
    "device",
    "the kernels did not report what they support (a broken install)",
    "the Triton paged kernels did not report what they support",
    "reinstall kvpact[worker], or --pa-backend torch",
)
COMPUTE_CAPABILITY = Reason(
    "compute capability",
    "device",
    "the Triton paged kernels need compute capability >= {min_cc}",
    "the Triton paged kernels need compute capability >= {need} and {gpu} has {have}",
    "--pa-backend torch",
)
BLOCK_SIZE = Reason(
    "block size",
    "device",
    "the Triton paged kernels take --pa-block-size {block_sizes}",
    "the Triton paged kernels take block sizes {sizes}, not --pa-block-size {block_size}",
    "--pa-block-size",
)
HEAD_SIZE = Reason(
    "head size",
    "device",
    "the Triton paged kernels take head sizes {head_sizes}",
    "the model's head size {head_size} is not one the Triton paged kernels take ({sizes})",
    "--pa-backend torch",
)
KV_DTYPE = Reason(
    "dtype",
    "device",
    "the Triton paged kernels take KV dtypes {dtypes}",
    "the Triton paged kernels take KV dtypes {dtypes}, not {dtype}",
    "--dtype or --pa-cache-dtype",
)
SHARED_MEMORY = Reason(
    "shared memory",
    "kernels",
    "the GPU's opt-in shared memory per block cannot hold the Triton paged kernels' tiles for the KV dtype "
    "and head size (fp32 KV with head size 256 on a 99 KB sm_86/sm_89 GPU: A10G, L4, L40S, RTX 3090/4090)",
    "the Triton paged kernels need {need} bytes of shared memory per block for {dtype} KV with head size "
    "{head_size}, and {gpu} allows {have} (a 16-bit --pa-cache-dtype needs about half)",
    "--pa-cache-dtype bfloat16, or --pa-backend torch",
)
SLIDING_WINDOW = Reason(
    "sliding window",
    "loader",
    "the model's attention window is shorter than --max-model-len (the paged kernels attend over the "
    "whole context)",
    "the model uses sliding-window attention (window {window} tokens) and the paged kernels "
    "attend over the whole context, which differs once a sequence passes {window} tokens "
    "(--max-model-len is {max_model_len}; lower it to {window} to use PagedAttention)",
    "--max-model-len (to the window)",
)
KV_BUDGET = Reason(
    "KV budget",
    "cache-budget",
    "the --pa-* budget cannot hold one --max-model-len sequence",
    "the KV cache budget ({budget}) holds only {capacity} tokens ({num_blocks} blocks of {block_size}), "
    "fewer than one --max-model-len {max_model_len} sequence; raise {flag} (at least {max_model_len} "
    "tokens = {needed}) {lower}",
    "--pa-context-tokens / --pa-memory-fraction / --pa-memory-bytes, or --max-model-len",
)
KERNEL_SELF_TEST = Reason(
    "kernel self-test",
    "kernels",
    "the Triton paged kernels, run once at startup with the model's shapes, failed to compile or run on "
    "this GPU",
    "the Triton paged kernels failed a startup self-test on {where}: {error} "
    "(--pa-backend torch runs PagedAttention without them)",
    "--pa-backend torch",
)
KERNEL_ACCURACY = Reason(
    "kernel accuracy",
    "kernels",
    "the Triton paged kernels, run once at startup with the model's shapes, disagreed with the torch "
    "reference on this GPU",
    "the Triton paged kernels' {kernel} is off the torch reference by {error} (more than {tolerance} in "
    "{dtype}) in a startup self-test on {where} (--pa-backend torch runs PagedAttention without them)",
    "--pa-backend torch",
)
NOT_PAGED_CACHE = Reason(
    "cache built",
    "scheduler",
    "the cache the worker actually built is not paged (the last check, after loading)",
    "the worker built {built}, not a paged one",
    "whichever reason the startup log names first",
)

REASONS = (
    EAGER_DEFAULT,
    NO_TRITON,
    TRITON_OFF_CUDA,
    KERNEL_LIMITS_UNKNOWN,
    COMPUTE_CAPABILITY,
    HEAD_SIZE,
    BLOCK_SIZE,
    KV_DTYPE,
    SHARED_MEMORY,
    MIXED_DEVICE_MAP,
    STAGED_DEVICE_MAP,
    TENSOR_PARALLEL,
    SLIDING_WINDOW,
    KV_BUDGET,
    KERNEL_SELF_TEST,
    KERNEL_ACCURACY,
    NOT_PAGED_CACHE,
)


def reasons_help(limits: Mapping[str, str], width: int = 100) -> list[str]:
    """The reasons section of `worker --help`: name, then when it applies and what to change."""
    name_width = max(len(r.name) for r in REASONS)
    indent = " " * (name_width + 4)
    lines = []
    for r in REASONS:
        text = f"{r.condition.format_map(limits)} [{r.component}; change: {r.flag}]"
        lines += textwrap.wrap(
            text, width, initial_indent=f"  {r.name.ljust(name_width)}  ", subsequent_indent=indent
        )
    return lines


def reasons_markdown(limits: Mapping[str, str]) -> str:
    """The table in docs/contract.md."""
    rows = ["| reason | component | when | message | change |", "|---|---|---|---|---|"]
    for r in REASONS:
        condition = r.condition.format_map(limits).replace("|", "\\|")
        rows.append(f"| {r.name} | `{r.component}` | {condition} | {r.template} | {r.flag} |")
    return "\n".join(rows)
