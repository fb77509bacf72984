"""Offered load: how much work a trace asks of a cluster, overall and per week.

Average JCTs mean little without the regime they were measured in (DESIGN §5): on
``philly.csv`` at 48x8 the trace asks 1.1–1.9x the cluster for weeks, so queueing decides the
averages. Every comparison therefore reports the offered load next to it.

Definition. A job's work is ``num_gpus x duration`` GPU-seconds (its execution alone,
consolidated, without overheads). The offered load of a window ``[a, b)`` is the work of the
jobs *submitted* in it divided by what the cluster can serve in it::

    load[a, b) = sum(num_gpus x duration of jobs with a <= submit < b) / (GPUs x (b - a))

``overall`` is the window from the first to the last submission (the last job counted);
``weekly`` cuts that window into 7-day windows from the first submission, the last one
ending at the last submission (so it may be shorter than a week; a remainder shorter than a
day is folded into the week before, so that a last job alone does not make a window). Above 1 the backlog grows
whatever the policy. With every job submitted at the same instant there is no window: the
loads are None.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

WEEK = 7 * 86400.0


@dataclass(frozen=True)
class OfferedLoad:
    gpus: int
    jobs: int
    span_seconds: float                 # first to last submission
    overall: float | None               # None: every job submitted at once
    weekly: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """One line: ``offered load 0.97 of 384 GPUs over 108.9 days; per week: 0.52 1.10 ...``."""
        if self.overall is None:
            return f"offered load: undefined (all {self.jobs} jobs submitted at once) on {self.gpus} GPUs"
        line = f"offered load {self.overall:.2f} of {self.gpus} GPUs over {_duration(self.span_seconds)}"
        if len(self.weekly) > 1:
            line += "; per week: " + " ".join(f"{w:.2f}" for w in self.weekly)
        return line


def offered_load(jobs: Iterable, gpus: int, period: float = WEEK) -> OfferedLoad:
    """The offered load of ``jobs`` (objects with submit_time, num_gpus, duration) on ``gpus``
    GPUs, overall and per ``period`` (see the module docstring)."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if not period > 0:
        raise ValueError(f"period must be > 0, got {period}")
    rows = sorted((float(j.submit_time), float(j.num_gpus) * float(j.duration)) for j in jobs)
    if not rows:
        return OfferedLoad(gpus, 0, 0.0, None)
    start, end = rows[0][0], rows[-1][0]
    span = end - start
    if span <= 0:
        return OfferedLoad(gpus, len(rows), 0.0, None)
    windows = max(1, math.ceil(span / period))
    if windows > 1 and span - (windows - 1) * period < period / 7:
        windows -= 1                                     # fold a short remainder into the last week
    work = [0.0] * windows
    for submit, w in rows:
        work[min(windows - 1, int((submit - start) // period))] += w
    lengths = [period] * (windows - 1) + [span - (windows - 1) * period]
    weekly = [w / (gpus * n) for w, n in zip(work, lengths)]
    return OfferedLoad(gpus, len(rows), span, sum(work) / (gpus * span), weekly)


def _duration(seconds: float) -> str:
    if seconds >= 86400.0:
        return f"{seconds / 86400.0:.1f} days"
    if seconds >= 3600.0:
        return f"{seconds / 3600.0:.1f} h"
    return f"{seconds:.0f} s"
