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


# --- Pseudocode 3: packing jobs' aggregation tasks onto few aggregators (thesis §4.3.3.2) ---
#
# An aggregator runs in cycles: its cycle is the largest standalone iteration duration D of
# the jobs it serves, and a job with a shorter D runs floor(C / D) times per cycle, so its
# effective iteration duration becomes d = C / floor(C / D). A task may join an aggregator
# only if no job there (nor the task's own job) would lose LossLimit or more of its speed,
# (d - D) / d < LossLimit, and only where the cycle's free CPU time still holds it; among those
# the best fit (least free time) wins, else a new aggregator is needed.

LOSS_LIMIT = 0.1
_EPS = 1e-9


def runs_per_cycle(duration: float, cycle: float) -> int:
    """How many iterations of a job with standalone iteration ``duration`` fit in ``cycle``."""
    if duration <= 0 or cycle <= 0:
        raise ValueError(f"iteration duration and cycle must be positive, got {duration} and {cycle}")
    return max(1, int(cycle / duration + _EPS))


def effective_iteration(duration: float, cycle: float) -> float:
    """A job's iteration duration on an aggregator whose cycle is ``cycle`` (``d_j``)."""
    return cycle / runs_per_cycle(duration, cycle)


def loss(duration: float, cycle: float) -> float:
    """Fraction of its standalone speed a job loses on that cycle: ``(d - D) / d``."""
    d = effective_iteration(duration, cycle)
    return (d - duration) / d


def free_time(cycle: float, jobs: Mapping[str, tuple[float, float]]) -> float:
    """``F_n``: CPU time left in one cycle; ``jobs`` maps job -> (D_j, sum of its tasks' e)."""
    return cycle - sum(runs_per_cycle(d, cycle) * e for d, e in jobs.values())


def pack_task(job: str, duration: float, cost: float,
              aggregators: Mapping[str, Mapping[str, tuple[float, float]]],
              loss_limit: float = LOSS_LIMIT) -> str | None:
    """Where a task of ``job`` (standalone iteration ``duration``, CPU time ``cost`` per
    iteration) goes: the name of the best-fit aggregator, or None for a new one.

    ``aggregators`` maps name -> {job: (D_j, sum of e of that job's tasks there)}.
    """
    best: tuple[float, str] | None = None
    for name, jobs in aggregators.items():
        members = dict(jobs)
        d_old, e_old = members.get(job, (duration, 0.0))
        members[job] = (d_old, e_old)
        cycle = max(d for d, _ in members.values())
        if any(loss(d, cycle) >= loss_limit - _EPS for d, _ in members.values()):
            continue
        free = free_time(cycle, members)
        if free + _EPS >= runs_per_cycle(duration, cycle) * cost and (best is None or (free, name) < best):
            best = (free, name)
    return best[1] if best else None
