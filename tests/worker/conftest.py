"""Fixtures for the engine tests: tiny models on disk (once per session) and engines built through the
real startup path (`kvpact.worker.startup.engine_setup.build_engine`), closed at the end of each test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpact.shared.features import FeatureIntents
from kvpact.shared.intent import PagedAttentionConfig, PagedAttentionMode, cache_intent
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.request import GenerationOutput, GenerationRequest, GenerationResult, SamplingParams
from kvpact.worker.startup.engine_setup import build_engine
from tests.factories.tiny_models import make_tiny_llama, make_tiny_qwen2

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def worker_spec(
    model: Path | str,
    mode: str = "auto",
    *,
    max_model_len: int = 256,
    max_num_seqs: int = 0,
    max_num_batched_tokens: int = 0,
    prompt_tokens_beside_decodes: int = 0,
    features: FeatureIntents | None = None,
    dtype: str = "auto",
    **paged: object,
) -> WorkerSpec:
    """A CPU WorkerSpec; `paged` are PagedAttentionConfig fields (context_tokens=..., block_size=...),
    `features` the other features' modes (default: every one auto), `dtype` the weights' (--dtype)."""
    settings = PagedAttentionConfig(**paged)  # type: ignore[arg-type]
    return WorkerSpec(
        model=str(model),
        device="cpu",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prompt_tokens_beside_decodes=prompt_tokens_beside_decodes,
        cache=cache_intent(PagedAttentionMode(mode), settings),
        features=features or FeatureIntents(),
        dtype=dtype,
    )


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """make_engine(model_dir, mode="auto", **worker_spec kwargs) -> an Engine, closed after the test."""
    engines: list[Engine] = []

    def make(model: Path | str, mode: str = "auto", **kwargs: object) -> Engine:
        engine = build_engine(worker_spec(model, mode, **kwargs))  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def greedy(
    request_id: str, prompt: tuple[int, ...] | str, max_tokens: int = 16, **kwargs: object
) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, GREEDY, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


async def collect(engine: Engine, request: GenerationRequest, delay: float = 0.0) -> GenerationResult:
    await asyncio.sleep(delay)
    pieces: list[GenerationOutput] = [p async for p in engine.generate(request)]
    return GenerationResult.join(pieces)


def run_staggered(
    engine: Engine, requests: list[GenerationRequest], gap_s: float = 0.01
) -> list[GenerationResult]:
    """Submit request i after i * gap_s seconds (so later ones join a running batch); results in order."""

    async def main() -> list[GenerationResult]:
        return await asyncio.gather(*(collect(engine, r, i * gap_s) for i, r in enumerate(requests)))

    return asyncio.run(main())


def paced_steps(engine: Engine, step_s: float = 0.005) -> None:
    """From now on each of the engine's steps takes at least `step_s`. A tiny model decodes a token in
    well under a millisecond on the C kernels, so a test that acts while a request is still running (a
    second request with its id, a cancel, close, a caller that falls behind) paces the steps rather
    than race them: 60 tokens then last at least 0.3 s, whatever the machine."""
    run = engine.step_loop.runner.run

    def paced(chunks):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        result = run(chunks)
        time.sleep(max(0.0, step_s - (time.monotonic() - started)))
        return result

    engine.step_loop.runner.run = paced  # type: ignore[method-assign]
