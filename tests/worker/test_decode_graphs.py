"""The CUDA-graph decode path's static half, on the CPU: the same forward over static buffers, padded to a
captured batch size, gives the eager engine's greedy tokens (worker/engine/decode_graphs.py). The capture
itself needs a GPU: benchmarks/gpu_check.sh runs it there."""

from __future__ import annotations

import pytest

from kvpact.shared.features import FeatureState
from kvpact.worker.engine.decode_graphs import DecodeGraphs, capture_sizes
from kvpact.worker.engine.sequence import ScheduledChunk
from kvpact.worker.kv.paged import PagedCache
from tests.worker.conftest import greedy, run_staggered
from tests.worker.test_parity import PROMPT_LENGTHS, prompts

PAGED = dict(mode="on", context_tokens=4096, max_num_seqs=6)


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)


def static_engine(make_engine, model):
    """A paged engine whose runner replays decode steps through DecodeGraphs' static path (no capture on a
    CPU), counting the steps that replayed."""
    engine = make_engine(model, **PAGED)
    runner = engine.step_loop.runner
    assert isinstance(runner.cache, PagedCache)
    graphs = DecodeGraphs(runner.model, runner.cache, max_batch=6, max_model_len=engine.max_model_len)
    graphs.build(capture=False)
    replayed: list[int] = []
    run = graphs.run

    def counted(decodes: list[ScheduledChunk]):  # type: ignore[no-untyped-def]
        replayed.append(len(decodes))
        return run(decodes)

    graphs.run = counted  # type: ignore[method-assign]
    runner.graphs = graphs
    return engine, graphs, replayed


@pytest.mark.parametrize("staggered", [False, True], ids=["together", "staggered"])
def test_static_decode_steps_give_the_eager_steps_tokens(make_engine, tiny_llama, staggered):
    """8 prompts on 6 sequences: decode batches of every size from 1 to 6 (padded to 1, 2, 4, 6), joined by
    prefills (those steps run eagerly); the tokens equal the same engine's without graphs."""
    requests = [greedy(f"p{i}", p, 24) for i, p in enumerate(prompts())]
    plain = make_engine(tiny_llama, **PAGED)
    want = [r.token_ids for r in (run_staggered(plain, requests) if staggered else plain.run(requests))]
    engine, graphs, replayed = static_engine(make_engine, tiny_llama)
    got = run_staggered(engine, requests) if staggered else engine.run(requests)
    assert [r.token_ids for r in got] == want, f"prompts of {PROMPT_LENGTHS} tokens diverged"
    assert replayed and set(replayed) <= {1, 2, 3, 4, 5, 6}, replayed
    if not staggered:  # all queued before the first step: batches of 3, 5 or 6 pad to a captured size
        assert {3, 5, 6} & set(replayed), replayed  # (staggered, a stalled machine saw only 1 and 2)
    assert graphs.eager_steps == 0
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.eager_steps_under_graphs == 0


def test_n_completions_fork_then_replay(make_engine, tiny_llama):
    """n = 3: the forks' copy-on-write block copies run before a replayed step, and the 3 greedy
    completions equal each other and the eager engine's."""
    plain = make_engine(tiny_llama, **PAGED)
    request = greedy("n3", prompts()[6], 20, n=3)
    [want] = plain.run([request])
    engine, graphs, replayed = static_engine(make_engine, tiny_llama)
    [got] = engine.run([request])
    assert got.token_ids == want.token_ids
    assert replayed and graphs.eager_steps == 0


def test_a_decode_only_step_too_big_to_replay_runs_eagerly_and_is_counted(make_engine, tiny_llama):
    engine, graphs, _ = static_engine(make_engine, tiny_llama)
    graphs.max_batch = 2  # as if only batches of 2 were captured: a batch of 3 decodes cannot replay
    requests = [greedy(f"q{i}", p, 6) for i, p in enumerate(prompts()[:3])]
    want = [r.token_ids for r in make_engine(tiny_llama, **PAGED).run(requests)]
    assert [r.token_ids for r in engine.run(requests)] == want
    assert graphs.eager_steps > 0
    assert engine.stats().eager_steps_under_graphs == graphs.eager_steps


def test_the_startup_parity_check_measures_replay_against_eager(make_engine, tiny_llama):
    engine, graphs, _ = static_engine(make_engine, tiny_llama)
    assert graphs.parity_error() == 0.0  # the same forward on the same inputs, uncaptured: bit for bit


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_capture_that_fails_after_loading_goes_through_cuda_graphs_door(make_engine, tiny_llama, mode):
    """The one check after loading: on this CPU the capture itself raises (no CUDA stream), so auto builds
    the worker without graphs, naming the error, and on fails startup (exit 78) naming it."""
    import structlog

    from kvpact.shared.errors import FeatureRequiredError
    from kvpact.shared.features import FeatureIntents, FeatureMode
    from kvpact.worker.startup import engine_setup
    from tests.worker.conftest import worker_spec

    engine = make_engine(tiny_llama, **PAGED)
    runner = engine.step_loop.runner
    spec = worker_spec(
        tiny_llama, "on", context_tokens=4096, features=FeatureIntents(cuda_graphs=FeatureMode.AUTO)
    )
    plan = engine_setup.plan_startup(spec)
    plan.features = tuple(
        f if f.name != "cuda-graphs" else FeatureState("cuda-graphs", FeatureMode(mode), True)
        for f in plan.features
    )  # as planned on a GPU
    log = structlog.get_logger("test")
    if mode == "on":
        with pytest.raises(FeatureRequiredError, match=r"--cuda-graphs on.*capturing the decode step"):
            engine_setup._capture_graphs(plan, runner.model, runner.cache, log)
        return
    features, graphs = engine_setup._capture_graphs(plan, runner.model, runner.cache, log)
    (s,) = [f for f in features if f.name == "cuda-graphs"]
    assert graphs is None
    assert (s.realized, s.code, s.component) == (False, "graph-capture-failed", "build")
    assert s.message.startswith("capturing the decode step in CUDA graphs failed on cpu: ")
