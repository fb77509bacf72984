"""Cyclic execution on one aggregator (thesis §4.3.3.2, Fig. 4.6; pure, no clock of its own).

An aggregator that packs several jobs runs in cycles of ``C`` = the largest standalone
iteration duration among them. Job ``j`` owns ``runs_j = floor(C / D_j)`` execution slots
per cycle, evenly spaced: slot ``k`` is due by ``start + (k + 1) * C / runs_j``. Each
aggregation of one iteration of ``j`` on this aggregator (all its keys here, CPU time
``e_j``) takes the job's next slot:

* on time (its slot is not over yet): it runs at once;
* late (its slot is over, or the job used all its slots this cycle): it is an outlier. It runs
  in this cycle only if the time left, after reserving ``e`` for every slot the other jobs
  still own in this cycle, holds it; otherwise it is postponed to the start of the next cycle,
  where it takes that cycle's first slot of the job. Co-located jobs keep their slots either
  way; in the worst case the late job loses one iteration (§4.3.3.2, "Handling outliers").

``CyclicSchedule.admit(job, now)`` returns when to run the aggregation (``now`` or a later
cycle start). Jobs without a reservation (not packed here yet) run at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from ..wire.cycles import cycle_of, runs_per_cycle


@dataclass
class _Slots:
    runs: int
    cost: float
    used: dict = field(default_factory=dict)      # cycle index -> slots taken


class CyclicSchedule:
    """Execution slots of the jobs packed on one aggregator."""

    def __init__(self, jobs: Mapping[str, tuple[float, float]], start: float) -> None:
        """``jobs`` maps job -> (standalone iteration D_j, CPU time e_j of its tasks here)."""
        self.cycle = cycle_of(jobs)
        if self.cycle <= 0:
            raise ValueError("a cyclic schedule needs at least one job with a positive iteration duration")
        self.start = start
        self.slots = {job: _Slots(runs_per_cycle(d, self.cycle), max(0.0, e)) for job, (d, e) in jobs.items()}
        self.late = 0          # outliers seen
        self.postponed = 0     # outliers moved to the next cycle

    def index(self, now: float) -> int:
        return max(0, math.floor((now - self.start) / self.cycle))

    def cycle_start(self, index: int) -> float:
        return self.start + index * self.cycle

    def reserved(self, index: int, now: float, exclude: str | None = None) -> float:
        """CPU time still owed, in cycle ``index``, to other jobs' slots not yet taken."""
        total = 0.0
        for job, s in self.slots.items():
            if job != exclude:
                total += max(0, s.runs - s.used.get(index, 0)) * s.cost
        return total

    def admit(self, job: str, now: float) -> float:
        """When the aggregation of ``job``'s next iteration may run (``now`` or later)."""
        s = self.slots.get(job)
        if s is None:
            return now
        idx = self.index(now)
        for old in [i for i in s.used if i < idx]:
            del s.used[old]
        taken = s.used.get(idx, 0)
        due = self.cycle_start(idx) + (taken + 1) * self.cycle / s.runs
        if taken < s.runs and now <= due:
            s.used[idx] = taken + 1
            return now
        self.late += 1
        end = self.cycle_start(idx + 1)
        if end - now - self.reserved(idx, now, exclude=job) >= s.cost:
            s.used[idx] = taken + 1
            return now
        self.postponed += 1
        nxt = idx + 1
        while s.used.get(nxt, 0) >= s.runs:
            nxt += 1
        s.used[nxt] = s.used.get(nxt, 0) + 1
        return self.cycle_start(nxt)
