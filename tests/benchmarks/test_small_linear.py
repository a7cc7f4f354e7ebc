"""benchmarks/small_linear.py measures the matmuls on a model's shapes (C, C on packed weights where the
build packs, torch), and leaves the limit as it was."""

from __future__ import annotations

import torch

from benchmarks import small_linear
from kvpact.kernels import cpu_paged
from tests.factories.tiny_models import make_tiny_llama


def test_the_table_has_a_row_per_batch_size_and_the_limit_is_restored(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    limit = cpu_paged.SMALL_BATCH_ROWS
    past = limit + 1  # measured in C too: the script lifts the limit while it runs
    assert small_linear.main(["--model", str(model), "--rows", f"1,{past}", "--rounds", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["1", str(past)]
    for _, c, packed, t, _, _ in rows[1:]:
        assert float(c) > 0 and float(t) > 0
        packs = cpu_paged.load(torch.float32, torch.device("cpu")).panel_width  # type: ignore[union-attr]
        assert (float(packed) > 0) if packs else not packed.strip()
    assert cpu_paged.SMALL_BATCH_ROWS == limit


def test_bfloat16_weights_are_measured_packed_in_pairs_against_torch(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    assert (
        small_linear.main(["--model", str(model), "--rows", "1,3", "--rounds", "1", "--dtype", "bfloat16"])
        == 0
    )
    out = capsys.readouterr().out
    assert "bfloat16 weight matrices" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    packs = cpu_paged.load(torch.float32, torch.device("cpu")).panel_width  # type: ignore[union-attr]
    for _, c, packed, t, _, _ in rows[1:]:
        assert not c.strip() and float(t) > 0  # the [out, in] C kernel takes float32 only
        assert (float(packed) > 0) if packs else not packed.strip()
