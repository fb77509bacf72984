"""A deadline that recurs: the timer a control loop polls its sockets against.

The daemon, the device controller and the aggregator all run one loop: poll sockets and a
waker until the earliest deadline, handle what arrived, then run whatever is due.
``Periodic`` is one of those deadlines: ``due(now)`` says whether it fired and moves it
one period on -- without drift, and without a burst of catch-up runs after a stall (the
next run is never less than half a period away).
"""
from __future__ import annotations

__all__ = ["Periodic"]


class Periodic:
    """Fires every ``period`` seconds from ``start`` (``period`` ``None``: never fires)."""

    def __init__(self, period: float | None, start: float) -> None:
        if period is not None and period <= 0:
            raise ValueError(f"period must be positive, got {period!r}")
        self.period = period
        self.deadline = start if period is not None else float("inf")

    def due(self, now: float) -> bool:
        """Whether the deadline has passed; if so, it moves to the next period."""
        if now < self.deadline or self.period is None:
            return False
        self.deadline = max(self.deadline + self.period, now + self.period / 2)
        return True

    def wait(self, now: float) -> float:
        """Seconds until the deadline (0 when due)."""
        return max(0.0, self.deadline - now)
