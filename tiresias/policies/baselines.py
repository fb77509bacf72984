"""The baselines Tiresias is compared with (thesis §3.5).

``fifo``: YARN-CS — non-preemptive, FIFO by submit time with head-of-line blocking.
``best-effort``: FIFO that lets later jobs that fit go first. ``srtf`` / ``srsf``:
preemptive, by oracle remaining time / remaining time x GPUs. ``sf``: smallest GPU count
first (preemptive). ``gandiva-rr``: time sharing — at the end of every ``quantum`` (default
1800 s) the jobs that ran least recently go first and running jobs may be suspended; between
quantum ends arrivals only fill free GPUs (a round-robin variant of Gandiva's time slicing
that runs through the driver, with its placement and cost models; ``gandiva`` is the model
of the original Tiresias simulator, ``tiresias.gandiva``).
"""
from __future__ import annotations

from typing import Iterable

from .base import INF, JobState, Policy


class FIFO(Policy):
    name = "fifo"
    preemptive = False
    blocking = True
    reads_running_progress = False

    def key(self, job: JobState, now: float):
        return (job.submit_time, job.job_id)


class BestEffort(FIFO):
    name = "best-effort"
    blocking = False


class SRTF(Policy):
    name = "srtf"

    def key(self, job: JobState, now: float):
        return (job.remaining(), job.job_id)


class SRSF(Policy):
    name = "srsf"

    def key(self, job: JobState, now: float):
        return (job.remaining() * job.num_gpus, job.job_id)


class SmallestFirst(Policy):
    name = "sf"
    static_running_keys = True
    reads_running_progress = False

    def key(self, job: JobState, now: float):
        return (job.num_gpus, job.submit_time, job.job_id)


class GandivaRoundRobin(Policy):
    name = "gandiva-rr"
    reads_running_progress = False

    def __init__(self, quantum: float = 1800.0) -> None:
        super().__init__()
        if quantum <= 0:
            raise ValueError("quantum must be positive")
        self.quantum = quantum
        self.tick = quantum           # the end of the current quantum
        self.opened = -INF            # when the last quantum ended (a pass then may preempt)

    def key(self, job: JobState, now: float):
        last = now if job.running else job.last_run
        return (last, job.submit_time, job.job_id)

    def may_preempt(self, now: float) -> bool:
        if now + 1e-9 * max(1.0, now) >= self.tick:
            self.tick = now + self.quantum
            self.opened = now
        return self.opened == now

    def next_change(self, running: Iterable[JobState], now: float) -> float:
        return self.tick if len(self.active) > len(self.running) else INF
