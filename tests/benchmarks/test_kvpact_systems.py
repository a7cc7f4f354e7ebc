"""benchmarks/kvpact_systems.py's in-process helpers."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from benchmarks.kvpact_systems import open_engine, run_engine, share_weights
from benchmarks.workloads import WorkItem
from tests.factories.tiny_models import make_tiny_llama

# decode-only steps of up to 2 sequences: the C decode layers (which hold weight addresses) run them
ITEMS = [WorkItem(tuple(range(3, 19)), 12), WorkItem(tuple(range(40, 50)), 12)]


def test_an_engine_given_anothers_weights_generates_that_engines_tokens(tmp_path):
    """Two tiny models of different seeds: once the eager engine shares the paged engine's weights, it
    produces the paged engine's greedy tokens, not its own, on the C decode layers too."""
    with ExitStack() as stack:
        paged = stack.enter_context(open_engine(make_tiny_llama(tmp_path / "a", seed=1), "paged", 64, 4))
        eager = stack.enter_context(open_engine(make_tiny_llama(tmp_path / "b", seed=2), "eager", 64, 4))
        assert eager.step_loop.runner.fused is not None
        theirs = run_engine(paged, ITEMS).outputs
        own = run_engine(eager, ITEMS).outputs
        assert own != theirs  # different weights: the check below can tell them apart

        share_weights(eager, paged)

        assert run_engine(eager, ITEMS).outputs == theirs
        pointers = [p.data_ptr() for p in eager.step_loop.runner.model.parameters()]
        assert pointers == [p.data_ptr() for p in paged.step_loop.runner.model.parameters()]


def test_weights_of_another_shape_are_refused(tmp_path):
    with ExitStack() as stack:
        small = stack.enter_context(open_engine(make_tiny_llama(tmp_path / "a"), "paged", 64, 4))
        wide = make_tiny_llama(tmp_path / "b", intermediate_size=96)
        other = stack.enter_context(open_engine(wide, "eager", 64, 4))
        with pytest.raises(ValueError, match="share_weights: .*mlp"):
            share_weights(other, small)


def test_sharing_weights_keeps_the_q4_1_panels(tmp_path):
    """A Q4_1 GGUF's engines run their small steps on Q4_1 panels (quant-kernels); the eager engine's C
    decode layers, gathered again on the paged engine's weights, keep theirs (packed from those)."""
    from kvpact.kernels import cpu_paged
    from tests.factories.tiny_models import make_tiny_gguf

    if not cpu_paged.load(torch.float32, torch.device("cpu")).quant_max_rows:  # type: ignore[union-attr]
        pytest.skip("this build packs no weights (no AVX-512 or AVX2)")
    model = make_tiny_gguf(tmp_path / "model.gguf", file_type="q4_1")
    with ExitStack() as stack:
        paged = stack.enter_context(open_engine(model, "paged", 64, 4))
        eager = stack.enter_context(open_engine(model, "eager", 64, 4))
        assert eager.step_loop.runner.fused.q4_copies  # type: ignore[union-attr]
        share_weights(eager, paged)
        fused = eager.step_loop.runner.fused
        assert fused is not None and fused.q4.startswith("yes: "), fused and fused.q4
        assert run_engine(eager, ITEMS).outputs == run_engine(paged, ITEMS).outputs
