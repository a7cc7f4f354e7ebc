"""Which worker serves a request: one policy per file behind one interface (policy.BalancePolicy),
chosen with `router --balance`:

    least-load        least outstanding requests, then more free KV blocks, then id (least_load.py)
    prefix-affinity   the worker whose prefix cache most likely holds the prompt's leading blocks,
                      bounded by load, else least-load (prefix_affinity.py)
"""

from __future__ import annotations

from collections.abc import Callable

from kvpact.router.balancing.least_load import LeastLoad
from kvpact.router.balancing.policy import BalancePolicy
from kvpact.router.balancing.prefix_affinity import PrefixAffinity, routing_key

POLICIES: dict[str, Callable[[], BalancePolicy]] = {
    LeastLoad.name: LeastLoad,
    PrefixAffinity.name: PrefixAffinity,
}
DEFAULT_POLICY = LeastLoad.name


def make_policy(name: str) -> BalancePolicy:
    return POLICIES[name]()


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "BalancePolicy",
    "LeastLoad",
    "PrefixAffinity",
    "make_policy",
    "routing_key",
]
