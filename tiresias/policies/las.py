"""2D-LAS and 2D-Gittins (thesis §3.3.2, Pseudocode 1 and 2).

Discretized: ``K`` queues split by attained service ``W_J * t_J`` at ``thresholds``; a job is
demoted when it crosses its queue's upper threshold; 2D-LAS orders each queue FIFO by first
start time (jobs never started come after, by submit time); 2D-Gittins orders queues
``1..K-1`` by the Gittins index with quantum = the queue's upper threshold and the last queue
FIFO. With ``promote_knob`` a job that waited ``>= knob * t_J`` goes back to Q1 (its service
and waiting time reset). Queues are sorted containers updated incrementally, so a pass
costs the jobs it walks, not a sort of every active job.

Continuous: priorities recomputed every ``interval`` seconds without queues (the worked
example of Fig. 3.7): LAS by attained service, Gittins by ``sup_Δ`` of the index; ties by id.
"""
from __future__ import annotations

import bisect
import heapq
from operator import itemgetter
from typing import Iterable

import numpy as np

from .base import INF, Change, JobState, Policy

DEFAULT_THRESHOLDS = (3200.0,)


class DiscretizedLAS(Policy):
    name = "las"
    static_running_keys = True       # a running job's key changes only at its demotions
    reads_running_progress = False   # crossings are predicted at start; service settled at stops

    def __init__(self, thresholds: Iterable[float] = DEFAULT_THRESHOLDS, promote_knob: float | None = None) -> None:
        super().__init__()
        self.thresholds = [float(t) for t in thresholds]
        if any(b <= a for a, b in zip(self.thresholds, self.thresholds[1:])) or any(t <= 0 for t in self.thresholds):
            raise ValueError(f"queue thresholds must be positive and increasing, got {self.thresholds}")
        if promote_knob is not None and promote_knob <= 0:
            raise ValueError("PROMOTEKNOB must be positive (leave it unset to disable promotion)")
        self.knob = promote_knob
        # running jobs' next threshold crossings (time, token, job id, the threshold) and
        # waiting jobs' promotion times (time, token, job id); a job's token changes when it
        # starts or stops, so entries left from an earlier state are skipped
        self.crossings: list[tuple[float, int, int, float]] = []
        self.promotions: list[tuple[float, int, int]] = []
        self.tokens: dict[int, int] = {}

    def queue_of(self, job: JobState) -> int:
        # tolerance: service adds up GPUs x dt in floating point; a job due to cross a
        # threshold at an event time must be seen across it (else it is re-filed forever)
        return bisect.bisect_right(self.thresholds, job.service * (1 + 1e-9) + 1e-9)

    def key(self, job: JobState, now: float) -> tuple:
        q = self.queue_of(job)
        if job.first_start is None:
            return (q, 1, job.submit_time, job.job_id)
        return (q, 0, job.first_start, job.job_id)

    def started(self, job: JobState, now: float) -> tuple | None:
        key = super().started(job, now)
        self.tokens[job.job_id] = self.tokens.get(job.job_id, 0) + 1
        self._schedule_crossing(job, now, None if key is None else key[0])
        return key

    def stopped(self, job: JobState, now: float) -> None:
        super().stopped(job, now)
        token = self.tokens[job.job_id] = self.tokens.get(job.job_id, 0) + 1
        if self.knob is not None and job.job_id in self.active and self.queue_of(job) > 0:
            due = job.wait_since + self.knob * job.service / job.num_gpus - job.waited
            heapq.heappush(self.promotions, (due, token, job.job_id))

    def _schedule_crossing(self, job: JobState, now: float, q: int | None = None) -> None:
        """Push the time ``job`` (running, in queue ``q``) crosses its queue's threshold."""
        if q is None:
            q = self.queue_of(job)
        if q < len(self.thresholds):
            threshold = self.thresholds[q]
            due = now + (threshold - job.service) / job.num_gpus
            heap = self.crossings
            heapq.heappush(heap, (due, self.tokens[job.job_id], job.job_id, threshold))
            if len(heap) > 2 * len(self.running) + 1024:     # mostly crossings of stopped runs
                tokens, active = self.tokens, self.active
                heap[:] = [e for e in heap if e[2] in active and tokens.get(e[2]) == e[1]]
                heapq.heapify(heap)

    def _valid_top(self, heap: list) -> tuple | None:
        active, tokens = self.active, self.tokens
        while heap:
            top = heap[0]
            if top[2] in active and tokens.get(top[2]) == top[1]:
                return top
            heapq.heappop(heap)
        return None

    def due(self, now: float) -> Change | None:
        """The next change due at ``now``: a running job's threshold crossing (``demote`` to
        the threshold it crossed: the driver sets its service to at least that threshold, so
        that a crossing due within the time tolerance snaps to it, else it would be re-filed
        at the same instant forever) or a waiting job's promotion back to Q1 (``promote``).
        The driver applies it and calls ``changed``."""
        limit = now + 1e-9 * max(1.0, now)
        top = self._valid_top(self.crossings)
        if top is not None and top[0] <= limit:
            heapq.heappop(self.crossings)
            return Change("demote", self.active[top[2]], top[3])
        top = self._valid_top(self.promotions) if self.promotions else None
        if top is not None and top[0] <= limit:
            heapq.heappop(self.promotions)
            return Change("promote", self.active[top[2]], 0.0)
        return None

    def changed(self, change: Change, now: float) -> None:
        job = change.job
        if change.kind == "demote":
            self.refile_running(job, now)
            self._schedule_crossing(job, now)
        else:
            self.tokens[job.job_id] += 1
            self.rekey(job, now)

    def next_change(self, running: Iterable[JobState], now: float) -> float:
        crossing = self._valid_top(self.crossings)
        promotion = self._valid_top(self.promotions) if self.promotions else None
        t = crossing[0] if crossing is not None else INF
        if promotion is not None and promotion[0] < t:
            t = promotion[0]
        return t if t >= now else now


