"""Every reason a worker gives for realizing an optional feature off, as data: which feature (`feature`,
a name of shared/features.py), who finds it (`component`), when (`condition`), what it says (`template`,
completing "FEATURE was explicitly requested (--FEATURE on), but ..."), what to change (`flag`), and the
short `code` the wire, the metrics and the logs carry.

One table, rendered everywhere an operator reads it: the messages (each check returns
`Reason.found(**fields)`, a `Finding`, which the fallback door records or raises), `worker --help`
(`reasons_help`) and docs/contract.md (`reasons_markdown`, through tools/render_docs.py). `condition`
may name the kernels' limits as {head_sizes}, {block_sizes}, {dtypes}, {min_cc}: the worker fills them
from kvpact.kernels.support (shared/ does not import the kernels).

Adding a reason: a `Reason` here, a check where it becomes knowable, a test for auto and for on.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

PAGED_ATTN = "paged-attn"  # the feature names (shared/features.py has them all)
PREFIX_CACHING = "prefix-caching"
CPU_KERNELS = "cpu-kernels"
QUANT_KERNELS = "quant-kernels"
CUDA_GRAPHS = "cuda-graphs"
EVERY_FEATURE = "every feature"  # a reason any feature may give (Reason.feature)


@dataclass(frozen=True, slots=True)
class Reason:
    name: str  # how --help and the docs list it
    component: str  # device | loader | cache-budget | kernels | scheduler | cache | build | engine
    condition: str  # when it applies, for the operator
    template: str  # the message, with {fields} the check fills in
    flag: str  # what the operator changes
    feature: str = PAGED_ATTN  # the feature it turns off (EVERY_FEATURE: any of them)

    @property
    def code(self) -> str:
        """The reason's stable short name: the wire's reason code and the metrics' `reason` label."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")

    def message(self, **fields: object) -> str:
        return self.template.format(**fields)

    def found(self, **fields: object) -> Finding:
        """This reason, found by a check, with its message filled in."""
        return Finding(self, self.message(**fields))


