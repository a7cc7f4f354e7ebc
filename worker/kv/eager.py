"""The eager KV cache: one contiguous K/V region per slot, reserved at max_model_len.

Per layer, `key[layer]` and `value[layer]` are [num_slots, max_model_len, kv_heads, head_dim]; the
sequence in slot s keeps position p at `key[layer][s, p]`. Memory is reserved up front for every
slot at full length, which is simple and never runs out mid-sequence, but it caps concurrency at
`num_slots` however short the sequences are (the paged cache does not).

With `sliding_window` W, a token at position p attends to positions p - W < t <= p (as Mistral and
Qwen2 define it); the paged kernels have no window, so startup routes such models here.

Decodes on a CPU float32 or bfloat16 cache without a window run kernels/cpu_paged.py's C decode kernel
(float32 rows in and out), reading each slot where it lies (a slot is a block of max_model_len tokens);
otherwise their histories are gathered and attended with torch's SDPA. Longer chunks attend with SDPA
on their slot's view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpact.kernels import cpu_paged
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.worker.engine.accelerator import to_device
from kvpact.worker.engine.sequence import ScheduledChunk


class EagerCache:
    kind = CacheKind.EAGER

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_model_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        sliding_window: int | None = None,
        cpu_kernels: bool = True,
    ) -> None:
        shape = (num_slots, max_model_len, num_kv_heads, head_dim)
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.scale = head_dim**-0.5
        self.device = device
        self.sliding_window = sliding_window
        # Decodes read their slot in place with the C decode kernel (a slot is one block of
        # max_model_len tokens) where the plan realized --cpu-kernels; else the decodes' histories are
        # gathered and attended with torch's SDPA. The plan decides (worker/startup/checks.py).
        if cpu_kernels and sliding_window is not None:
            raise ValueError(
                "the C decode kernel has no sliding window: build this cache with cpu_kernels=False"
            )
        self.native = cpu_paged.required(dtype, device) if cpu_kernels else None
        self.kernels = (
            f"CPU C decode kernel ({self.native.path.name})"
            if self.native is not None
            else "torch SDPA on gathered histories (cpu-kernels realized off)"
        )

    @property
    def cpu_kernels(self) -> bool:
        """Whether decodes run the C kernel (what --cpu-kernels realized)."""
        return self.native is not None

    def visible(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """[num_queries, num_keys] bool: which keys each query attends to (causal, windowed if set)."""
        mask = key_positions[None, :] <= query_positions[:, None]
        if self.sliding_window is not None:
            mask &= key_positions[None, :] > query_positions[:, None] - self.sliding_window
        return mask

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key + self.value)

    def attention_step(self, chunks: list[ScheduledChunk], num_decodes: int) -> EagerAttentionStep:
        return EagerAttentionStep(self, chunks, num_decodes)


class EagerAttentionStep:
    """One step's view of the eager cache. Decodes (one token each) attend in one batched call;
    each longer chunk attends on its own with a causal mask offset by its cached prefix.

    `forward` returns a buffer of the step's, every row rewritten by each call: valid until the step's
    next `forward` (each layer consumes its attention output before the next layer runs)."""

    def __init__(self, cache: EagerCache, chunks: list[ScheduledChunk], num_decodes: int) -> None:
        self.cache = cache
        self.num_decodes = num_decodes
        dev = cache.device
        decodes = chunks[:num_decodes]
        self.decode_slots = to_device(torch.tensor([c.seq.slot for c in decodes], dtype=torch.long), dev)
        self.decode_positions = to_device(torch.tensor([c.start for c in decodes], dtype=torch.long), dev)
        self.decode_len = max((c.end for c in decodes), default=0)
        if cache.native is not None:  # the C kernel: a slot is a one-block table; no mask, no gather
            self.decode_tables = self.decode_slots.to(torch.int32)[:, None]
            self.decode_context_lens = (self.decode_positions + 1).to(torch.int32)
            self.decode_flat_slots = self.decode_slots * cache.max_model_len + self.decode_positions
            self._checked = False
        else:  # [num_decodes, 1, 1, decode_len]
            self.decode_mask = cache.visible(
                torch.arange(self.decode_len, device=dev), self.decode_positions
            )[:, None, None, :]
        self._out: torch.Tensor | None = None  # the step's output, reused by every layer
        self.prefills: list[tuple[int, int, int, int]] = []  # (slot, start, num_tokens, offset in batch)
        offset = num_decodes
        for c in chunks[num_decodes:]:
            assert c.seq.slot is not None
            self.prefills.append((c.seq.slot, c.start, c.num_tokens, offset))
            offset += c.num_tokens

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = self.cache.key[layer_idx], self.cache.value[layer_idx]
        if self._out is None:  # the first layer allocates the step's output; the others reuse it
            self._out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        out = self._out
        d = self.num_decodes
        native = self.cache.native
        if d and native is not None:  # the C kernels: float32 rows over a float32 or bfloat16 cache
            check, self._checked = not self._checked, True  # the first layer checks for all of them
            rows32 = q.dtype is torch.float32
            if d == q.shape[0]:  # decodes only: no slices (a no-op view is a dispatch too)
                query, key, value, dest = q, k, v, out
            else:
                query, key, value, dest = q[:d], k[:d], v[:d], out[:d]
            if not rows32:
                query, key, value = query.float(), key.float(), value.float()
            native.write(key, value, key_cache, value_cache, self.decode_flat_slots, check=check)
            got = native.decode(
                query,
                key_cache,
                value_cache,
                self.decode_tables,
                self.decode_context_lens,
                self.cache.scale,
                out=dest if rows32 else None,
                check=check,
            )
            if not rows32:
                dest[:] = got
        torch_path = self.prefills or (d and native is None)  # writes and attends in the cache's dtype
        if torch_path and q.dtype != key_cache.dtype:
            k, v = k.to(key_cache.dtype), v.to(key_cache.dtype)
        if d and native is None:
            key_cache[self.decode_slots, self.decode_positions] = k[:d]
            value_cache[self.decode_slots, self.decode_positions] = v[:d]
            keys = key_cache[self.decode_slots, : self.decode_len]  # [d, len, kv_heads, head_dim]
            values = value_cache[self.decode_slots, : self.decode_len]
            out[:d] = self._attend(q[:d, None], keys, values, self.decode_mask)[:, 0]
        for slot, start, n, offset in self.prefills:
            end = start + n
            key_cache[slot, start:end] = k[offset : offset + n]
            value_cache[slot, start:end] = v[offset : offset + n]
            keys, values = key_cache[slot, None, :end], value_cache[slot, None, :end]
            # query j sits at position start + j and sees keys 0..start + j (within the window)
            mask = None
            if start or (self.cache.sliding_window is not None and end > self.cache.sliding_window):
                mask = self.cache.visible(
                    torch.arange(end, device=q.device), torch.arange(start, end, device=q.device)
                )
            out[offset : offset + n] = self._attend(q[None, offset : offset + n], keys, values, mask)[0]
        return out

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [b, q_len, heads, dim], keys/values [b, kv_len, kv_heads, dim] -> [b, q_len, heads, dim].
        mask None = plain causal (q_len == kv_len)."""
        q_t = q.transpose(1, 2).to(keys.dtype)
        k_t, v_t = keys.transpose(1, 2), values.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_t, k_t, v_t, attn_mask=mask, is_causal=mask is None, scale=self.cache.scale, enable_gqa=True
        )
        return out.transpose(1, 2).to(q.dtype)
