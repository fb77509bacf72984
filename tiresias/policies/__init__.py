"""Scheduling policies, pure objects over ``JobState`` records, and their registry."""
from __future__ import annotations

from .base import JobState, Policy, allocate
from ..cluster import ClusterSpec
from .baselines import FIFO, SRSF, SRTF, BestEffort, GandivaRoundRobin, SmallestFirst
from .elastic import ALLOCATION_POLICIES, DEFAULT_INTERVAL, AllocationPolicy
from .gandiva import SWITCH_SECONDS, GandivaModel
from .las import ContinuousGittins, ContinuousLAS, DiscretizedGittins, DiscretizedLAS

POLICIES = ("las", "gittins", "srtf", "srsf", "fifo", "best-effort", "sf", "gandiva", "gandiva-rr",
            *ALLOCATION_POLICIES)
# the oracle and its noisy variant read true durations and rates; the ablation is the simulator's
SIMULATOR_ONLY = ("gandiva", "gandiva-rr", "optimus-oracle", "optimus-noisy", "optimus-drf-alloc")


def make_policy(name: str, thresholds=(3200.0,), promote_knob: float | None = None, continuous: bool = False,
                interval: float | None = None, distribution: str | None = None, quantum: float = 1800.0,
                history=None, switch: float = SWITCH_SECONDS,
                cluster: ClusterSpec | None = None) -> Policy | GandivaModel:
    """A policy by its command-line name; gittins takes its service distribution from the CSV
    ``distribution`` or else from ``history`` (GPU-seconds of the trace's jobs). ``gandiva``
    is the original simulator's model (``switch`` period; node sets of ``cluster``'s shape,
    default the simulated cluster), ``gandiva-rr`` the round-robin policy (``quantum``).
    ``interval``: seconds between continuous priority updates (default 1) or between the
    rounds of an allocation policy (optimus, optimus-oracle, drf, tetris; default 600)."""
    if name in ALLOCATION_POLICIES:
        return ALLOCATION_POLICIES[name](DEFAULT_INTERVAL if interval is None else interval)
    if interval is None:
        interval = 1.0
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
        return GandivaModel(switch, cluster)
    if name == "gandiva-rr":
        return GandivaRoundRobin(quantum)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")


def _distribution(path: str | None, history):
    from ..gittins import ServiceDistribution
    if path:
        return ServiceDistribution.from_csv(path)
    if not history:
        raise ValueError("gittins needs a service distribution: --distribution CSV or a trace")
    return ServiceDistribution(history)


__all__ = ["JobState", "Policy", "AllocationPolicy", "allocate", "make_policy", "POLICIES", "SIMULATOR_ONLY",
           "FIFO", "BestEffort",
           "SRTF", "SRSF", "SmallestFirst", "GandivaRoundRobin", "GandivaModel", "DiscretizedLAS",
           "DiscretizedGittins", "ContinuousLAS", "ContinuousGittins"]
