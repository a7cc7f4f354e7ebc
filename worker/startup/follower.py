"""A tensor-parallel rank r > 0: join rank 0's group, plan on its own device and send rank 0 its verdict,
build what rank 0 decided (its shard, and a paged or eager KV cache of its own heads), then repeat every
step rank 0 sends until told to stop.

NOTE: it owns no scheduling state (with a paged cache, rank 0's block table arrives with each step); a
refusal or a failed build goes to rank 0 as data (rank_verdict.py), which names this rank; it exits 1 on
any error, and as soon as its parent (rank 0's process) is gone, so a rank never runs alone. Started by
parallel/ranks.RankGroup, never by hand. It lives in startup/ since it plans as the worker does.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    TCPStore,  # the public name (torch.distributed) is not exported to typing
)

from kvpact.shared.intent import PagedBackend
from kvpact.shared.log import configure_logging
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.kv.eager import EagerCache
from kvpact.worker.kv.paged import PagedCache
from kvpact.worker.loader import load_model
from kvpact.worker.loader.header import ModelHeader
from kvpact.worker.model.tensor_parallel import shard_model
from kvpact.worker.parallel import step_message
from kvpact.worker.parallel.rank_verdict import RankBuild, RankProblem, RankVerdict
from kvpact.worker.parallel.ranks import GROUP_TIMEOUT
from kvpact.worker.parallel.step_message import KEEPALIVE, StepMessage
from kvpact.worker.startup.device import DeviceProbe, probe_device
from kvpact.worker.startup.engine_setup import plan_startup, use_cpu_kernels


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def own_verdict(
    rank: int,
    spec: WorkerSpec,
    header: ModelHeader | None = None,
    log: Any = None,
    probe: DeviceProbe | None = None,
) -> RankVerdict:
    """This rank's pre-load plan on its own device (`spec.device`, or `probe` as already probed), as data
    for rank 0. `header`: the model's header as rank 0 read it (None: read here). worker --plan-only makes
    every rank's in one process (plan_only.py)."""
    log = log or structlog.get_logger("worker.rank")
    try:
        probe = probe or probe_device(spec.device, ())
        plan = plan_startup(spec, probe=probe, log=log, header=header)
    except Exception as e:  # noqa: BLE001 - a refusal or a bad flag: rank 0 raises it, naming this rank
        return RankVerdict(rank, spec.device, problem=RankProblem.of(e))
    blocks = plan.paged_size.num_blocks if plan.paged_size else 0
    return RankVerdict(rank, str(plan.probe.device), features=plan.features, num_blocks=blocks)


def build(rank: int, world: int, orders: RankBuild) -> tuple[object, EagerCache | PagedCache]:
    loaded = load_model(orders.model, device="cpu", dtype=orders.dtype)
    model = shard_model(loaded.model, rank, world, _all_reduce)
    use_cpu_kernels(model, orders.cpu_kernels)
    del loaded
    c = model.config
    dtype = getattr(torch, orders.cache_dtype)
    cache: EagerCache | PagedCache
    if orders.paged:
        cache = PagedCache(
            c.num_layers, orders.num_blocks, orders.block_size, c.num_kv_heads, c.head_dim, dtype,
            torch.device("cpu"), PagedBackend(orders.backend), max_model_len=orders.max_model_len,
            cpu_kernels=orders.cpu_kernels,
        )  # fmt: skip
    else:
        cache = EagerCache(
            c.num_layers, orders.max_num_seqs, orders.max_model_len, c.num_kv_heads, c.head_dim, dtype,
            torch.device("cpu"), sliding_window=c.sliding_window, cpu_kernels=orders.cpu_kernels,
        )  # fmt: skip
    return model, cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpact.worker.startup.follower")
    for name in ("--rank", "--world", "--parent", "--threads"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--address", required=True)
    a = p.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(a.parent,), daemon=True).start()
    torch.set_num_threads(a.threads)
    configure_logging("json", "ERROR", fields={"rank": str(a.rank)})  # rank 0 logs the plan, fallbacks
    try:
        host, port = a.address.rsplit(":", 1)
        timeout = timedelta(seconds=GROUP_TIMEOUT.total_seconds())
        # A client of the store rank 0 bound (worker/parallel/ranks.py RankGroup.start), as rank 0 joins
        store = TCPStore(host, int(port), a.world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world, timeout=timeout)
        given = step_message.broadcast()
        if given is None:  # the worker stopped before asking
            return 0
        spec: WorkerSpec = given[0]  # type: ignore[index]
        devices: list[str] = given[1]  # type: ignore[index]
        header: ModelHeader = given[2]  # type: ignore[index]
        step_message.gather(own_verdict(a.rank, replace(spec, device=devices[a.rank]), header))
        orders = step_message.broadcast()
        if not isinstance(orders, RankBuild):  # rank 0's plan failed or was refused: nothing to build
            return 0
        try:
            model, cache = build(a.rank, a.world, orders)
            problem = None
        except Exception as e:  # noqa: BLE001 - sent to rank 0, which names this rank
            problem = RankProblem.of(e)
        step_message.gather(problem)  # ready: rank 0 waits for every rank here
        if problem is not None:
            return 1
        with torch.inference_mode():
            while (message := step_message.receive()) is not None:
                if message == KEEPALIVE or not isinstance(message, StepMessage):
                    continue
                if message.block_copies:
                    assert isinstance(cache, PagedCache)
                    cache.copy_blocks(message.block_copies)
                ids = torch.tensor(message.input_ids, dtype=torch.long)
                pos = torch.tensor(message.positions(), dtype=torch.long)
                model(ids, pos, cache.attention_step(message.chunk_views(), message.num_decodes))  # type: ignore[arg-type,operator]
    except Exception as e:  # noqa: BLE001 - a rank's one line, then exit 1 (rank 0 stops the worker)
        print(f"worker rank {a.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
