"""Online profile updates from measured speeds (live GPU sharing), as plain bookkeeping.

A running job's speed (steps per second: AutoPS's iteration times, else its
``tiresias.job`` progress since its current pairing began) is sampled at every pass once the
pairing has held ``settle`` seconds. ``SpeedLearner`` keeps each job's speed alone (an
exponential average of the samples taken while it had no partner) and its latest speed beside
each partner. A pair's measurement is ready once both jobs have a speed beside the other and a
speed alone, in either order (a job that only ever ran packed is measured alone after its
partner leaves): each job's normalised speed is its speed beside the other over its speed
alone, what ``ProfileStore.observe`` folds in.
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
    packed: dict[int, float] = field(default_factory=dict)   # partner -> steps/s beside it
    kind: Hashable | None = None           # its profile key (kept after it ends, for its partner)


class SpeedLearner:
    """Normalised speeds of packed jobs from their measured speeds (module docstring)."""

    def __init__(self, settle: float = 60.0) -> None:
        if not settle >= 0:
            raise ValueError(f"settle must be >= 0 s, got {settle!r}")
        self.settle = settle
        self.jobs: dict[int, _Job] = {}

    def since(self, now: float, job_id: int, partner: int | None) -> float:
        """When ``job_id``'s current pairing (``partner``, None: alone) began; a change of
        partner starts a new one now. Speeds are measured from then on."""
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = _Job(partner, now)
        elif job.partner != partner:
            job.partner, job.since = partner, now
        return job.since

    def sample(self, now: float, job_id: int, partner: int | None, rate: float | None,
               kind: Hashable | None = None) -> tuple[int, float, int, float] | None:
        """``job_id`` (profile key ``kind``) runs at ``rate`` steps/s with ``partner`` (None:
        alone) at ``now``. Returns ``(job, its normalised speed, partner, the partner's)`` when
        a pair's measurement is complete, else None."""
        start = self.since(now, job_id, partner)
        if kind is not None:
            self.jobs[job_id].kind = kind
        if rate is None or not rate > 0 or now - start < self.settle:
            return None
        job = self.jobs[job_id]
        if partner is None:
            job.alone = rate if job.alone is None else (1 - ALONE_WEIGHT) * job.alone + ALONE_WEIGHT * rate
            for other in list(job.packed):          # a pair measured before its speed alone was known
                done = self._complete(job_id, other)
                if done is not None:
                    return done
            return None
        job.packed[partner] = rate
        return self._complete(job_id, partner)

    def _complete(self, a: int, b: int) -> tuple[int, float, int, float] | None:
        ja, jb = self.jobs.get(a), self.jobs.get(b)
        if ja is None or jb is None or ja.alone is None or jb.alone is None \
                or b not in ja.packed or a not in jb.packed:
            return None
        sa, sb = ja.packed.pop(b) / ja.alone, jb.packed.pop(a) / jb.alone
        return a, sa, b, sb

    def kind(self, job_id: int) -> Hashable | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.kind

    def forget(self, job_id: int) -> None:
        """The job left for good; a partner still waiting for its speed alone keeps the pair."""
        job = self.jobs.get(job_id)
        if job is not None and not job.packed and not any(job_id in o.packed for o in self.jobs.values()):
            del self.jobs[job_id]


def observe(sharing, kinds: dict[int, Hashable | None], measured: tuple[int, float, int, float]) -> bool:
    """Fold a complete measurement into ``sharing`` (a ``slots.Sharing``); False when either
    job has no profile key."""
    a, sa, b, sb = measured
    ka, kb = kinds.get(a), kinds.get(b)
    if ka is None or kb is None:
        return False
    sharing.observe(ka, kb, sa, sb)
    return True
