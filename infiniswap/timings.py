"""Summaries of measured durations for ``stats()`` reports and the benchmark.

Owns one bounded recorder (``Timings``: the last ``keep`` samples plus a total count) and
the percentile summary every report uses, so the daemon, the device and the benchmark
print the same fields.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Iterable

__all__ = ["Timings", "summarize"]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """``{count, mean, p50, p99, max}`` of ``values`` (``None`` fields when empty)."""
    v = sorted(values)
    if not v:
        return {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    return {"count": len(v), "mean": sum(v) / len(v), "p50": _percentile(v, 50),
            "p99": _percentile(v, 99), "max": v[-1]}


class Timings:
    """The last ``keep`` durations (seconds) and how many were ever recorded."""

    def __init__(self, keep: int = 1024) -> None:
        self._values: deque[float] = deque(maxlen=keep)
        self.total = 0

    def add(self, seconds: float) -> None:
        self._values.append(float(seconds))
        self.total += 1

    def values(self) -> list[float]:
        return list(self._values)

    def summary(self) -> dict[str, float | int | None]:
        s = summarize(self._values)
        s["count"] = self.total
        return s
