"""`python -m benchmarks.run --quick --suites offline` on the tiny model: every system runs every workload,
the report names every target, and kvpact's greedy tokens are transformers' (so the suite compares the
same work)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.peers import Run
from benchmarks.suites.offline import Drained, padded_ceiling, shared_ratio, shifted_prompts, speedup
from benchmarks.workloads import WorkItem
from tests.benchmarks.quick_suite import run_quick_suite

TIMEOUT_S = 240


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_offline_suite_on_the_tiny_model(tmp_path: Path) -> None:
    report = run_quick_suite("offline", tmp_path, timeout_s=TIMEOUT_S)

    throughput = {t["title"]: t for t in report["tables"] if t["title"].startswith("Offline throughput")}
    assert sorted(throughput) == [
        f"Offline throughput, {w} workload" for w in ("long_prompt", "mixed", "shared_prefix")
    ]
    mixed = throughput["Offline throughput, mixed workload"]
    assert [row[0] for row in mixed["rows"]] == [
        "kvpact paged, router + worker",
        "kvpact paged, router + worker, server default budget",
        "kvpact eager, router + worker",
        "kvpact paged, in-process",
        "kvpact eager, in-process",
        "transformers generate, one padded batch",
        "transformers generate, batches of 8",
        "transformers continuous batching",
    ]
    for table in throughput.values():
        assert table["command"] == "python -m benchmarks.run --suites offline --quick"
        for row in table["rows"]:
            assert all(value > 0 for value in row[1:4]), row  # wall s, output tok/s, processed tok/s

    bounds = report["data"]["compute_bound"]
    assert len(bounds) == 2 and all(b["tokens_per_s"] > 0 for b in bounds)

    names = [t["name"] for t in report["targets"]]
    assert names == [
        "served >= in-process on every offline workload (paged, router + worker / in-process, tok/s)",
        "vs transformers' one padded batch, of its ceiling (router + worker, paged)",
        "vs transformers continuous batching (router + worker, paged)",
        "offline mixed, router + worker, paged: processed tokens / compute bound",
        "paged >= eager on every offline workload (router + worker)",
        "served >= in-process at --max-num-seqs 1 (paged, router + worker / in-process, tok/s)",
        "two hand-started workers on this machine vs one alone (output tok/s, no thread flags)",
        "a worker sent SIGTERM in that setup finishes its in-flight requests within --drain-timeout",
    ]
    assert all(t["met"] in (True, False) and t["measured"] for t in report["targets"])
    shared = {t["title"]: t for t in report["tables"]}[
        "Workers sharing this machine (router + N hand-started paged workers, no thread flags)"
    ]
    assert [row[0] for row in shared["rows"]] == [1, 2]
    assert all(row[2] > 0 for row in shared["rows"])  # both runs delivered every token
    (one_seq,) = report["data"]["one_sequence_rounds"]  # --quick: one round
    assert one_seq["served_s"] > 0 and one_seq["in_process_s"] > 0, one_seq
    assert one_seq["client_cpu_s"] > 0 and one_seq["in_process_threads_cpu_s"][0] > 0, one_seq
    assert sorted(one_seq["served_threads_cpu_s"]) == ["paged", "router"], one_seq
    drained = report["data"]["shared_machine_drain"]  # the tiny model's 16 tokens: signalled in flight
    assert drained["exit_code"] == 0 and drained["failed"] == 0, drained
    assert 0 < drained["on_worker"] == drained["completed"] < drained["requests"], drained

    # The tiny model's logits are far from ties: every system generates transformers' tokens exactly.
    agreement = report["data"]["agreement"]
    assert agreement and all(a["identical"] == a["of"] for a in agreement), agreement


def test_the_padded_ceiling_counts_every_row_at_the_longest_prompt_and_output():
    # one padded batch computes 2 rows x (4 + 6) tokens; 2 + 3 and 4 + 6 are useful
    assert padded_ceiling([WorkItem((1, 2), 3), WorkItem((1, 2, 3, 4), 6)]) == 20 / 15


def test_a_ratio_is_the_median_of_its_rounds_paired_and_transformers_single_run_uses_the_median():
    def rounds(*walls: float) -> list[Run]:
        return [Run(w, []) for w in walls]

    runs = {
        ("mixed", "a"): rounds(10.0, 20.0, 30.0),
        ("mixed", "b"): rounds(11.0, 18.0, 33.0),  # per round 1.1, 0.9, 1.1 as slow as a
        ("mixed", "hf"): rounds(40.0),
    }
    # paired round by round: the median of 1.1, 0.9, 1.1 (the ratio of medians would say 0.9)
    assert speedup(runs, "mixed", "a", "b") == pytest.approx(1.1)
    assert speedup(runs, "mixed", "a", "hf") == pytest.approx(40.0 / 20.0)  # one run: a's median wall


def test_two_workers_against_one_is_the_median_of_the_rounds_paired():
    one = [Run(w, []) for w in (4.0, 2.0, 3.0)]
    two = [Run(w, []) for w in (4.0, 4.0, 2.0)]  # two / one tok/s per round: 1.0, 0.5, 1.5
    assert shared_ratio({1: one, 2: two}) == pytest.approx(1.0)  # the ratio of median walls: 0.75


def test_a_drain_is_met_only_by_a_clean_exit_in_time_with_every_one_of_its_streams_complete():
    ok = Drained(
        exit_code=0, seconds=1.5, drain_timeout_s=30.0, on_worker=3, completed=3, failed=0, requests=6
    )
    assert ok.met
    assert ok.line() == (
        "exit 0 1.5 s after SIGTERM (--drain-timeout 30 s); 3 of its 3 in-flight requests delivered every "
        "token; 0 of the 6 streams failed"
    )
    for broken in (
        {"exit_code": 1},
        {"seconds": 30.5},  # past its --drain-timeout
        {"completed": 2},  # one of its requests cut short
        {"failed": 1},  # a stream of the other worker failed
        {"on_worker": 0, "completed": 0},  # nothing was in flight on it: the drain was not tried
    ):
        assert not replace(ok, **broken).met, broken


def test_each_round_shifts_every_prompt_token_and_keeps_the_lengths():
    items = [WorkItem((1, 2, 3), 4), WorkItem((5,), 6)]
    assert shifted_prompts(items, 0, 100) == items
    later = shifted_prompts(items, 1, 100)
    assert [len(i.prompt) for i in later] == [3, 1] and [i.max_tokens for i in later] == [4, 6]
    assert all(
        a != b for x, y in zip(items, later, strict=True) for a, b in zip(x.prompt, y.prompt, strict=True)
    )
