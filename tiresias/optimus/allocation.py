"""Optimus' marginal-gain resource allocation (paper §4.1, eq. (9)): how many workers and
aggregators each job gets from the cluster's aggregate capacity (placement is ``placement``).

Each job first gets its minimum (``min_workers`` workers, one aggregator) in the given order;
then, one unit at a time, the job whose next worker or aggregator reduces its remaining time
``Q / f(p, w)`` the most per unit of that task's dominant resource share gets it. The gains of a
job change only when the job grows, so a max-heap keyed ``(-gain, job_id)`` holds one entry per
job, refreshed after each grant; an entry whose unit no longer fits (capacity only shrinks) is
recomputed when it reaches the top.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence


@dataclass
class Demand:
    """The resources one worker and one aggregator of a job use, e.g. ``{"gpu": 1, "cpu": 1}``."""
    workers: dict[str, float] = field(default_factory=dict)
    aggregators: dict[str, float] = field(default_factory=dict)


@dataclass
class AllocJob:
    """A job as the allocators see it: ``remaining`` steps (Q_j) and its speed model ``f(p, w)``."""
    job_id: int
    remaining: float
    speed: Callable[[int, int], float]
    demand: Demand
    min_workers: int = 1
    max_workers: int = 1 << 30
    max_aggregators: int = 1 << 30
    young: bool = False


def dominant_share(use: Mapping[str, float], capacity: Mapping[str, float]) -> float:
    """The largest share of the cluster's capacity ``use`` takes (inf if it needs a missing resource)."""
    share = 0.0
    for r, amount in use.items():
        if amount <= 0:
            continue
        cap = capacity.get(r, 0.0)
        if cap <= 0:
            return math.inf
        share = max(share, amount / cap)
    return share


def fits(use: Mapping[str, float], free: Mapping[str, float], times: float = 1.0) -> bool:
    """Whether ``times`` units of ``use`` fit in ``free`` (a small tolerance for float sums)."""
    return all(amount * times <= free.get(r, 0.0) + 1e-9 for r, amount in use.items() if amount > 0)


def take(use: Mapping[str, float], free: dict[str, float], times: float = 1.0) -> None:
    for r, amount in use.items():
        if amount > 0:
            free[r] = free.get(r, 0.0) - amount * times


def remaining_time(remaining: float, speed: float) -> float:
    """``Q / f``: inf at no speed, 0 with nothing left."""
    if remaining <= 0:
        return 0.0
    return math.inf if speed <= 0 else remaining / speed


def time_saved(before: float, after: float) -> float:
    """``before - after`` with the infinities settled (inf -> finite: inf; inf -> inf: 0)."""
    if math.isinf(before):
        return 0.0 if math.isinf(after) else math.inf
    return before - after


def check_demands(jobs: Sequence[AllocJob], capacity: Mapping[str, float]) -> None:
    """ValueError for a job whose worker or aggregator uses no resource ``capacity`` counts:
    such a unit would cost nothing and could be granted without bound."""
    for job in jobs:
        for what, use in (("worker", job.demand.workers), ("aggregator", job.demand.aggregators)):
            if dominant_share(use, capacity) <= 0:
                raise ValueError(f"job {job.job_id}: its {what} demand {dict(use)} uses none of the "
                                 f"resources in capacity {sorted(capacity)}; give it a positive amount of one")


