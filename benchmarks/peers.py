"""The transformers peers of the offline suite, each given its best settings for this machine.

    load_transformers_model(path)       fp32, SDPA attention, eval mode; a .gguf file is dequantized by
                                        transformers (the same weights kvpact's loader dequantizes)
    generate_padded(model, items, b)    `model.generate` over batches of `b` requests: left padding and an
                                        attention mask, greedy, `max_new_tokens` = the batch's longest
                                        output (each request keeps the tokens it asked for)
    generate_continuous(model, items)   transformers' continuous batching (`init_continuous_batching`,
                                        the engine behind `generate_batch`), each request with its own
                                        `max_new_tokens`, in one session: a warm-up, then the timed run

Every run is under `torch.inference_mode()`, with the torch threads the process has (the same as
kvpact's worker), greedy, and EOS never stops a sequence (like kvpact's ignore_eos: EOS is not masked,
generation just goes on), so every system does the same work and greedy outputs can be compared.
A run's wall time excludes loading and warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import WorkItem

PAD_ID = 0  # any id: padded positions are masked out
CB_PAGE_SIZE = 64
CB_MAX_BATCH_TOKENS = 2048  # kvpact's CPU step budget too (which carries fewer prompt tokens beside decodes)
CB_MAX_REQUESTS = 32  # = the --max-num-seqs the suite gives kvpact
CB_TIMEOUT_S = 1800.0


@dataclass(slots=True)
class Run:
    """What one system produced for one workload: each request's output tokens (in request order)
    and the wall time from the first request submitted to the last token."""

    wall_s: float
    outputs: list[tuple[int, ...]]
    settings: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def load_transformers_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval()


def _greedy_config(model: Any, max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=-1,  # no token is -1: never stop early, every request generates max_tokens (ignore_eos)
        pad_token_id=PAD_ID,
        bos_token_id=model.config.bos_token_id,
        use_cache=True,
    )


def generate_padded(model: Any, items: Sequence[WorkItem], batch_size: int) -> Run:
    """`generate` over consecutive batches of `batch_size` requests (len(items): one padded batch)."""
    outputs: list[tuple[int, ...]] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(items), batch_size):
            batch = items[first : first + batch_size]
            width = max(len(i.prompt) for i in batch)
            ids = torch.tensor([[PAD_ID] * (width - len(i.prompt)) + list(i.prompt) for i in batch])
            mask = torch.tensor([[0] * (width - len(i.prompt)) + [1] * len(i.prompt) for i in batch])
            new = max(i.max_tokens for i in batch)
            result = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=_greedy_config(model, new)
            )
            for row, item in zip(result, batch, strict=True):
                outputs.append(tuple(row[width : width + item.max_tokens].tolist()))
    wall = time.perf_counter() - started
    settings = f"batches of {batch_size}, left padding + attention mask, SDPA, DynamicCache"
    return Run(wall, outputs, settings)


def _cb_config(items: Sequence[WorkItem]) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages = sum(-(-(len(i.prompt) + i.max_tokens) // CB_PAGE_SIZE) for i in items)
    return ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=pages + 2 * len(items) + 16,  # the whole workload fits: no preemption
        max_batch_tokens=CB_MAX_BATCH_TOKENS,
        max_requests_per_batch=CB_MAX_REQUESTS,
        allow_block_sharing=True,  # prefix sharing, its best case on the shared-prefix workload
        auto_switch_to_flash=False,  # no flash attention on CPU; SDPA as loaded
    )


def generate_continuous(model: Any, items: Sequence[WorkItem], timeout_s: float = CB_TIMEOUT_S) -> Run:
    """transformers' continuous batching: every request submitted at once, each with its own
    max_new_tokens; a two-request warm-up in the same session first (not timed)."""
    config = _greedy_config(model, max(i.max_tokens for i in items))
    cb = _cb_config(items)
    with torch.inference_mode():
        with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb, warmup=True
        ) as manager:
            warm = [list(items[0].prompt[:16]), list(items[-1].prompt[:8])]
            _collect(manager, [manager.add_request(w, max_new_tokens=4, eos_token_id=-1) for w in warm], 300)
            started = time.perf_counter()
            ids = [
                manager.add_request(list(i.prompt), max_new_tokens=i.max_tokens, eos_token_id=-1)
                for i in items
            ]
            done = _collect(manager, ids, timeout_s)
            wall = time.perf_counter() - started
    outputs = [
        tuple(done[rid].generated_tokens[: item.max_tokens]) for rid, item in zip(ids, items, strict=True)
    ]
    settings = (
        f"page {cb.page_size} tokens, {cb.num_blocks} blocks, max_batch_tokens {cb.max_batch_tokens}, "
        f"max_requests_per_batch {cb.max_requests_per_batch}, block sharing on, SDPA"
    )
    return Run(wall, outputs, settings)


def _collect(manager: Any, ids: Sequence[str | None], timeout_s: float) -> dict[str, Any]:
    wanted = {rid for rid in ids if rid is not None}
    if len(wanted) != len(ids):
        raise RuntimeError("transformers' continuous batching manager refused a request (see its log)")
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while wanted - done.keys():
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching: {len(wanted - done.keys())} requests unfinished")
        if not manager.is_running():
            raise RuntimeError("transformers' continuous batching loop stopped (see its log)")
        result = manager.get_result(timeout=1)
        if result is None or not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"continuous batching request {result.request_id} failed: {result.error}")
        done[result.request_id] = result
    return done
