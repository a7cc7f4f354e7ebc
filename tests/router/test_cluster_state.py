"""The startup state machine, without sockets."""

from kvpact.router.admission import Decision
from kvpact.router.cluster_state import ClusterState, Startup

ADMIT = Decision(admitted=True, reason="ok")
REFUSE_POLICY = Decision(admitted=False, reason="realized EAGER", policy_failure=True)
REFUSE_CRASH = Decision(admitted=False, reason="model missing", policy_failure=False)


def test_serving_when_n_distinct_workers_are_admitted():
    s = Startup(num_expected=2)
    assert s.on_decision("a", ADMIT) is ClusterState.STARTING
    assert s.describe() == "cluster is starting (1 of 2 workers admitted)"
    assert s.on_decision("a", ADMIT) is ClusterState.STARTING  # the same worker again does not count twice
    assert s.on_decision("b", ADMIT) is ClusterState.SERVING
    assert s.exit_code == 0


def test_a_policy_refusal_while_starting_fails_the_cluster_with_78():
    s = Startup(num_expected=2)
    s.on_decision("a", ADMIT)
    assert s.on_decision("b", REFUSE_POLICY) is ClusterState.FAILED
    assert s.exit_code == 78
    assert s.cause == 'worker "b" was refused while the cluster was starting: realized EAGER'


def test_a_non_policy_failure_while_starting_fails_with_1():
    s = Startup(num_expected=1)
    assert s.on_decision("a", REFUSE_CRASH) is ClusterState.FAILED
    assert s.exit_code == 1


def test_after_serving_a_refusal_is_refused_alone():
    s = Startup(num_expected=1)
    s.on_decision("a", ADMIT)
    assert s.on_decision("late", REFUSE_POLICY) is ClusterState.SERVING
    assert s.exit_code == 0


def test_failed_is_final():
    s = Startup(num_expected=1)
    s.on_decision("a", REFUSE_POLICY)
    assert s.on_decision("b", ADMIT) is ClusterState.FAILED
    assert s.on_timeout(5, ["a", "b"]) is ClusterState.FAILED
    assert s.exit_code == 78


def test_timeout_names_how_many_are_missing_and_who_registered():
    s = Startup(num_expected=3)
    s.on_decision("a", ADMIT)
    assert s.on_timeout(2.5, ["a"]) is ClusterState.FAILED
    assert s.exit_code == 1
    assert (
        'startup timed out after 2.5 s with 1 of 3 workers admitted: 2 missing (registered: "a")' in s.cause
    )


def test_timeout_after_serving_changes_nothing():
    s = Startup(num_expected=1)
    s.on_decision("a", ADMIT)
    assert s.on_timeout(1, ["a"]) is ClusterState.SERVING


def test_timeout_names_the_workers_still_loading_apart_from_the_missing():
    s = Startup(num_expected=3)
    s.on_decision("a", ADMIT)
    assert s.on_timeout(2.5, ["a", "b"], loading_ids=["b"]) is ClusterState.FAILED
    assert 'with 1 of 3 workers admitted: 1 still loading ("b"), 1 missing (registered: "a", "b")' in s.cause
