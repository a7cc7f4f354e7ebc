"""Which ports a worker may listen on, from its group's `port_range: [LOW, HIGH]`.

NOTE: pure. The workers of one group on one node split the range between them: the k-th of n takes
LOW+k, LOW+k+n, LOW+k+2n, ... (the first of those free on its node, asked by its actor), so two workers
of the group on a node never reach for the same port, whatever else holds some of them. The cluster file
guarantees the range has a port for every replica and that no two groups' ranges overlap.
"""

from __future__ import annotations

from collections.abc import Sequence


def port_candidates(port_range: tuple[int, int], index_on_node: int, num_on_node: int) -> list[int]:
    low, high = port_range
    return list(range(low + index_on_node, high + 1, max(1, num_on_node)))


def node_shares(node_ids: Sequence[str]) -> list[tuple[int, int]]:
    """For workers on `node_ids` (in bundle order): each one's (index on its node, workers on its node)."""
    seen: dict[str, int] = {}
    indices = []
    for node in node_ids:
        indices.append(seen.get(node, 0))
        seen[node] = indices[-1] + 1
    return [(index, seen[node]) for index, node in zip(indices, node_ids, strict=True)]
