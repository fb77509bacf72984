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
from typing import Iterable, Iterator

from sortedcontainers import SortedList

from .base import INF, JobState, Policy

DEFAULT_THRESHOLDS = (3200.0,)


class DiscretizedLAS(Policy):
    name = "las"

    def __init__(self, thresholds: Iterable[float] = DEFAULT_THRESHOLDS, promote_knob: float | None = None) -> None:
        super().__init__()
        self.thresholds = [float(t) for t in thresholds]
        if any(b <= a for a, b in zip(self.thresholds, self.thresholds[1:])) or any(t <= 0 for t in self.thresholds):
            raise ValueError(f"queue thresholds must be positive and increasing, got {self.thresholds}")
        if promote_knob is not None and promote_knob <= 0:
            raise ValueError("PROMOTEKNOB must be positive (leave it unset to disable promotion)")
        self.knob = promote_knob
        self.queues = [SortedList() for _ in range(len(self.thresholds) + 1)]
        self.where: dict[int, tuple[int, tuple]] = {}
        # running jobs' next threshold crossings: (time, token, job id); a token changes when
        # the job stops, so entries of stopped jobs are skipped
        self.crossings: list[tuple[float, int, int]] = []
        self.tokens: dict[int, int] = {}

    @property
    def num_queues(self) -> int:
        return len(self.queues)

    def queue_of(self, job: JobState) -> int:
        return bisect.bisect_right(self.thresholds, job.service * (1 + 1e-12))

    def _key(self, job: JobState, queue: int) -> tuple:
        if job.first_start is None:
            return (1, job.submit_time, job.job_id)
        return (0, job.first_start, job.job_id)

    def _place(self, job: JobState) -> None:
        old = self.where.get(job.job_id)
        q = self.queue_of(job)
        key = self._key(job, q)
        if old is not None and old == (q, key):
            return
        if old is not None:
            self.queues[old[0]].remove(old[1])
        self.queues[q].add(key)
        self.where[job.job_id] = (q, key)

    def add(self, job: JobState, now: float) -> None:
        super().add(job, now)
        self._place(job)

    def remove(self, job: JobState, now: float) -> None:
        super().remove(job, now)
        old = self.where.pop(job.job_id, None)
        if old is not None:
            self.queues[old[0]].remove(old[1])

    def started(self, job: JobState, now: float) -> None:
        self._place(job)
        self._schedule_crossing(job, now)

    def stopped(self, job: JobState, now: float) -> None:
        self.tokens[job.job_id] = self.tokens.get(job.job_id, 0) + 1

    def _schedule_crossing(self, job: JobState, now: float) -> None:
        q = self.queue_of(job)
        if q < len(self.thresholds):
            token = self.tokens.setdefault(job.job_id, 0)
            due = now + (self.thresholds[q] - job.service) / job.num_gpus
            heapq.heappush(self.crossings, (due, token, job.job_id))

    def _valid_top(self) -> tuple[float, int, int] | None:
        while self.crossings:
            due, token, job_id = self.crossings[0]
            job = self.active.get(job_id)
            if job is not None and job.running and self.tokens.get(job_id) == token:
                return self.crossings[0]
            heapq.heappop(self.crossings)
        return None

    def refresh(self, jobs: Iterable[JobState], now: float) -> None:
        """Only running jobs whose threshold crossing is due change queue (order within a
        queue does not depend on service for 2D-LAS)."""
        while True:
            top = self._valid_top()
            if top is None or top[0] > now + 1e-9 * max(1.0, now):
                break
            heapq.heappop(self.crossings)
            job = self.active[top[2]]
            self._place(job)
            self._schedule_crossing(job, now)
        if self.knob is not None:
            self._promote(now)

    def _promote(self, now: float) -> None:
        for q in range(1, self.num_queues):
            for key in list(self.queues[q]):
                job = self.active[key[-1]]
                if job.running or job.service <= 0:
                    continue
                if job.waiting_time(now) >= self.knob * (job.service / job.num_gpus):
                    job.service = 0.0
                    job.waited = 0.0
                    job.wait_since = now
                    self._place(job)

    def ordered(self, now: float) -> Iterator[JobState]:
        active = self.active
        for queue in self.queues:
            for key in queue:
                yield active[key[-1]]

    def next_change(self, running: Iterable[JobState], now: float) -> float:
        top = self._valid_top()
        soonest = top[0] if top is not None else INF
        if self.knob is not None:
            for q in range(1, self.num_queues):
                for key in self.queues[q]:
                    job = self.active[key[-1]]
                    if not job.running and job.service > 0:
                        due = self.knob * job.service / job.num_gpus - job.waiting_time(now)
                        soonest = min(soonest, now + max(due, 0.0))
        return soonest


class DiscretizedGittins(DiscretizedLAS):
    """2D-Gittins: queues ``1..K-1`` by Gittins index (quantum = upper threshold), last FIFO."""

    name = "gittins"

    def __init__(self, distribution, thresholds: Iterable[float] = DEFAULT_THRESHOLDS,
                 promote_knob: float | None = None) -> None:
        super().__init__(thresholds, promote_knob)
        self.dist = distribution

    def _key(self, job: JobState, queue: int) -> tuple:
        if queue >= len(self.thresholds):
            return super()._key(job, queue)
        return (-self.dist.index(job.service, self.thresholds[queue]), job.job_id)

    def refresh(self, jobs: Iterable[JobState], now: float) -> None:
        # a running job's index changes with its service: re-place every running job
        for job in jobs:
            self._place(job)
        super().refresh(jobs, now)


class ContinuousLAS(Policy):
    """Priority = -attained service, recomputed every ``interval`` seconds; ties by job id."""

    name = "las-continuous"

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__()
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.interval = interval

    def key(self, job: JobState, now: float):
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
