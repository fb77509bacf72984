"""Assignment of aggregation keys to aggregators (pure functions over plain data).

``spread_by_bytes`` is the standalone baseline: a job's keys spread over its own
aggregators balanced by bytes, largest key first onto the least-loaded aggregator.
"""
from __future__ import annotations

import heapq
from typing import Mapping, Sequence


def spread_by_bytes(
    keys: Sequence[tuple[str, int]],
    aggregators: Sequence[str],
    load: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Map each ``(key, nbytes)`` to one of ``aggregators``.

    Greedy LPT: keys in decreasing size (ties by key name) each go to the aggregator
    with the least bytes so far (ties by the order of ``aggregators``). ``load`` gives
    bytes already on each aggregator (keys declared earlier).
    """
    if not aggregators:
        raise ValueError("no aggregators to spread keys over")
    load = load or {}
    heap = [(int(load.get(agg, 0)), i, agg) for i, agg in enumerate(aggregators)]
    heapq.heapify(heap)
    table: dict[str, str] = {}
    for key, nbytes in sorted(keys, key=lambda kv: (-kv[1], kv[0])):
        used, i, agg = heapq.heappop(heap)
        table[key] = agg
        heapq.heappush(heap, (used + int(nbytes), i, agg))
    return table


def bytes_per_aggregator(table: Mapping[str, str], sizes: Mapping[str, int]) -> dict[str, int]:
    """Total bytes each aggregator carries under ``table``."""
    out: dict[str, int] = {}
    for key, agg in table.items():
        out[agg] = out.get(agg, 0) + int(sizes[key])
    return out
