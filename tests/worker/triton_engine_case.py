"""Run by tests/worker/test_triton_backend.py in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported). Builds the same tiny model twice — paged cache with the TRITON backend, and with the TORCH
backend — runs identical greedy requests through the real engine, and prints both token lists as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvpact.shared.features import FeatureMode, FeatureState
from kvpact.shared.intent import CacheDtype, PagedBackend
from kvpact.shared.realized import RealizedCache
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.model_runner import ModelRunner
from kvpact.worker.engine.request import GenerationRequest, SamplingParams
from kvpact.worker.kv.paged import PagedCache
from kvpact.worker.loader import load_model
from kvpact.worker.scheduler.block_manager import BlockManager
from kvpact.worker.scheduler.paged import PagedScheduler
from kvpact.worker.startup.kernel_warmup import warm_up_paged_kernels
from tests.factories.tiny_models import make_tiny_llama

NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 16, 16, 64
PROMPTS = [tuple(range(3, 12)), tuple(range(40, 57)), (5,)]  # 9, 17 (a block + 1) and 1 token(s)


def engine_for(model_dir: Path, backend: PagedBackend) -> Engine:
    loaded = load_model(model_dir, device="cpu", dtype=torch.float32)
    cfg = loaded.config
    cache = PagedCache(
        cfg.num_layers,
        NUM_BLOCKS,
        BLOCK_SIZE,
        cfg.num_kv_heads,
        cfg.head_dim,
        torch.float32,
        torch.device("cpu"),
        backend,
        max_model_len=MAX_MODEL_LEN,
    )
    if backend is PagedBackend.TRITON:  # as build_engine does: serving follows the warm-up's writes
        warm_up_paged_kernels(cache, num_heads=cfg.num_heads, dtype=torch.float32)
    realized = RealizedCache(
        max_model_len=MAX_MODEL_LEN,
        capacity_tokens=NUM_BLOCKS * BLOCK_SIZE,
        max_concurrency=NUM_BLOCKS * BLOCK_SIZE // MAX_MODEL_LEN,
        num_blocks=NUM_BLOCKS,
        memory_bytes=cache.memory_bytes,
        cache_dtype=CacheDtype.FLOAT32,
        backend=backend,
        block_size=BLOCK_SIZE,
        features=(
            FeatureState("paged-attn", FeatureMode.AUTO, True),
            FeatureState("prefix-caching", FeatureMode.AUTO, True),
        ),
    )
    # max_num_batched_tokens 8 forces chunked prefill, so the prefill kernel also extends a cached prefix.
    scheduler = PagedScheduler(BlockManager(NUM_BLOCKS, BLOCK_SIZE), max_num_seqs=4, max_num_batched_tokens=8)
    return Engine(
        ModelRunner(loaded.model, cache, torch.device("cpu")),
        scheduler,
        loaded.tokenizer,
        realized=realized,
        model_name=loaded.name,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=cfg.vocab_size,
    )


def main() -> None:
    model_dir = make_tiny_llama(Path(sys.argv[1]), hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    tokens = {}
    for backend in (PagedBackend.TRITON, PagedBackend.TORCH):
        with engine_for(model_dir, backend) as engine:
            requests = [
                GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=6, ignore_eos=True)
                for i, p in enumerate(PROMPTS)
            ]
            tokens[backend.value] = [r.token_ids for r in engine.run(requests, timeout=240)]
            tokens[backend.value + "_free_blocks"] = engine.stats().num_free_blocks
    print(json.dumps(tokens))


if __name__ == "__main__":
    main()
