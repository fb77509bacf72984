"""Completion-rate allocation: how many GPUs (each with an aggregator) and aggregators each job
gets so that the cluster finishes jobs at the highest rate, with a resize charged its restart.

A job with ``Q`` steps left running at ``f(p, w)`` steps/s finishes in ``Q / f``; its
*completion rate* is ``f / Q`` (jobs per second, in the fluid sense). The allocation greedily
maximises the sum of the jobs' completion rates. A unit given to a job is worth
``Δf / Q``: the same speed-up counts for more on a job that is nearly done, which is
shortest-remaining-time first when GPUs are handed out, then marginal gains (eq. (9) of
Optimus weighs the time saved, ``Q·Δ(1/f)``, which favours long jobs instead).

A running job whose GPU count changes is restarted, losing ``restart_fraction`` of the
horizon the decision is meant to last; its completion rate at any count but its current one
is scaled by ``1 - restart_fraction``, so a resize happens only when it pays for its restart.
That makes the rate of a running job peak at its current count (not concave), so the greedy
grants *blocks*: for each job, the number of GPUs ``k`` that maximises the gain per GPU of
its next step (the slope of the upper concave hull), which reaches the current count in one
block. Workers come with one aggregator each (up to ``max_aggregators``); the CPUs left over
then go one aggregator at a time to the largest gain (an aggregator change is live: no
restart). Pure code over plain data.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class RateJob:
    """A job as the completion-rate allocator sees it."""
    job_id: int
    remaining: float                           # Q: steps left (estimated)
    speed: Callable[[int, int], float]         # f(p, w): steps/s at p aggregators, w workers
    min_workers: int = 1
    max_workers: int = 1 << 30
    max_aggregators: int = 1 << 30
    current_workers: int = 0                   # GPUs it runs on now (0: not running)
    restart_fraction: float = 0.0              # share of the horizon a GPU-count change costs


def completion_rate(job: RateJob, workers: int, aggregators: int) -> float:
    """``f(p, w) / Q`` with a resize's restart charged; 0 with no worker or aggregator."""
    if workers <= 0 or aggregators <= 0:
        return 0.0
    rate = max(0.0, job.speed(aggregators, workers)) / max(job.remaining, 1.0)
    if job.current_workers > 0 and workers != job.current_workers:
        rate *= 1.0 - min(1.0, max(0.0, job.restart_fraction))
    return rate


class _Curve:
    """One job's completion rate by worker count (aggregators bundled), computed lazily."""
    __slots__ = ("job", "rates")

    def __init__(self, job: RateJob) -> None:
        self.job = job
        self.rates = [0.0]                     # rates[w]

    def aggregators(self, workers: int) -> int:
        return min(workers, self.job.max_aggregators)

    def rate(self, workers: int) -> float:
        while len(self.rates) <= workers:
            w = len(self.rates)
            self.rates.append(completion_rate(self.job, w, self.aggregators(w)))
        return self.rates[workers]

    def best_block(self, workers: int, free_gpus: float, free_cpus: float) -> tuple[float, int]:
        """(gain per GPU, GPUs) of the best next block from ``workers`` that fits; (0, 0) if none
        fits or none gains."""
        job = self.job
        first = max(1, min(job.min_workers, job.max_workers)) if workers == 0 else workers + 1
        top = min(job.max_workers, workers + int(free_gpus + 1e-9))
        base, held_p = self.rate(workers), self.aggregators(workers)
        best, size = 0.0, 0
        for w in range(first, top + 1):
            if self.aggregators(w) - held_p > free_cpus + 1e-9:
                break
            gain = (self.rate(w) - base) / (w - workers)
            if gain > best * (1 + 1e-12):
                best, size = gain, w - workers
        return best, size


def allocate_completion_rate(jobs: Sequence[RateJob], gpus: float, cpus: float) -> dict[int, tuple[int, int]]:
    """job id -> (workers, aggregators) maximising the sum of completion rates (module doc)."""
    free_g, free_c = float(gpus), float(cpus)
    curves = {job.job_id: _Curve(job) for job in jobs}
    size = {job.job_id: 0 for job in jobs}
    heap: list[tuple[float, int, int]] = []

    def push(job_id: int) -> None:
        gain, block = curves[job_id].best_block(size[job_id], free_g, free_c)
        if block > 0 and gain > 0:
            heapq.heappush(heap, (-gain, job_id, block))

    for job in jobs:
        push(job.job_id)
    while heap:
        _, job_id, block = heapq.heappop(heap)
        curve, w = curves[job_id], size[job_id]
        need_c = curve.aggregators(w + block) - curve.aggregators(w)
        if block > free_g + 1e-9 or need_c > free_c + 1e-9:
            push(job_id)                       # stale: capacity shrank since the push
            continue
        free_g -= block
        free_c -= need_c
        size[job_id] = w + block
        push(job_id)
    out = {job_id: (w, curves[job_id].aggregators(w)) for job_id, w in size.items()}
    return _spread_aggregators(jobs, out, free_c)


def _spread_aggregators(jobs: Sequence[RateJob], out: dict[int, tuple[int, int]],
                        free_cpus: float) -> dict[int, tuple[int, int]]:
    """The CPUs left: one aggregator at a time to the running job it speeds up the most."""
    by_id = {job.job_id: job for job in jobs}
    heap: list[tuple[float, int]] = []

    def push(job_id: int) -> None:
        job, (w, p) = by_id[job_id], out[job_id]
        if w > 0 and p < job.max_aggregators:
            gain = completion_rate(job, w, p + 1) - completion_rate(job, w, p)
            if gain > 0 and math.isfinite(gain):
                heapq.heappush(heap, (-gain, job_id))

    for job_id in out:
        push(job_id)
    while heap and free_cpus >= 1 - 1e-9:
        _, job_id = heapq.heappop(heap)
        w, p = out[job_id]
        out[job_id] = (w, p + 1)
        free_cpus -= 1
        push(job_id)
    return out
