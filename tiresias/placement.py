"""Where a job's GPUs go (thesis §3.3.3) and how to move few jobs between rounds (Tesserae §4.1).

Pure functions over plain data: ``free`` is the list of free GPUs per node, an allocation is a
list of ``(node, gpus)`` pairs.

* ``place``: a job whose skew exceeds ``PACKLIMIT`` is consolidated onto the fewest nodes
  possible (one node if it fits in one, else ``ceil(g / gpus_per_node)`` nodes) or not
  placed at all; any other job goes where it limits fragmentation — the fullest node that
  holds it whole (best fit), else the smallest holes first, so whole free nodes stay free for
  jobs that need consolidation.
* ``place_most_free``: Pollux's simulator's placement (its Tiresias and Optimus+Oracle): the
  job's GPUs taken, a node at a time, from the node with the most free GPUs (ties: the
  lowest index); used to compare with its published figures.
* ``repack``: a placement of a whole set of jobs from scratch, in priority order
  (consolidated jobs first), used when fragmentation blocks a consolidated job.
* ``migration_plan``: Tesserae's migration-minimizing relabeling — nodes are identical, so a
  new plan can be renamed node for node; the Hungarian method
  (``scipy.optimize.linear_sum_assignment``) picks the renaming with the least migration
  cost, where moving a job of ``g`` GPUs in or out of a node costs ``0.5 / g`` per GPU
  (Tesserae Algorithm 3: the cost of a multi-GPU job is amortized over its GPUs).
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import Iterable, Sequence

import numpy as np

Allocation = list[tuple[int, int]]

DEFAULT_PACKLIMIT = 0.4   # between the low-skew (<= 0.15) and high-skew (>= 0.6) models of Table 3.3


def min_nodes(gpus: int, gpus_per_node: int) -> int:
    return max(1, math.ceil(gpus / gpus_per_node))


def is_consolidated(alloc: Allocation, gpus_per_node: int) -> bool:
    return len(alloc) <= min_nodes(sum(g for _, g in alloc), gpus_per_node)


def needs_consolidation(skew: float, packlimit: float) -> bool:
    return skew > packlimit


def place(free: Sequence[int], gpus: int, consolidate: bool, gpus_per_node: int) -> Allocation | None:
    """An allocation of ``gpus`` GPUs on nodes with ``free`` GPUs (each >= 0), or None; ``free``
    is not changed."""
    if gpus <= 0:
        raise ValueError(f"a job needs at least one GPU, got {gpus}")
    counts = sorted(free)
    i = bisect_left(counts, gpus)
    if i < len(counts):                           # best fit on one node: the fewest free GPUs
        return [(free.index(counts[i]), gpus)]    # that hold it, the first such node
    if sum(counts) < gpus:
        return None
    if consolidate:
        need = min_nodes(gpus, gpus_per_node)
        by_free = sorted(range(len(free)), key=free.__getitem__, reverse=True)[:need]   # ties: lowest index
        if sum(free[n] for n in by_free) < gpus:
            return None
        return _take(free, by_free, gpus)
    holes = sorted(range(len(free)), key=free.__getitem__)     # fewest free first (ties: lowest index)
    return _take(free, holes[bisect_right(counts, 0):], gpus)  # ... of the nodes with any


def place_most_free(free: Sequence[int], gpus: int) -> Allocation | None:
    """``gpus`` GPUs taken from the node with the most free GPUs, then the next (see the module
    docstring), or None when fewer are free; ``free`` is not changed."""
    if gpus <= 0:
        raise ValueError(f"a job needs at least one GPU, got {gpus}")
    if sum(f for f in free if f > 0) < gpus:
        return None
    order = sorted((n for n in range(len(free)) if free[n] > 0), key=lambda n: (-free[n], n))
    return _take(free, order, gpus)


def _take(free: Sequence[int], nodes: Iterable[int], gpus: int) -> Allocation:
    alloc: Allocation = []
    left = gpus
    for n in nodes:
        if left == 0:
            break
        take = min(free[n], left)
        if take:
            alloc.append((n, take))
            left -= take
    return alloc


def apply(free: list[int], alloc: Allocation, sign: int = -1) -> None:
    """Take (``sign=-1``) or give back (``sign=1``) an allocation's GPUs in ``free``."""
    for node, g in alloc:
        free[node] += sign * g
        if free[node] < 0:
            raise AssertionError(f"node {node} over-allocated")


def repack(jobs: Sequence[tuple[int, int, bool]], nodes: int, gpus_per_node: int) -> dict[int, Allocation] | None:
    """Place ``jobs`` = ``[(job_id, gpus, consolidate), ...]`` on empty nodes, consolidated
    jobs first, largest first; None if some job does not fit."""
    free = [gpus_per_node] * nodes
    plan: dict[int, Allocation] = {}
    for job_id, gpus, consolidate in sorted(jobs, key=lambda j: (not j[2], -j[1], j[0])):
        alloc = place(free, gpus, consolidate, gpus_per_node)
        if alloc is None:
            return None
        apply(free, alloc)
        plan[job_id] = alloc
    return plan


def count_migrations(old: dict[int, Allocation], new: dict[int, Allocation], relabel: Sequence[int]) -> int:
    """Jobs in both plans whose node allocation differs once new node ``j`` is called ``relabel[j]``."""
    moved = 0
    for job_id, alloc in new.items():
        before = old.get(job_id)
        if before is not None and sorted(before) != sorted((relabel[n], g) for n, g in alloc):
            moved += 1
    return moved


def migration_plan(old: dict[int, Allocation], new: dict[int, Allocation], nodes: int) -> tuple[list[int], int, int]:
    """Rename the new plan's nodes to minimize migrations from ``old``.

    Returns ``(relabel, migrations, naive_migrations)``: new node ``j`` becomes physical node
    ``relabel[j]``; ``naive_migrations`` is the count without renaming (identity).
    """
    from scipy.optimize import linear_sum_assignment

    both = [j for j in new if j in old]
    cost = np.zeros((nodes, nodes))
    for job_id in both:
        gpus = sum(g for _, g in new[job_id])
        unit = 0.5 / gpus
        o = np.zeros(nodes)
        n = np.zeros(nodes)
        for node, g in old[job_id]:
            o[node] += g
        for node, g in new[job_id]:
            n[node] += g
        # cost[i, j]: GPUs of this job moved in or out if new node j becomes old node i
        cost += unit * np.abs(o[:, None] - n[None, :])
    rows, cols = linear_sum_assignment(cost)
    relabel = [0] * nodes
    for i, j in zip(rows, cols):
        relabel[j] = int(i)
    identity = list(range(nodes))
    return relabel, count_migrations(old, new, relabel), count_migrations(old, new, identity)
