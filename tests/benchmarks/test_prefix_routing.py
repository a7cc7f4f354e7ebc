"""benchmarks/prefix_routing.py: the workload, and (slow) one real run of both policies on a tiny model."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from benchmarks.prefix_routing import main, workload
from tests.factories.tiny_models import make_tiny_llama


def test_the_workload_shares_a_prefix_within_each_group_and_is_shuffled_by_default():
    prompts = workload(groups=3, per_group=4, prefix_words=20, order="shuffled")
    assert len(prompts) == 12
    prefixes = Counter(p.split("\n")[0] for p in prompts)
    assert sorted(prefixes.values()) == [4, 4, 4] and all(len(p.split()) == 22 for p in prefixes)
    assert len(set(prompts)) == 12  # each request has its own question
    in_order = workload(groups=3, per_group=4, prefix_words=20, order="round-robin")
    assert [p.split(":")[0] for p in in_order[:3]] == ["System 0", "System 1", "System 2"]
    assert sorted(in_order) == sorted(prompts)


@pytest.mark.slow
def test_both_policies_run_and_report_a_row(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    args = ["--model", str(model), "--groups", "2", "--per-group", "2", "--prefix-words", "20"]
    assert main([*args, "--concurrency", "2", "--max-tokens", "2"]) == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if re.match(r"^\| (least-load|prefix)", line)
    ]
    assert [row.split("|")[1].strip() for row in rows] == ["least-load", "prefix-affinity"]