def _positive(use: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple((r, float(v)) for r, v in use.items() if v > 0)


def _fits_unit(unit: tuple[tuple[str, float], ...], free: Mapping[str, float]) -> bool:
    for r, amount in unit:
        if amount > free[r] + 1e-9:
            return False
    return True


class _Growth:
    """One job's state during the greedy phase: its size, its remaining time, its best next unit."""
    __slots__ = ("job", "w", "p", "t_now", "share_w", "share_a", "unit_w", "unit_a")

    def __init__(self, job: AllocJob, w: int, p: int, capacity: Mapping[str, float]) -> None:
        self.job = job
        self.w, self.p = w, p
        self.t_now = remaining_time(job.remaining, job.speed(p, w))
        self.share_w = dominant_share(job.demand.workers, capacity)
        self.share_a = dominant_share(job.demand.aggregators, capacity)
        self.unit_w = _positive(job.demand.workers)
        self.unit_a = _positive(job.demand.aggregators)

    def best(self, free: Mapping[str, float], young_factor: float) -> tuple[float, bool]:
        """(gain per unit of dominant share, whether the unit is a worker) of the best next unit
        that fits in ``free``; gain <= 0 when none helps."""
        job = self.job
        scale = young_factor if job.young else 1.0
        gain_w = gain_a = -math.inf
        if self.w < job.max_workers and _fits_unit(self.unit_w, free):
            saved = time_saved(self.t_now, remaining_time(job.remaining, job.speed(self.p, self.w + 1)))
            gain_w = _per_share(saved, self.share_w) * scale
        if self.p < job.max_aggregators and _fits_unit(self.unit_a, free):
            saved = time_saved(self.t_now, remaining_time(job.remaining, job.speed(self.p + 1, self.w)))
            gain_a = _per_share(saved, self.share_a) * scale
        return (gain_w, True) if gain_w >= gain_a else (gain_a, False)


def _per_share(saved: float, share: float) -> float:
    """Time saved per unit of dominant share (non-positive savings stay non-positive)."""
    return saved if saved <= 0 else saved / share


def allocate_marginal_gain(jobs: Sequence[AllocJob], capacity: Mapping[str, float],
                           young_factor: float = 0.95) -> dict[int, tuple[int, int]]:
    """job id -> (workers, aggregators) by eq. (9) over the aggregate ``capacity``."""
    check_demands(jobs, capacity)
    free = {r: float(v) for r, v in capacity.items()}
    for job in jobs:                                # every resource a job names, 0 if not in capacity
        for r in (*job.demand.workers, *job.demand.aggregators):
            free.setdefault(r, 0.0)
    out: dict[int, tuple[int, int]] = {}
    growing: dict[int, _Growth] = {}
    for job in jobs:
        w0 = max(1, min(job.min_workers, job.max_workers))
        if job.max_aggregators >= 1 and fits(_sum(job.demand.workers, w0, job.demand.aggregators), free):
            take(job.demand.workers, free, w0)
            take(job.demand.aggregators, free)
            out[job.job_id] = (w0, 1)
            growing[job.job_id] = _Growth(job, w0, 1, capacity)
        else:
            out[job.job_id] = (0, 0)
    heap: list[tuple[float, int, bool]] = []
    for job_id, g in growing.items():
        gain, worker = g.best(free, young_factor)
        if gain > 0:
            heap.append((-gain, job_id, worker))
    heapq.heapify(heap)
    while heap:
        _, job_id, worker = heapq.heappop(heap)
        g = growing[job_id]
        unit = g.unit_w if worker else g.unit_a
        if not _fits_unit(unit, free):              # stale: capacity shrank since the push
            gain, worker = g.best(free, young_factor)
            if gain > 0:
                heapq.heappush(heap, (-gain, job_id, worker))
            continue
        for r, amount in unit:
            free[r] -= amount
        if worker:
            g.w += 1
        else:
            g.p += 1
        g.t_now = remaining_time(g.job.remaining, g.job.speed(g.p, g.w))
        out[job_id] = (g.w, g.p)
        gain, worker = g.best(free, young_factor)
        if gain > 0:
            heapq.heappush(heap, (-gain, job_id, worker))
    return out


def _sum(a: Mapping[str, float], times: float, b: Mapping[str, float]) -> dict[str, float]:
    """``times * a + b`` as one demand."""
    out = {r: v * times for r, v in a.items()}
    for r, v in b.items():
        out[r] = out.get(r, 0.0) + v
    return out
