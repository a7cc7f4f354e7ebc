"""CUDA graphs for decode (`--cuda-graphs`): the model's forward over a decode-only step, captured at
startup once per batch size and replayed with the step's inputs copied into static buffers.

NOTE: what makes a replay the eager step it stands for:
- a graph reads only the static buffers (token ids, positions, slot mapping, block tables, context
  lengths; `max_batch` rows, block tables as wide as max_model_len needs) and writes the hidden states
  into its own output. Each size's PagedAttentionStep is built on views of those buffers, its output and
  split workspace allocated by the warm-up before the capture, and its decode split count fixed from the
  full table width (the kernels bound every sequence by its context length, so a wider table only means
  splits with nothing to read). A replay allocates nothing and syncs nothing.
- a step of n decodes replays the smallest captured size B >= n. Rows n..B-1 repeat row 0 (its token,
  position, slot, block table and context length): they write row 0's K/V again, the same values into
  the same slot, and their hidden states are dropped.
- a step replays when it is decodes only with at most `max_batch` (the scheduler's max_num_seqs)
  sequences; its block copies (copy on write, n > 1) run before, outside the graph. Anything else (a
  step with a prefill chunk) runs eagerly (ModelRunner). A decode-only step that cannot replay is
  counted (`eager_steps`, the heartbeat's eager_steps_under_graphs, which the router judges as drift).

The static path (buffers, padding, one step per size) does not depend on CUDA: `capture=False` runs
the same forward on the buffers without a graph, which is how the CPU tests check it
(tests/worker/test_decode_graphs.py); a worker only builds this with its graphs captured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpact.worker.engine.accelerator import to_device
from kvpact.worker.engine.sequence import ScheduledChunk
from kvpact.worker.kv.paged import PagedAttentionStep, PagedCache
from kvpact.worker.model import LlamaForCausalLM

PARITY_TOLERANCE = 1e-2  # replay vs eager: max |difference| <= this x max |eager| (the same kernels run)


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8, up to max_batch (itself included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return (*sizes, max_batch)


class DecodeGraphs:
    def __init__(
        self, model: LlamaForCausalLM, cache: PagedCache, max_batch: int, max_model_len: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.eager_steps = 0  # decode-only steps that could not replay
        dev = cache.device
        width = -(-max_model_len // cache.block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self._forward: dict[int, Callable[[], torch.Tensor]] = {}

    def _step(self, size: int) -> PagedAttentionStep:
        return PagedAttentionStep.static_decode(
            self.cache,
            self.slot_mapping[:size],
            self.block_tables[:size],
            self.context_lens[:size],
        )

    @torch.inference_mode()
    def build(self, *, capture: bool = True) -> None:
        """Warm each size up, then (capture) record it in a CUDA graph, largest first, all sizes sharing
        one memory pool. Raises what the capture raises (the caller's door turns it into a fallback)."""
        if capture:
            with torch.cuda.device(self.cache.device):  # the capture's streams and pool: the cache's GPU
                self._build(capture=True)
        else:
            self._build(capture=False)

    def _build(self, *, capture: bool) -> None:
        pool = None
        for size in reversed(self.sizes):
            step = self._step(size)
            ids, pos = self.input_ids[:size], self.positions[:size]

            def forward(step: PagedAttentionStep = step, ids: torch.Tensor = ids, pos: torch.Tensor = pos):
                return self.model(ids, pos, step)

            if not capture:
                forward()  # the first layer checks the step's shapes and allocates its buffers
                self._forward[size] = forward
                continue
            side = torch.cuda.Stream(self.cache.device)
            side.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(side):
                forward()  # warm-up, outside the graph: shape checks, buffers, lazy inits
            torch.cuda.current_stream(self.cache.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward()
            pool = graph.pool()
            self._forward[size] = _replayer(graph, out)
        if capture:
            torch.cuda.synchronize(self.cache.device)

    def fits(self, chunks: list[ScheduledChunk], num_decodes: int) -> bool:
        """Whether this step replays; a decode-only step that does not is counted. (A step's block copies,
        copy on write for n > 1, run before its forward, outside the graph.)"""
        decode_only = num_decodes == len(chunks) and num_decodes > 0
        fits = decode_only and num_decodes <= self.max_batch
        if decode_only and not fits:
            self.eager_steps += 1
        return fits

    def run(self, decodes: list[ScheduledChunk]) -> torch.Tensor:
        """The final hidden states of `decodes` (one token each), `[len(decodes), hidden]`."""
        n = len(decodes)
        size = next(s for s in self.sizes if s >= n)
        bs = self.cache.block_size
        ids, pos, slots, ctx, tables = [], [], [], [], []
        for c in decodes:
            p = c.start
            block_ids = c.seq.block_table.block_ids
            ids.append(c.seq.token_ids[p])
            pos.append(p)
            slots.append(block_ids[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables.append(block_ids)
        pad = size - n  # rows n..size-1 repeat row 0
        ids, pos, slots, ctx = (
            ids + ids[:1] * pad,
            pos + pos[:1] * pad,
            slots + slots[:1] * pad,
            ctx + ctx[:1] * pad,
        )
        tables = tables + tables[:1] * pad
        width = max(len(t) for t in tables)
        rows = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        dev = self.cache.device
        self.input_ids[:size].copy_(to_device(torch.tensor(ids, dtype=torch.long), dev))
        self.positions[:size].copy_(to_device(torch.tensor(pos, dtype=torch.long), dev))
        self.slot_mapping[:size].copy_(to_device(torch.tensor(slots, dtype=torch.long), dev))
        self.context_lens[:size].copy_(to_device(torch.tensor(ctx, dtype=torch.int32), dev))
        self.block_tables[:size, :width].copy_(to_device(rows, dev))
        return self._forward[size]()[:n]

    @torch.inference_mode()
    def parity_error(self) -> float:
        """Replay against the eager forward on the same inputs, at the smallest and the largest size: the
        largest max |difference| over max |eager|. The inputs are token 0 at position 0 written into block
        0 (the cache is empty at startup: nothing real is overwritten)."""
        worst = 0.0
        for size in {self.sizes[0], self.sizes[-1]}:
            self.input_ids[:size] = 0
            self.positions[:size] = 0
            self.slot_mapping[:size] = 0
            self.block_tables[:size] = 0
            self.context_lens[:size] = 1
            replayed = self._forward[size]()[:size].float().clone()
            eager_step = self._step(size)
            eager = self.model(self.input_ids[:size], self.positions[:size], eager_step).float()
            scale = float(eager.abs().max()) or 1.0
            worst = max(worst, float((replayed - eager).abs().max()) / scale)
        return worst


def _replayer(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay
