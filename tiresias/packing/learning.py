"""Online profile updates from measured speeds (live GPU sharing), as plain bookkeeping.

A running job's speed (steps per second: AutoPS's iteration times, else its
``tiresias.job`` progress) is sampled at every pass. ``SpeedLearner`` keeps each job's speed
alone (an exponential average of the samples taken while it had no partner) and turns a
sample taken while it shared GPUs into a normalised speed, that sample over its speed alone.
When both jobs of a pair have one, the pair's measurement is ready for
``ProfileStore.observe``. Samples are taken only once a job has kept its partner (or lack of
one) for ``settle`` seconds, since a speed is measured over a window of recent reports and
must not mix two pairings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

ALONE_WEIGHT = 0.3        # weight of a new sample in a job's average speed alone


@dataclass
class _Job:
    partner: int | None = None
    since: float = 0.0                     # when it got its current partner (or none)
    alone: float | None = None             # steps/s alone, averaged
    packed: dict[int, float] = field(default_factory=dict)   # partner -> normalised speed with it


class SpeedLearner:
    """Normalised speeds of packed jobs from their measured speeds (module docstring)."""

    def __init__(self, settle: float = 60.0) -> None:
        if not settle >= 0:
            raise ValueError(f"settle must be >= 0 s, got {settle!r}")
        self.settle = settle
        self.jobs: dict[int, _Job] = {}

    def sample(self, now: float, job_id: int, partner: int | None, rate: float | None
               ) -> tuple[int, float, int, float] | None:
        """``job_id`` runs at ``rate`` steps/s with ``partner`` (None: alone) at ``now``.
        Returns ``(job, its normalised speed, partner, the partner's)`` when the pair's
        measurement is complete (each side once), else None."""
        job = self.jobs.setdefault(job_id, _Job(partner, now))
        if job.partner != partner:
            job.partner, job.since = partner, now
            return None
        if rate is None or not rate > 0 or now - job.since < self.settle:
            return None
        if partner is None:
            job.alone = rate if job.alone is None else (1 - ALONE_WEIGHT) * job.alone + ALONE_WEIGHT * rate
            return None
        if job.alone is None:
            return None                     # never measured alone: nothing to normalise by
        job.packed[partner] = rate / job.alone
        other = self.jobs.get(partner)
        if other is None or job_id not in other.packed:
            return None
        mine, theirs = job.packed.pop(partner), other.packed.pop(job_id)
        return job_id, mine, partner, theirs

    def forget(self, job_id: int) -> None:
        """The job left for good."""
        self.jobs.pop(job_id, None)


def observe(sharing, kinds: dict[int, Hashable | None], measured: tuple[int, float, int, float]) -> bool:
    """Fold a complete measurement into ``sharing`` (a ``slots.Sharing``); False when either
    job has no profile key."""
    a, sa, b, sb = measured
    ka, kb = kinds.get(a), kinds.get(b)
    if ka is None or kb is None:
        return False
    sharing.observe(ka, kb, sa, sb)
    return True
