"""The queues of 2D-LAS and 2D-Gittins: the paper's fixed K and thresholds, or ``auto``.

The paper fixes ``K = 2`` queues split at 3,200 GPU-seconds (``--queues 2 --thresholds
3200``, the default). Where most of the work belongs to jobs above the last threshold — 98%
of philly.csv's GPU-seconds are above 3,200 — the last queue, FIFO by first start, decides
the average JCT (DESIGN §5).

``--queues auto`` derives K and the thresholds from the service distribution (GPU-seconds
per job: ``--distribution CSV`` or else the trace's own jobs)::

    thresholds = median x 2^i   for i = 0, 1, ... up to the first one >= the largest service
    K          = len(thresholds) + 1

Below the median, half of the jobs finish in Q1 without a single demotion; above it every
queue doubles the service of the one before — the multi-level feedback queue's doubling
quanta, which approximates least-attained-service at a factor-of-two granularity, so a job
is demoted at most ``log2(max / median) + 1`` times. The last queue starts beyond the
largest job of the distribution, so (with the trace's own jobs as the distribution) no job
reaches it and its FIFO order decides nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEFAULT_QUEUES = 2
DEFAULT_THRESHOLDS = (3200.0,)
AUTO_RATIO = 2.0
MAX_QUEUES = 64


@dataclass(frozen=True)
class QueueConfig:
    """K - 1 increasing thresholds (GPU-seconds); ``auto``: derived by ``auto_thresholds``."""
    thresholds: tuple[float, ...]
    auto: bool = False

    @property
    def queues(self) -> int:
        return len(self.thresholds) + 1

    def as_dict(self) -> dict:
        return {"queues": self.queues, "thresholds": list(self.thresholds), "auto": self.auto}

    def text(self) -> str:
        shown = ", ".join(f"{t:,.0f}" for t in self.thresholds)
        rule = " (auto: x2 from the median to past the largest service)" if self.auto else ""
        return f"K={self.queues}, thresholds {shown} GPU-s{rule}" if self.thresholds else "K=1 (FIFO by start)"


def auto_thresholds(services: Sequence[float], ratio: float = AUTO_RATIO) -> list[float]:
    """Thresholds from the median of ``services`` (GPU-seconds), times ``ratio`` until past the
    largest (see the module docstring); at least one threshold."""
    s = np.asarray(services, dtype=float)
    s = s[np.isfinite(s) & (s > 0)]
    if s.size == 0:
        raise ValueError("--queues auto needs a service distribution with positive GPU-seconds")
    if not ratio > 1:
        raise ValueError(f"the ratio between thresholds must be > 1, got {ratio}")
    low, high = float(np.median(s)), float(s.max())
    count = 1 + max(0, math.ceil(math.log(high / low, ratio) - 1e-9))
    if count + 1 > MAX_QUEUES:
        raise ValueError(f"--queues auto would need {count + 1} queues (more than {MAX_QUEUES}): "
                         f"services from {low:g} to {high:g} GPU-s")
    return [low * ratio ** i for i in range(count)]


def queue_config(queues: str | int, thresholds: str | Sequence[float] | None,
                 services: Sequence[float] | None = None) -> QueueConfig:
    """``--queues K --thresholds T1,T2,...`` or ``--queues auto`` (``services`` needed) -> a
    ``QueueConfig``; ``ValueError`` on a mismatch."""
    text = str(queues).strip().lower()
    if text == "auto":
        if services is None:
            raise ValueError("--queues auto needs a service distribution (--distribution or a trace)")
        return QueueConfig(tuple(auto_thresholds(services)), auto=True)
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"--queues must be a number of queues >= 1 or 'auto', got {queues!r}") from None
    if thresholds is None:
        values = list(DEFAULT_THRESHOLDS)
    elif isinstance(thresholds, str):
        try:
            values = [float(t) for t in thresholds.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--thresholds must be numbers separated by commas, got {thresholds!r}") from None
    else:
        values = [float(t) for t in thresholds]
    if k < 1 or len(values) != k - 1:
        raise ValueError(f"--queues {k} needs {k - 1} thresholds, got {values}")
    if any(not (0 < t < math.inf) for t in values) or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"queue thresholds must be positive and increasing, got {values}")
    return QueueConfig(tuple(values))
