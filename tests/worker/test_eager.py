"""The eager cache's AttentionStep against a plain reference, with and without a sliding window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpact.worker.engine.request import SamplingParams
from kvpact.worker.engine.sequence import ScheduledChunk, Sequence
from kvpact.worker.kv.eager import EagerCache
from tests.factories.tiny_models import ContiguousAttention

HEADS, KV_HEADS, DIM = 4, 2, 16


def slotted(name: str, slot: int) -> Sequence:
    s = Sequence.create(0, name, list(range(64)), SamplingParams(), 1, frozenset(), torch.device("cpu"))
    s.slot = slot
    return s


STEPS = [
    [("a", 0, 9), ("b", 0, 6)],
    [("a", 9, 1), ("b", 6, 1), ("c", 0, 3)],
    [("a", 10, 1), ("c", 3, 7), ("b", 7, 5)],
    [("a", 11, 1), ("b", 12, 1), ("c", 10, 1)],
]


def run_steps(cache: EagerCache, reference) -> None:  # type: ignore[no-untyped-def]
    seqs = {"a": slotted("a", 2), "b": slotted("b", 0), "c": slotted("c", 3)}
    torch.manual_seed(0)
    for step in STEPS:
        chunks = [ScheduledChunk(seqs[name], start, n) for name, start, n in step]
        num_decodes = next(i for i, c in enumerate([*chunks, None]) if c is None or c.num_tokens != 1)
        n = sum(c.num_tokens for c in chunks)
        q, k, v = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM)
        got = cache.attention_step(chunks, num_decodes).forward(0, q, k, v)
        torch.testing.assert_close(got, reference(step, q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["c-decode-kernel", "torch-sdpa"])
@torch.inference_mode()
def test_eager_step_equals_contiguous_attention(native):
    cache = EagerCache(1, 4, 64, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    assert (cache.native is not None) and cache.kernels.startswith("CPU C decode kernel")
    if not native:  # the path a worker without a C compiler (or with another dtype) takes
        cache.native = None
    ref = ContiguousAttention()
    ids = {"a": 0, "b": 1, "c": 2}
    run_steps(
        cache,
        lambda step, q, k, v: ref.step([ids[s[0]] for s in step], [s[2] for s in step]).forward(0, q, k, v),
    )


@torch.inference_mode()
def test_sliding_window_sees_only_the_last_window_positions():
    window = 4
    cache = EagerCache(
        1, 4, 64, KV_HEADS, DIM, torch.float32, torch.device("cpu"), sliding_window=window, cpu_kernels=False
    )
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def windowed(step, q, k, v):  # type: ignore[no-untyped-def]
        outs, offset = [], 0
        for name, start, n in step:
            old_k, old_v = history.get(name, (k[:0], v[:0]))
            keys, values = (
                torch.cat([old_k, k[offset : offset + n]]),
                torch.cat([old_v, v[offset : offset + n]]),
            )
            history[name] = (keys, values)
            t = torch.arange(start + n)
            p = torch.arange(start, start + n)[:, None]
            mask = (t <= p) & (t > p - window)
            out = F.scaled_dot_product_attention(
                q[offset : offset + n].transpose(0, 1),
                keys.repeat_interleave(2, 1).transpose(0, 1),
                values.repeat_interleave(2, 1).transpose(0, 1),
                attn_mask=mask,
            )
            outs.append(out.transpose(0, 1))
            offset += n
        return torch.cat(outs)

    run_steps(cache, windowed)


@pytest.mark.parametrize("rows", [torch.float32, torch.bfloat16], ids=["float32-model", "bfloat16-model"])
@torch.inference_mode()
def test_a_bfloat16_cache_decodes_on_the_c_kernel_over_the_values_it_holds(rows):
    # A bfloat16 eager cache (--dtype bfloat16, or --pa-cache-dtype bfloat16 where paged fell back): the
    # C kernel takes float32 rows over it. Inputs bfloat16 can hold exactly, so the cache holds them as
    # they are: the decodes' rows equal float32 attention on them; prefills run torch's SDPA in bfloat16.
    cache = EagerCache(1, 4, 64, KV_HEADS, DIM, torch.bfloat16, torch.device("cpu"))
    assert cache.native is not None
    ref = ContiguousAttention()
    seqs, ids = {"a": slotted("a", 2), "b": slotted("b", 0), "c": slotted("c", 3)}, {"a": 0, "b": 1, "c": 2}
    torch.manual_seed(0)
    for step in STEPS:
        chunks = [ScheduledChunk(seqs[name], start, n) for name, start, n in step]
        d = next(i for i, c in enumerate([*chunks, None]) if c is None or c.num_tokens != 1)
        n = sum(c.num_tokens for c in chunks)
        q, k, v = (torch.randn(n, h, DIM).bfloat16().float() for h in (HEADS, KV_HEADS, KV_HEADS))
        got = cache.attention_step(chunks, d).forward(0, q.to(rows), k.to(rows), v.to(rows))
        want = ref.step([ids[s[0]] for s in step], [s[2] for s in step]).forward(0, q, k, v)
        assert got.dtype is rows
        exact = 1e-5 if rows is torch.float32 else 1e-2  # a bfloat16 model's output is rounded to it
        torch.testing.assert_close(got[:d].float(), want[:d], atol=exact, rtol=exact)
        torch.testing.assert_close(got[d:].float(), want[d:], atol=3e-2, rtol=3e-2)