class DiscretizedGittins(DiscretizedLAS):
    """2D-Gittins: queues ``1..K-1`` by Gittins index (quantum = upper threshold), last FIFO."""

    name = "gittins"
    static_running_keys = False      # a running job's index moves with its service
    reads_running_progress = True

    def __init__(self, distribution, thresholds: Iterable[float] = DEFAULT_THRESHOLDS,
                 promote_knob: float | None = None) -> None:
        super().__init__(thresholds, promote_knob)
        self.dist = distribution

    def key(self, job: JobState, now: float) -> tuple:
        q = self.queue_of(job)
        if q >= len(self.thresholds):
            return super().key(job, now)
        return (q, -self.dist.index(job.service, self.thresholds[q]), job.job_id)

    def running_order(self, now: float) -> list[tuple[tuple, JobState]]:
        # a running job's index moves with its service: key the running jobs afresh, one
        # vectorized index computation per queue
        last = len(self.thresholds)
        by_queue: dict[int, list[JobState]] = {}
        for job in self.running.values():
            by_queue.setdefault(self.queue_of(job), []).append(job)
        keyed = []
        for q, jobs in by_queue.items():
            if q >= last:
                keyed += [(DiscretizedLAS.key(self, j, now), j) for j in jobs]
                continue
            idx = self.dist.indices(np.fromiter((j.service for j in jobs), float, len(jobs)), self.thresholds[q])
            keyed += [((q, -float(g), j.job_id), j) for g, j in zip(idx, jobs)]
        keyed.sort(key=itemgetter(0))
        return keyed


class ContinuousLAS(Policy):
    """Priority = -attained service, recomputed every ``interval`` seconds; ties by job id."""

    name = "las-continuous"

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__()
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.interval = interval

    def key(self, job: JobState, now: float) -> tuple:
        return (job.service, job.job_id)

    def next_change(self, running: Iterable[JobState], now: float) -> float:
        return now + self.interval if self.active else INF


class ContinuousGittins(ContinuousLAS):
    """Priority = sup over Δ of the Gittins index of the attained service; ties by job id."""

    name = "gittins-continuous"

    def __init__(self, distribution, interval: float = 1.0) -> None:
        super().__init__(interval)
        self.dist = distribution

    def key(self, job: JobState, now: float):
        return (-self.dist.sup_index(job.service), job.job_id)
