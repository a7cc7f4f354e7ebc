"""A tensor-parallel rank r > 0: join rank 0's group, load the model, keep this rank's shard and an eager
KV cache of its own heads, then repeat every step rank 0 sends until told to stop.

NOTE: it owns no scheduling state; it exits 1 on any error, and as soon as its parent (rank 0's process)
is gone, so a rank never runs alone. Started by ranks.RankGroup, never by hand.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpact.worker.kv.eager import EagerCache
from kvpact.worker.loader import load_model
from kvpact.worker.model.tensor_parallel import shard_model
from kvpact.worker.parallel import step_message
from kvpact.worker.parallel.ranks import GROUP_TIMEOUT
from kvpact.worker.parallel.step_message import KEEPALIVE, StepMessage


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpact.worker.parallel.follower")
    for name in ("--rank", "--world", "--parent", "--threads", "--max-model-len", "--max-num-seqs"):
        p.add_argument(name, type=int, required=True)
    for name in ("--address", "--model", "--dtype", "--cache-dtype"):
        p.add_argument(name, required=True)
    p.add_argument("--cpu-kernels", choices=("on", "off"), required=True)  # what rank 0's plan realized
    a = p.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(a.parent,), daemon=True).start()
    torch.set_num_threads(a.threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{a.address}", rank=a.rank, world_size=a.world,
            timeout=timedelta(seconds=GROUP_TIMEOUT.total_seconds()),
        )  # fmt: skip
        loaded = load_model(a.model, device="cpu", dtype=a.dtype)
        model = shard_model(loaded.model, a.rank, a.world, _all_reduce)
        del loaded
        c = model.config
        cache = EagerCache(
            c.num_layers, a.max_num_seqs, a.max_model_len, c.num_kv_heads, c.head_dim,
            getattr(torch, a.cache_dtype), torch.device("cpu"), sliding_window=c.sliding_window,
            cpu_kernels=a.cpu_kernels == "on",
        )  # fmt: skip
        dist.barrier()  # ready: rank 0 waits for every rank here
        with torch.inference_mode():
            while (message := step_message.receive()) is not None:
                if message == KEEPALIVE or not isinstance(message, StepMessage):
                    continue
                ids = torch.tensor(message.input_ids, dtype=torch.long)
                pos = torch.tensor(message.positions(), dtype=torch.long)
                model(ids, pos, cache.attention_step(message.chunk_views(), message.num_decodes))  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - a rank's one line, then exit 1 (rank 0 stops the worker)
        print(f"worker rank {a.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
