"""The arithmetic of cyclic execution (thesis §4.3.3.2), which pMaster's packing and each
aggregator's schedule both follow: an aggregator runs in cycles as long as the largest
standalone iteration duration ``D`` of the jobs it serves, and a job with a shorter ``D``
runs ``floor(C / D)`` times per cycle (pure functions)."""
from __future__ import annotations

from typing import Mapping

EPS = 1e-9      # slack in the floor and the comparisons over cycle times


def runs_per_cycle(duration: float, cycle: float) -> int:
    """How many iterations of a job with standalone iteration ``duration`` fit in ``cycle``."""
    if duration <= 0 or cycle <= 0:
        raise ValueError(f"iteration duration and cycle must be positive, got {duration} and {cycle}")
    return max(1, int(cycle / duration + EPS))


def effective_iteration(duration: float, cycle: float) -> float:
    """A job's iteration duration on an aggregator whose cycle is ``cycle`` (``d_j``)."""
    return cycle / runs_per_cycle(duration, cycle)


def cycle_of(jobs: Mapping[str, tuple[float, float]]) -> float:
    """``C_n``: the largest standalone iteration duration among the jobs on an aggregator."""
    return max((d for d, _ in jobs.values()), default=0.0)
