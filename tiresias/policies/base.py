"""The interface between scheduling policies and whatever drives them (simulator, live master).

A driver owns ``JobState`` records (plain data) and tells the policy which jobs are active
(``add``/``remove``) and which running jobs gained service (``refresh``). The policy yields
active jobs in priority order (``ordered``) and says when its order may change on its own
(``next_change``: a queue threshold crossed, a quantum over). ``allocate`` is the one
scheduling pass both drivers run: walk the order, admit a job when its GPUs fit
(all-or-nothing), skip it otherwise (or stop, for head-of-line-blocking policies); running
jobs left out are to be preempted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

INF = math.inf


@dataclass(slots=True, eq=False)
class JobState:
    job_id: int
    num_gpus: int
    submit_time: float
    duration: float | None = None     # oracle duration; only SRTF/SRSF may look at it
    executed: float = 0.0             # seconds of execution so far (t_J)
    service: float = 0.0              # attained service W_J * t_J since the last promotion
    first_start: float | None = None
    running: bool = False
    wait_since: float = 0.0           # when it last stopped waiting-time accounting
    waited: float = 0.0               # waiting time accumulated since the last promotion
    last_run: float = -INF            # last time it was running (round robin)
    preemptions: int = 0
    end_time: float | None = None
    skew: float = 0.0
    model: str | None = None

    def waiting_time(self, now: float) -> float:
        return self.waited + (0.0 if self.running else max(0.0, now - self.wait_since))

    def remaining(self) -> float:
        return INF if self.duration is None else max(0.0, self.duration - self.executed)


class Policy:
    """Base class: keeps the active jobs and sorts them by ``key`` (override for speed)."""

    name = "base"
    preemptive = True       # may a running job be stopped for a higher-priority one?
    blocking = False        # stop at the first job that does not fit (head-of-line blocking)

    def __init__(self) -> None:
        self.active: dict[int, JobState] = {}
        self.sizes: dict[int, int] = {}       # GPU count -> active jobs of that size

    def add(self, job: JobState, now: float) -> None:
        self.active[job.job_id] = job
        self.sizes[job.num_gpus] = self.sizes.get(job.num_gpus, 0) + 1

    def remove(self, job: JobState, now: float) -> None:
        if self.active.pop(job.job_id, None) is not None:
            left = self.sizes[job.num_gpus] - 1
            if left:
                self.sizes[job.num_gpus] = left
            else:
                del self.sizes[job.num_gpus]

    def refresh(self, jobs: Iterable[JobState], now: float) -> None:
        """``jobs`` (running) gained service since the last call."""

    def started(self, job: JobState, now: float) -> None:
        """``job`` was started (``first_start`` is set by the driver before this call)."""

    def stopped(self, job: JobState, now: float) -> None:
        """``job`` was preempted (it stays active) or finished (``remove`` follows)."""

    def key(self, job: JobState, now: float):
        """Sort key of ``job`` (smaller runs first); a policy defines this or overrides ``ordered``."""
        raise NotImplementedError(f"{type(self).__name__} defines neither key() nor ordered()")

    def ordered(self, now: float) -> Iterator[JobState]:
        return iter(sorted(self.active.values(), key=lambda j: self.key(j, now)))

    def next_change(self, running: Iterable[JobState], now: float) -> float:
        """The earliest time the order may change without an arrival or completion."""
        return INF


def allocate(policy: Policy, capacity: int, running: Iterable[JobState], now: float,
             fits: Callable[[JobState, int], bool] | None = None) -> tuple[list[JobState], list[JobState]]:
    """One scheduling pass: ``(to_start, to_preempt)``.

    ``fits(job, free)`` decides whether a job can be placed (default: GPU count); a
    non-preemptive policy keeps every running job and fills what is left.
    """
    running = list(running)
    fits = fits or (lambda job, free: job.num_gpus <= free)
    admitted: set[int] = set()
    free = capacity
    if not policy.preemptive:
        for job in running:
            admitted.add(job.job_id)
            free -= job.num_gpus
    smallest = min(policy.sizes, default=1)
    for job in policy.ordered(now):
        if free < smallest:
            break                  # nothing active fits in what is left
        if job.job_id in admitted:
            continue
        if fits(job, free):
            admitted.add(job.job_id)
            free -= job.num_gpus
        elif policy.blocking:
            break
    to_start = [policy.active[j] for j in admitted if not policy.active[j].running] if admitted else []
    to_preempt = [job for job in running if job.job_id not in admitted]
    to_start.sort(key=lambda j: j.job_id)
    return to_start, to_preempt