@dataclass(frozen=True, slots=True)
class Finding:
    """A check's verdict that a feature cannot be realized here: which reason, and its message."""

    reason: Reason
    message: str

    @property
    def component(self) -> str:
        return self.reason.component

    @property
    def code(self) -> str:
        return self.reason.code


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
TENSOR_PARALLEL_RANK = Reason(
    "tensor-parallel rank",
    "device",
    "a tensor-parallel rank's own check on its own device finds the feature impossible there (every "
    "feature is realized alike on every rank, the cache's kind too: under auto they all fall back "
    "together, under on the worker fails naming the rank)",
    "rank {rank} ({device}) cannot realize it: {why}",
    "--tensor-parallel-size 1, or ranks on devices that all can",
    feature=EVERY_FEATURE,
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
OFF_BY_REQUEST = Reason(
    "off by request",
    "intent",
    "the operator asked for the feature off (--FEATURE off); any feature",
    "it was started with --{feature} off",
    "--FEATURE auto or on",
    feature="any",
)
PREFIX_NEEDS_PAGED = Reason(
    "prefix cache needs paged",
    "cache",
    "prefix caching shares full KV blocks between sequences, so it needs the paged KV cache, and this worker "
    "realized the eager one (the reason PagedAttention is off is its own)",
    "prefix caching needs the paged KV cache and this worker plans an eager one ({why})",
    "--paged-attn on (or auto where it works), or --prefix-caching off",
    feature=PREFIX_CACHING,
)
CPU_KERNELS_DEVICE = Reason(
    "C kernels need CPU",
    "device",
    "the C decode and write kernels run on CPU tensors and this worker's KV cache is on an accelerator",
    "the C kernels run on CPU tensors and this worker's KV cache is on {device}",
    "--device cpu, or --cpu-kernels auto/off",
    feature=CPU_KERNELS,
)
CPU_KERNELS_DTYPE = Reason(
    "C kernels need float32 or bfloat16",
    "device",
    "the C decode and write kernels take a float32 or bfloat16 KV cache and this one is float16",
    "the C kernels take a float32 or bfloat16 KV cache and this one is {dtype}",
    "--pa-cache-dtype bfloat16 or float32 (or --dtype float32), or --cpu-kernels auto/off",
    feature=CPU_KERNELS,
)
CPU_KERNELS_WINDOW = Reason(
    "C kernels window",
    "loader",
    "the model uses sliding-window attention on the eager cache, which the C decode kernel has no window for",
    "the model uses sliding-window attention (window {window} tokens) on the eager KV cache and the C "
    "decode kernel has no window",
    "--cpu-kernels auto/off",
    feature=CPU_KERNELS,
)
CPU_KERNELS_BUILD = Reason(
    "C kernels build",
    "build",
    "no C compiler, or the C kernels (kernels/cpu_paged.c) failed to compile or load on this machine",
    "the C kernels cannot be built here: {error}",
    "install a C compiler (gcc) or set CC; or --cpu-kernels auto/off",
    feature=CPU_KERNELS,
)
QUANT_NEEDS_CPU_KERNELS = Reason(
    "quant kernels need cpu kernels",
    "kernels",
    "the quantized weights are read inside the C kernels' one-call decode layers, and cpu-kernels is off "
    "here (it never turns on for this feature)",
    "the GGUF's quantized weights are read by the C kernels and cpu-kernels is off here ({why})",
    "--cpu-kernels auto or on (and what its own reason names), or --quant-kernels auto/off",
    feature=QUANT_KERNELS,
)
QUANT_DTYPE = Reason(
    "quant kernels dtype",
    "loader",
    "the model runs in a dtype other than float32 (--dtype bfloat16): its projections are then rounded "
    "off the file's quantized values",
    "the model runs in {dtype} and the quantized kernels read a float32 model's exact GGUF values",
    "--dtype auto or float32, or --quant-kernels auto/off",
    feature=QUANT_KERNELS,
)
QUANT_ONE_CALL = Reason(
    "quant kernels one call",
    "device",
    "the decoder layers do not run in one C call on one device: tensor parallel, or a --device-map of "
    "two or more stages",
    "the quantized weights are read by the one-call decode layers and this worker splits its layers ({how})",
    "--tensor-parallel-size 1 and one --device-map entry, or --quant-kernels auto/off",
    feature=QUANT_KERNELS,
)
QUANT_NO_PANELS = Reason(
    "quant kernels cpu",
    "build",
    "this CPU has neither AVX-512 nor AVX2, so the C kernels pack no weights (kernels/cpu_paged.c)",
    "the C kernels pack no weights on this CPU (neither AVX-512 nor AVX2)",
    "a CPU with AVX2 or AVX-512, or --quant-kernels auto/off",
    feature=QUANT_KERNELS,
)
QUANT_STORED = Reason(
    "quant kernels storage",
    "loader",
    "the model's decoder projections are not stored as Q4_1 in a GGUF file (the kernels read the "
    "file's own 4-bit values), read from the file's header before any weight",
    "the decoder projections are stored as {storage}, not Q4_1 in a GGUF file",
    "a Q4_1 GGUF (the bundled model is one), or --quant-kernels auto/off",
    feature=QUANT_KERNELS,
)
QUANT_EXACT = Reason(
    "quant kernels values",
    "loader",
    "after loading, a decoder projection does not hold exactly Q4_1 values (each weight is checked "
    "against the block scale and minimum recovered from it)",
    "the loaded weights cannot be packed as Q4_1: {why}",
    "report it with the model file, or --quant-kernels auto/off",
    feature=QUANT_KERNELS,
)
NO_CUDA = Reason(
    "no CUDA device",
    "device",
    "CUDA graphs capture GPU work, and this worker runs on a CPU or Apple MPS",
    "no CUDA device: CUDA graphs need one and this worker runs on {device}",
    "--device cuda, or --cuda-graphs auto/off",
    feature=CUDA_GRAPHS,
)
GRAPHS_NEED_TRITON = Reason(
    "cuda graphs need triton paged",
    "cache",
    "the captured decode step is the paged cache's Triton kernels (they take their grid from shapes and "
    "never read back from the device), and this worker plans an eager KV cache or the torch paged backend",
    "CUDA graphs capture the Triton paged decode step and this worker plans {what}",
    "--paged-attn on --pa-backend triton (or auto), or --cuda-graphs off",
    feature=CUDA_GRAPHS,
)
GRAPHS_CAPTURE = Reason(
    "graph capture failed",
    "build",
    "capturing the decode step in CUDA graphs raised, after the weights loaded (the error is in the message)",
    "capturing the decode step in CUDA graphs failed on {device}: {error}",
    "--cuda-graphs auto or off (and report the error)",
    feature=CUDA_GRAPHS,
)
GRAPHS_PARITY = Reason(
    "graph replay differs",
    "build",
    "a replayed decode step's hidden states differed from the eager step's on the same inputs by more than "
    "1% of their largest value (checked at startup, at the smallest and largest captured batch)",
    "a replayed CUDA graph differed from the eager decode step on {device} (max difference {error:.2g} of "
    "the largest value, over {tolerance:g})",
    "--cuda-graphs auto or off (and report it)",
    feature=CUDA_GRAPHS,
)

# Found while serving, from the heartbeat's counters (router/drift.py judges them; docs/contract.md "Drift
# while serving"). The worker's state stays as built; the router reports the drift, and drains the worker
# when its policy says `on` for eager steps.
EAGER_STEPS_WHILE_SERVING = Reason(
    "eager steps while serving",
    "engine",
    "decode steps ran eagerly while serving although CUDA graphs were realized (a batch the captured sizes "
    "do not fit), counted in the heartbeat",
    "{count} decode steps ran eagerly while serving although CUDA graphs were realized",
    "--max-num-seqs within the captured batch sizes, or --policy cuda-graphs=auto",
    feature=CUDA_GRAPHS,
)
KERNEL_COMPILE_AFTER_READY = Reason(
    "kernel compile after ready",
    "kernels",
    "a Triton paged kernel variant compiled after the worker reported ready (the startup warm-up missed it; "
    "the running requests waited for the compile), counted in the heartbeat; reported, never drained",
    "{count} Triton paged kernel variants compiled after the worker was ready (the warm-up should leave 0)",
    "report it with the worker's shapes; --pa-backend torch runs without Triton",
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
    SLIDING_WINDOW,
    KV_BUDGET,
    KERNEL_SELF_TEST,
    KERNEL_ACCURACY,
    NOT_PAGED_CACHE,
    OFF_BY_REQUEST,
    PREFIX_NEEDS_PAGED,
    CPU_KERNELS_DEVICE,
    CPU_KERNELS_DTYPE,
    CPU_KERNELS_WINDOW,
    CPU_KERNELS_BUILD,
    QUANT_NEEDS_CPU_KERNELS,
    QUANT_DTYPE,
    QUANT_ONE_CALL,
    QUANT_NO_PANELS,
    QUANT_STORED,
    QUANT_EXACT,
    NO_CUDA,
    GRAPHS_NEED_TRITON,
    GRAPHS_CAPTURE,
    GRAPHS_PARITY,
    EAGER_STEPS_WHILE_SERVING,
    KERNEL_COMPILE_AFTER_READY,
    TENSOR_PARALLEL_RANK,
)


def reasons_help(limits: Mapping[str, str], width: int = 100) -> list[str]:
    """The reasons section of `worker --help`: per feature, each reason's name, then when it applies and
    what to change."""
    name_width = max(len(r.name) for r in REASONS)
    indent = " " * (name_width + 4)
    lines = []
    for feature in dict.fromkeys(r.feature for r in REASONS):
        lines.append(f" {feature}:")
        for r in (r for r in REASONS if r.feature == feature):
            text = f"{r.condition.format_map(limits)} [{r.component}; code {r.code}; change: {r.flag}]"
            lines += textwrap.wrap(
                text, width, initial_indent=f"  {r.name.ljust(name_width)}  ", subsequent_indent=indent
            )
    return lines


def reasons_markdown(limits: Mapping[str, str]) -> str:
    """The table in docs/contract.md."""
    rows = [
        "| feature | reason | code | component | when | message | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in REASONS:
        condition = r.condition.format_map(limits).replace("|", "\\|")
        cells = (f"`{r.feature}`", r.name, f"`{r.code}`", f"`{r.component}`", condition, r.template, r.flag)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
