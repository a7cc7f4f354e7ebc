"""benchmarks/decode_steps.py times the decode steps of each batch size it is given."""

from __future__ import annotations

from benchmarks import decode_steps
from tests.factories.tiny_models import make_tiny_llama


def test_a_row_per_batch_size_with_its_decode_steps_timed(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    assert decode_steps.main(["--model", str(model), "--sizes", "1,3", "--tokens", "12"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["1", "3"]
    # 12 new tokens: the first comes with the prefill, at most 11 from steps with every sequence decoding
    # (fewer where the requests reached the step thread a step or two apart, on a loaded machine)
    assert all(1 <= int(r[1]) <= 11 and float(r[2]) > 0 for r in rows[1:])
    assert all(r[4].strip() == "-" or float(r[4]) >= 0 for r in rows[1:])  # between two such steps


def test_the_eager_cache_and_the_worker_flags_are_taken(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    args = [
        "--model",
        str(model),
        "--sizes",
        "2",
        "--tokens",
        "6",
        "--cache",
        "eager",
        "--cpu-kernels",
        "off",
    ]
    assert decode_steps.main(args) == 0
    out = capsys.readouterr().out
    assert "eager cache of float32, C kernels off" in out, out
