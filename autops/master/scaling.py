"""Aggregator clusters and hybrid scaling decisions (thesis §4.3.3.4; pure functions).

The pool is split into clusters of at most ``cluster_size`` aggregators, each run by a
controller that packs its own jobs (``assignment.pack_job``). pMaster forwards a profiled job
to the best-fit cluster: the one with sufficient but the least free CPU, counting the
unused CPU of its aggregators and the aggregators it may still add. Scaling is hybrid:
allocations a controller asks for are granted at once when they reach ``threshold``
aggregators, otherwise at the next period boundary; at every period, idle aggregators beyond
``spare`` are released, least-loaded ones are recycled and empty clusters are dissolved.
"""
from __future__ import annotations

from typing import Mapping

from .assignment import Loads, busy_fraction


def cluster_free_cpu(loads: Loads, cluster_size: int) -> float:
    """Free CPU of a cluster in aggregators: unused share of each + slots it may still fill."""
    used = sum(busy_fraction(jobs) for jobs in loads.values())
    return max(0, cluster_size - len(loads)) + len(loads) - used


def choose_cluster(free: Mapping[str, float], demand: float) -> str | None:
    """Best-fit cluster for a job needing ``demand`` aggregators of CPU; None: open a new one."""
    fits = [(room, name) for name, room in free.items() if room + 1e-9 >= demand]
    return min(fits)[1] if fits else None


def allocate_now(needed: int, threshold: int) -> bool:
    """On-demand allocation between periods only for requests of ``threshold`` or more."""
    return needed > 0 and needed >= threshold


def idle_to_release(loads: Loads, spare: int = 0) -> list[str]:
    """Aggregators without tasks to give back, keeping ``spare`` idle ones (most recent names last)."""
    idle = sorted(name for name, jobs in loads.items() if not jobs)
    return idle[:max(0, len(idle) - spare)]


def admissible(requested: int, capacity: int | None, busy: int) -> bool:
    """Admission control (§4.3.3.5): the worst case, ``requested`` dedicated aggregators, must
    fit next to the ``busy`` ones; ``capacity`` None means the provider has no fixed bound."""
    return capacity is None or requested <= capacity - busy
