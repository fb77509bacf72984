"""Scheduling policies, pure objects over ``JobState`` records, and their registry."""
from __future__ import annotations

from .base import JobState, Policy, allocate
from .baselines import FIFO, SRSF, SRTF, BestEffort, Gandiva, SmallestFirst
from .las import ContinuousGittins, ContinuousLAS, DiscretizedGittins, DiscretizedLAS

POLICIES = ("las", "gittins", "srtf", "srsf", "fifo", "best-effort", "sf", "gandiva")


def make_policy(name: str, thresholds=(3200.0,), promote_knob: float | None = None, continuous: bool = False,
                interval: float = 1.0, distribution: str | None = None, quantum: float = 1800.0,
                history=None) -> Policy:
    """A policy by its command-line name; gittins takes its service distribution from the CSV
    ``distribution`` or else from ``history`` (GPU-seconds of the trace's jobs)."""
    if name in ("las", "gittins") and continuous:
        if name == "las":
            return ContinuousLAS(interval)
        return ContinuousGittins(_distribution(distribution, history), interval)
    if name == "las":
        return DiscretizedLAS(thresholds, promote_knob)
    if name == "gittins":
        return DiscretizedGittins(_distribution(distribution, history), thresholds, promote_knob)
    simple = {"srtf": SRTF, "srsf": SRSF, "fifo": FIFO, "best-effort": BestEffort, "sf": SmallestFirst}
    if name in simple:
        return simple[name]()
    if name == "gandiva":
        return Gandiva(quantum)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")


def _distribution(path: str | None, history):
    from ..gittins import ServiceDistribution
    if path:
        return ServiceDistribution.from_csv(path)
    if not history:
        raise ValueError("gittins needs a service distribution: --distribution CSV or a trace")
    return ServiceDistribution(history)


__all__ = ["JobState", "Policy", "allocate", "make_policy", "POLICIES", "FIFO", "BestEffort", "SRTF", "SRSF",
           "SmallestFirst", "Gandiva", "DiscretizedLAS", "DiscretizedGittins", "ContinuousLAS", "ContinuousGittins"]
