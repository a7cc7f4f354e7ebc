"""The decode kernel's split-K heuristic, as plain functions (no triton import): the paged cache's
step picks a split count once per step, and the startup warm-up compiles every count it can pick.
"""

import torch

TILE = 32  # context tokens per decode loop iteration (the kernel's TILE constexpr)
MIN_TILES_PER_SPLIT = 4  # a split shorter than this is not worth its partial-output traffic
MAX_SPLITS = 32
PROGRAMS_PER_SM = 4  # the split heuristic aims for at least this many programs per SM
INTERPRETER_NUM_SMS = 4  # stand-in SM count when running under TRITON_INTERPRET=1


def choose_num_splits(num_seqs: int, kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """The split count wanted before rounding: enough (seq, kv_head, split) programs for
    PROGRAMS_PER_SM per SM (rounded up), never splits shorter than MIN_TILES_PER_SPLIT tiles,
    at most MAX_SPLITS."""
    wanted = -(-PROGRAMS_PER_SM * num_sms // max(1, num_seqs * kv_heads))
    worth = max(1, -(-max_context_len // TILE) // MIN_TILES_PER_SPLIT)
    return max(1, min(wanted, worth, MAX_SPLITS))


def default_num_splits(num_seqs: int, kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """The split count as a power of two: NUM_SPLITS is a constexpr, so every value compiles its own
    kernel; powers of two keep that to six at most (all compiled at startup, see split_variants).
    The program count is rounded up (at least PROGRAMS_PER_SM per SM), the split length bound
    (>= MIN_TILES_PER_SPLIT tiles, <= MAX_SPLITS) rounded down."""
    wanted = -(-PROGRAMS_PER_SM * num_sms // max(1, num_seqs * kv_heads))
    worth = max(1, -(-max_context_len // TILE) // MIN_TILES_PER_SPLIT)
    cap = min(worth, MAX_SPLITS)
    return min(1 << (wanted - 1).bit_length(), 1 << (cap.bit_length() - 1))


def split_variants(kv_heads: int, max_context_len: int, num_sms: int) -> tuple[int, ...]:
    """Every split count default_num_splits can return for batches of up to any size whose contexts
    are at most max_context_len: the powers of two up to its value for one sequence. (For a fixed
    batch the value is non-decreasing in the context, and the split bound grows by at most one per
    cache block of <= 64 tokens, so every smaller power of two is reached; more sequences only lower it.)"""
    top = default_num_splits(1, kv_heads, max_context_len, num_sms)
    return tuple(1 << i for i in range(top.bit_length()))


def device_num_sms(device: torch.device) -> int:
    """The SM count the heuristic sizes for (a stand-in under the interpreter). No device sync."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def decode_workspace(
    num_seqs: int, q_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fp32 partial outputs and log-sum-exps a split decode writes (None for one split);
    allocate once per step and pass to every layer's call."""
    if num_splits <= 1:
        return None
    partial = torch.empty(num_seqs, q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(num_seqs, q_heads, num_splits, dtype=torch.float32, device=device)
    return partial, lse
