"""Retention of ended jobs, as pure policy: which ended jobs are old enough to prune.

``cutoff(now, retention_s)`` is the ``ended`` time before which a finished, failed or
cancelled job is pruned (None: keep forever). The master's ``prune_step`` (the mechanism)
asks the store for at most ``batch`` of them at a time, deletes their rows, runs and events
in one short transaction under its lock, and removes their job and checkpoint dirs outside
it; a pruned job then answers 404 like one that never was.
"""
from __future__ import annotations

from dataclasses import dataclass

DAY = 86400.0


@dataclass(frozen=True)
class RetentionConfig:
    retention_s: float = 30 * DAY       # 0: keep forever
    batch: int = 200                    # jobs pruned per transaction
    check_every_s: float = 60.0         # between prune rounds

    def __post_init__(self) -> None:
        if self.retention_s < 0 or self.batch < 1 or self.check_every_s <= 0:
            raise ValueError("--retention must be >= 0 (and the batch >= 1, the period > 0)")


def cutoff(now: float, retention_s: float) -> float | None:
    """Ended before this: pruned; None when retention is off (0)."""
    if not retention_s:
        return None
    return now - retention_s


def expired(ended: float | None, status: str, now: float, retention_s: float,
            terminal: tuple[str, ...] = ("finished", "failed", "cancelled")) -> bool:
    """Whether a job with this end and status is due for pruning."""
    limit = cutoff(now, retention_s)
    return limit is not None and ended is not None and status in terminal and ended < limit
