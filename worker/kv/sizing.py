"""How big the KV cache is: defaults per device, budgets from the --pa-* flags, and the checks that a
configuration fits. Everything here is arithmetic on numbers known before any weight is loaded.

Defaults (quoted by `worker --help`):
  --max-model-len 0       CUDA: auto; CPU/MPS: the model's max positions, capped at 2048
  --max-model-len auto    the longest sequence one pool (PAGED) or one slot (EAGER) can hold, up to the
                          model's max positions (`fit_paged` / `fit_eager`)
  --max-num-seqs 0        EAGER: 8 slots on CPU/MPS, 16 on CUDA; PAGED: 32 on CPU/MPS, 256 on CUDA
  --max-num-batched-tokens 0   2048 on CPU/MPS, 8192 on CUDA (longer prompts are prefilled in chunks);
                               CPU/MPS: at most 12 of them prompt tokens while a sequence decodes
                               (`DeviceDefaults.prompt_tokens_beside_decodes`); an explicit N is the step's
                               budget whatever runs
  --prompt-tokens-beside-decodes 0   that bound: the device default (none with an explicit
                               --max-num-batched-tokens); an explicit N bounds every step carrying decodes
  PAGED budget, no --pa-* flag:
      CPU/MPS  min(1 GiB, 10% of system RAM)
      CUDA     0.9 x free memory - weights - activation headroom
    either capped at max_num_seqs x max_model_len tokens (more could never be in use at once)
  --pa-memory-fraction F  F x (free GPU memory | available RAM) - weights - activation headroom
  --pa-memory-bytes N     N bytes of K/V pools
  --pa-context-tokens N   ceil(N / block size) blocks
The EAGER cache reserves max_num_seqs x max_model_len tokens up front; a configuration whose weights
and eager cache exceed 90% of the free memory is refused, naming --max-model-len and --max-num-seqs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpact.shared.errors import ConfigError
from kvpact.shared.intent import GPU_DEFAULT_MEMORY_FRACTION, PagedAttentionConfig
from kvpact.shared.reasons import KV_BUDGET

GiB = 2**30
MiB = 2**20
CPU_MAX_MODEL_LEN = 2048
CPU_PAGED_BUDGET_BYTES = 1 * GiB
CPU_PAGED_BUDGET_RAM_FRACTION = 0.10
FIT_FRACTION = 0.9  # of free memory, for weights + eager cache
GPU_FIXED_HEADROOM_BYTES = 256 * MiB  # CUDA context, allocator slack


@dataclass(frozen=True, slots=True)
class DeviceDefaults:
    max_model_len_cap: int | None
    eager_max_num_seqs: int
    paged_max_num_seqs: int
    max_num_batched_tokens: int
    # A step that carries decodes carries at most this many prompt tokens (None: no separate bound). A
    # prompt chunk shares its step with every running decode, and each decode waits for all of it: on a
    # CPU a step costs a fixed part (streaming the weights, about 27-48 prompt tokens' worth for
    # SmolLM2-135M, by machine) plus every token in it, so a chunk of 48 made such a step up to 2x a
    # decode step, the target's limit itself. Once decode steps of up to 64 sequences ran on the C
    # kernels the fixed part shrank (a 16-sequence step 1.5x faster) and 32 went over it too (p99 ITL
    # 2.57x the median at 1.5x capacity, 24 2.25x, 16 1.77x: benchmarks/suites/step_budget.py,
    # docs/performance.md "Step token budget"). Once decode steps read Q4_1 panels (a decode step
    # 2-3x faster again), 16 sat at the line (1.80-2.36x over five runs) and 12 under it (1.64-1.90 in
    # three), at the same output tok/s under that load and 0.91-1.01x 16's on a burst of 32. A step with no
    # decode (a lone prompt, a burst's first step) takes the whole budget. `--prompt-tokens-beside-
    # decodes N` replaces it.
    prompt_tokens_beside_decodes: int | None = None


CPU_DEFAULTS = DeviceDefaults(CPU_MAX_MODEL_LEN, 8, 32, 2048, prompt_tokens_beside_decodes=12)
GPU_DEFAULTS = DeviceDefaults(None, 16, 256, 8192)


def device_defaults(kind: str) -> DeviceDefaults:
    return GPU_DEFAULTS if kind == "cuda" else CPU_DEFAULTS


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes  # K and V, every layer


def activation_headroom_bytes(
    *,
    device_kind: str,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype_bytes: int,
) -> int:
    """A generous estimate of one step's transient tensors (a few hidden-sized and MLP-sized
    activations per token, fp32 logits and sampler work per sequence) plus fixed slack on CUDA."""
    per_token = (6 * hidden_size + 3 * intermediate_size) * dtype_bytes
    logits = 4 * max_num_seqs * vocab_size * 4
    fixed = GPU_FIXED_HEADROOM_BYTES if device_kind == "cuda" else 0
    return max_num_batched_tokens * per_token + logits + fixed


@dataclass(frozen=True, slots=True)
class PagedSize:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget: str  # where the number came from
    flag: str  # the flag that changes it

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def memory_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token


def size_paged_cache(
    config: PagedAttentionConfig,
    *,
    device_kind: str,
    memory_total_bytes: int,
    memory_free_bytes: int,
    weight_bytes: int,
    activation_bytes: int,
    bytes_per_token: int,
    max_model_len: int,
    max_num_seqs: int,
) -> PagedSize:
    """The pool size the flags (or the device default) give. May be too small for max_model_len:
    `shortfall()` says so, and the caller routes that through the fallback door."""
    bs = config.block_size
    block_bytes = bs * bytes_per_token
    if config.context_tokens is not None:
        return PagedSize(
            -(-config.context_tokens // bs),
            bs,
            bytes_per_token,
            f"--pa-context-tokens {config.context_tokens}",
            "--pa-context-tokens",
        )
    if config.memory_bytes is not None:
        return PagedSize(
            config.memory_bytes // block_bytes,
            bs,
            bytes_per_token,
            f"--pa-memory-bytes {config.memory_bytes}",
            "--pa-memory-bytes",
        )
    left = memory_free_bytes
    if config.memory_fraction is not None:
        budget = int(config.memory_fraction * memory_free_bytes) - weight_bytes - activation_bytes
        source = (
            f"--pa-memory-fraction {config.memory_fraction} of {_mib(memory_free_bytes)} free, "
            f"less {_mib(weight_bytes)} weights and {_mib(activation_bytes)} activations"
        )
        return PagedSize(max(0, budget) // block_bytes, bs, bytes_per_token, source, "--pa-memory-fraction")
    if device_kind == "cuda":
        budget = int(GPU_DEFAULT_MEMORY_FRACTION * left) - weight_bytes - activation_bytes
        source = (
            f"the CUDA default: {GPU_DEFAULT_MEMORY_FRACTION} x {_mib(left)} free, less {_mib(weight_bytes)} "
            f"weights and {_mib(activation_bytes)} activations"
        )
    else:
        budget = min(CPU_PAGED_BUDGET_BYTES, int(CPU_PAGED_BUDGET_RAM_FRACTION * memory_total_bytes))
        source = f"the {device_kind.upper()} default: min(1 GiB, 10% of RAM) = {_mib(budget)}"
    num_blocks = max(0, budget) // block_bytes
    useful = -(-max_num_seqs * max_model_len // bs)
    return PagedSize(min(num_blocks, useful), bs, bytes_per_token, source, "--pa-memory-bytes")


def shortfall(size: PagedSize, max_model_len: int) -> str:
    """ "" when the pool holds one max_model_len sequence, else the reason (for the fallback door)."""
    if size.capacity_tokens >= max_model_len:
        return ""
    needed = -(-max_model_len // size.block_size) * size.block_size * size.bytes_per_token
    lower = (
        f"or lower --max-model-len (the largest that fits is {size.capacity_tokens})"
        if size.capacity_tokens
        else "or lower --max-model-len"
    )
    return KV_BUDGET.message(
        budget=size.budget,
        capacity=size.capacity_tokens,
        num_blocks=size.num_blocks,
        block_size=size.block_size,
        max_model_len=max_model_len,
        flag=size.flag,
        needed=_mib(needed),
        lower=lower,
    )


def fit_paged(size: PagedSize, model_limit: int) -> tuple[int, str]:
    """--max-model-len auto over a pool: the longest sequence it holds, up to the model's positions, and
    how that was chosen (for the log). 0 when the pool holds no block."""
    fit = min(model_limit, size.capacity_tokens)
    if fit == model_limit:
        return (
            fit,
            f"auto: the model's {model_limit} positions (the pool holds {size.capacity_tokens} tokens)",
        )
    return fit, (
        f"auto: the pool holds {size.capacity_tokens} tokens ({size.budget}), fewer than the model's "
        f"{model_limit} positions"
    )


def largest_eager_len(
    *, num_slots: int, bytes_per_token: int, weight_bytes: int, memory_free_bytes: int
) -> int:
    """The longest max_model_len whose eager cache (num_slots of it) still fits (check_eager_fits)."""
    allowed = int(FIT_FRACTION * memory_free_bytes) - weight_bytes
    return max(0, allowed) // (num_slots * bytes_per_token)


def fit_eager(
    *, model_limit: int, num_slots: int, bytes_per_token: int, weight_bytes: int, memory_free_bytes: int
) -> tuple[int, str]:
    """--max-model-len auto over the eager cache: the longest that fits, up to the model's positions."""
    largest = largest_eager_len(
        num_slots=num_slots,
        bytes_per_token=bytes_per_token,
        weight_bytes=weight_bytes,
        memory_free_bytes=memory_free_bytes,
    )
    if largest >= model_limit:
        return model_limit, f"auto: the model's {model_limit} positions ({num_slots} eager slots fit)"
    return largest, (
        f"auto: {num_slots} eager slots of {largest} tokens fit in "
        f"{FIT_FRACTION:g} x {_mib(memory_free_bytes)} free less "
        f"{_mib(weight_bytes)} of weights, fewer than the model's {model_limit} positions"
    )


def check_eager_fits(
    *,
    num_slots: int,
    max_model_len: int,
    bytes_per_token: int,
    weight_bytes: int,
    memory_free_bytes: int,
    device_kind: str,
) -> int:
    """Bytes of the eager cache; raises ConfigError when weights + cache exceed 90% of free memory."""
    cache_bytes = num_slots * max_model_len * bytes_per_token
    allowed = int(FIT_FRACTION * memory_free_bytes) - weight_bytes
    if cache_bytes > allowed:
        where = "free GPU memory" if device_kind == "cuda" else "available RAM"
        largest = max(0, allowed) // (num_slots * bytes_per_token)
        raise ConfigError(
            f"the eager KV cache needs {_mib(cache_bytes)} (--max-num-seqs {num_slots} x --max-model-len "
            f"{max_model_len} tokens x {bytes_per_token} bytes), but only {_mib(max(0, allowed))} of the "
            f"{_mib(memory_free_bytes)} {where} is left after {_mib(weight_bytes)} of weights; lower "
            f"--max-num-seqs or --max-model-len (the largest that fits with --max-num-seqs {num_slots} is "
            f"{largest})"
        )
    return cache_bytes


def _mib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"
