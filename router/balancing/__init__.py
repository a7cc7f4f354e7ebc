"""Which worker serves a request: `route` (route.py) narrows to the model's serving workers with room,
then the balance chosen with `router --balance` picks one; one balance per file behind one interface
(balance.Balance):

    least-load        least outstanding requests, then more free KV blocks, then id (least_load.py)
    prefix-affinity   the worker whose prefix cache most likely holds the prompt's leading blocks,
                      bounded by load, else least-load (prefix_affinity.py)
"""

from __future__ import annotations

from collections.abc import Callable

from kvpact.router.balancing.balance import Balance
from kvpact.router.balancing.least_load import LeastLoad
from kvpact.router.balancing.prefix_affinity import PrefixAffinity, routing_key
from kvpact.router.balancing.route import resolve_model, route, with_room

BALANCES: dict[str, Callable[[], Balance]] = {
    LeastLoad.name: LeastLoad,
    PrefixAffinity.name: PrefixAffinity,
}
DEFAULT_BALANCE = LeastLoad.name


def make_balance(name: str) -> Balance:
    return BALANCES[name]()


__all__ = [
    "DEFAULT_BALANCE",
    "BALANCES",
    "Balance",
    "LeastLoad",
    "PrefixAffinity",
    "make_balance",
    "resolve_model",
    "route",
    "routing_key",
    "with_room",
]
