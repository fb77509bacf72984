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
cycle start). Jobs without a reservation (not packed here yet) run at once. ``Cycles`` applies
it to an aggregator's pushes: the schedule pMaster sets (CYCLE), each job's latest admitted
iteration, and the pushes of an iteration put off until its slot.
"""
from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..wire.cycles import cycle_of, runs_per_cycle

__all__ = ["CyclicSchedule", "Cycles"]

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


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


class Cycles:
    """Cyclic execution on one aggregator: the schedule in force (None: every push is
    aggregated at once), each job's latest admitted iteration, and per job the iteration put
    off until its slot with its pushes (``timers``: when each is due).

    ``stats``: the aggregator's figures, to which the outliers of a schedule replaced are
    added (``late``, ``postponed``); ``apply_push(key, rank, data, deferred)``: aggregate a
    push put off, once its slot came."""

    def __init__(self, stats: dict, apply_push: Callable[..., None]) -> None:
        self.stats = stats
        self.apply_push = apply_push
        self.schedule: CyclicSchedule | None = None
        self.admitted: dict[str, int] = {}
        self.postponed: dict[str, tuple[float, int, list]] = {}   # job -> (run at, iteration, pushes)
        self.timers: list[tuple[float, str]] = []

    def set(self, jobs: dict, now: float) -> None:
        """CYCLE: pMaster's packing changed: the jobs here, their standalone D and CPU time e."""
        try:
            parsed = {str(j): (float(v[0]), float(v[1])) for j, v in jobs.items()}
        except (TypeError, ValueError, IndexError):
            log.warning("bad cycle message: %r", jobs)
            return
        if self.schedule is not None:
            self.stats["late"] += self.schedule.late
            self.stats["postponed"] += self.schedule.postponed
        self.schedule = CyclicSchedule(parsed, now) if len(parsed) >= 2 else None
        if self.schedule is None:
            self.run_due(float("inf"))
        log.info("execution cycle %s for %s", f"{self.schedule.cycle:.3f}s" if self.schedule else "off",
                 sorted(parsed))

    def admit(self, job: str, iteration: int, now: float) -> bool:
        """May this push be aggregated now? False: it joins its job's postponed iteration (``postpone``)."""
        pending = self.postponed.get(job)
        if pending is not None and pending[1] == iteration:
            return False
        if self.schedule is None or job not in self.schedule.slots or iteration <= self.admitted.get(job, 0):
            return True
        self.admitted[job] = iteration
        run_at = self.schedule.admit(job, now)
        if run_at <= now:
            return True
        self.postponed[job] = (run_at, iteration, [])
        heapq.heappush(self.timers, (run_at, job))
        return False

    def postpone(self, job: str, push: tuple) -> None:
        """A push ``admit`` refused: ``(key, rank, data, deferred)``, aggregated with its iteration."""
        self.postponed[job][2].append(push)

    def run_due(self, now: float) -> None:
        """Aggregate the pushes put off whose slot came by ``now``."""
        while self.timers and self.timers[0][0] <= now:
            _, job = heapq.heappop(self.timers)
            pending = self.postponed.pop(job, None)
            for ks, rank, data, deferred in (pending[2] if pending else ()):
                self.apply_push(ks, rank, data, deferred)

    def next_due(self) -> float | None:
        """When the next pushes put off are due (None: none are)."""
        return self.timers[0][0] if self.timers else None

    def outliers(self) -> dict[str, int]:
        """Late and postponed aggregations so far: the earlier schedules' and the current one's."""
        live = self.schedule
        return {"late": self.stats["late"] + (live.late if live is not None else 0),
                "postponed": self.stats["postponed"] + (live.postponed if live is not None else 0)}

    def release(self, job: str) -> None:
        """The job left this aggregator: its admitted iteration and pushes put off are forgotten."""
        self.admitted.pop(job, None)
        self.postponed.pop(job, None)
