"""GPU-level migration between consecutive round plans (Tesserae §4.1, Algorithms 2, 3 and 5).

This module owns the answer to "the scheduler computed a new round plan: where do its nodes and
GPUs go physically, so that the fewest running jobs move?". A plan is ``plan[node][gpu]`` = the
ids of the jobs on that GPU (0, 1 or 2 with packing; nothing here depends on the bound).

* A job is *migrated* when it is in both rounds and its set of physical GPUs changes. Jobs in
  only one round start or stop; they are left out of costs and counts (Algorithm 2, line 2).
  A job in one round only adds a constant to a whole row of every cost matrix, so leaving it out
  changes the reported cost, never the renaming.
* GPUs are homogeneous, so the new plan may be *renamed* for free: its node ``j`` becomes any
  physical node and, within a node, its GPUs may be permuted.
* ``gpu_cost`` (Algorithm 3, lines 2-7): placing a new GPU's jobs on an old GPU costs, for every
  job on exactly one of the two, ``0.5 / gpus`` (a move out or a move in, amortised over a
  multi-GPU job's GPUs). A job that moves entirely costs 1 in all; one that keeps its GPUs, 0.
* ``node_cost`` (Algorithm 3): the cheapest GPU permutation between an old and a new node
  (Hungarian method, ``scipy.optimize.linear_sum_assignment``).
* ``plan_migration`` (Algorithm 2): the Hungarian method over the node cost matrix picks the node
  renaming, then each chosen pair's GPU permutation. Matching nodes first keeps a distributed
  job's GPUs on one node together (consolidation is kept). The objective amortises a job over its
  GPUs, so in rare packed cases the cheapest renaming moves more jobs than none at all; by
  default the new plan is then kept as named (never worse than Gavel's rule, see the function).
* ``gpu_level_only`` (Appendix B, Algorithm 5): one Hungarian over all GPUs, ignoring nodes; with
  packing it can split a consolidated job across nodes. Kept to compare, not to schedule with.

Ties between equally cheap renamings are broken towards keeping the new plan's own names (a bias
of ``1e-9`` per kept name, far below any real cost difference), so an already optimal new plan is
applied as it is.

Speed (80-GPU clusters every round, 1000+ GPUs now and then): the cost of node pair ``(i, j)`` is
``W_old[i] + W_new[j] - 2 * M[i, j]``, where ``M`` is the heaviest GPU matching of the jobs the
two nodes have in common, so ``M`` is computed only for pairs that share a job; it has a closed
form unless some GPU of the pair holds two shared jobs, and those Hungarians are cached by the
pair's contents (nodes with identical contents share the work). ``linear_sum_assignment`` then
runs once over the node matrix and once per chosen pair.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

import numpy as np

Plan = Sequence[Sequence[Collection[int]]]
Frozen = list[list[frozenset[int]]]

TIE_BIAS = 1e-9   # per kept name: below any real cost difference, above float noise


@dataclass
class MigrationPlan:
    """How to apply a new plan: new node ``j`` becomes physical node ``node_of[j]`` and its GPU
    ``k`` becomes physical GPU ``gpu_of[j][k]`` of that node.

    ``gpu_map[j][k]`` is the same as a ``(node, gpu)`` pair. It is the only exact form for
    ``gpu_level_only``, which may spread a new node over several physical nodes: there
    ``node_of[j]`` is -1 for such a node and ``gpu_of[j][k]`` is the GPU's index within the node
    ``gpu_map[j][k][0]``.
    """

    node_of: list[int]
    gpu_of: list[list[int]]
    plan: list[list[frozenset[int]]]     # the new plan renamed onto physical nodes/GPUs
    migrated: list[int]                  # jobs in both rounds whose physical GPU set changed
    cost: float                          # the Hungarian objective (sum of node-pair costs)
    naive: list[int]                     # jobs migrated by Gavel's rule (no renaming)
    gpu_map: list[list[tuple[int, int]]] = field(default_factory=list)


# ---- plain helpers ------------------------------------------------------------------------------

def gpu_sets(plan: Plan) -> dict[int, frozenset[tuple[int, int]]]:
    """Each job's set of ``(node, gpu)``."""
    where: dict[int, set[tuple[int, int]]] = {}
    for n, node in enumerate(plan):
        for g, jobs in enumerate(node):
            for job in jobs:
                where.setdefault(job, set()).add((n, g))
    return {job: frozenset(s) for job, s in where.items()}


def _shape(old: Plan, new: Plan) -> tuple[int, int]:
    if len(old) != len(new):
        raise ValueError(f"old plan has {len(old)} nodes, new plan {len(new)}")
    per_node = len(old[0]) if len(old) else 0
    for name, plan in (("old", old), ("new", new)):
        for n, node in enumerate(plan):
            if len(node) != per_node:
                raise ValueError(f"{name} plan: node {n} has {len(node)} GPUs, expected {per_node}")
    return len(old), per_node


def _freeze(plan: Plan) -> Frozen:
    return [[frozenset(jobs) for jobs in node] for node in plan]


def _jobs(plan: Frozen) -> set[int]:
    return {job for node in plan for jobs in node for job in jobs}


def _units(jobs: Collection[int], gpus_of: Mapping[int, int]) -> dict[int, float]:
    """``0.5 / gpus`` per job: the cost of moving it in or out of one GPU."""
    units = {}
    for job in jobs:
        g = gpus_of.get(job)
        if g is None or g <= 0:
            raise ValueError(f"job {job}: no positive GPU count in gpus_of (got {g!r})")
        units[job] = 0.5 / g
    return units


def _moved(before: Mapping[int, frozenset], after: Mapping[int, frozenset], jobs: Collection[int]) -> list[int]:
    return sorted(job for job in jobs if before[job] != after[job])


def _assign(cost: np.ndarray) -> np.ndarray:
    """Column for each row of a square cost matrix, ties broken towards the diagonal."""
    if cost.shape[0] == 0:
        return np.zeros(0, dtype=int)
    from scipy.optimize import linear_sum_assignment     # scipy is slow to import
    biased = cost - TIE_BIAS * np.eye(cost.shape[0])
    rows, cols = linear_sum_assignment(biased)
    out = np.empty(cost.shape[0], dtype=int)
    out[rows] = cols
    return out


# ---- Algorithm 3 --------------------------------------------------------------------------------

def gpu_cost(old: Collection[int], new: Collection[int], gpus_of: Mapping[int, int]) -> float:
    """Cost of putting a new GPU's jobs ``new`` where ``old`` ran: ``0.5 / gpus`` for every job
    on exactly one of the two (moved out or moved in)."""
    moving = set(old) ^ set(new)
    units = _units(moving, gpus_of)
    return float(sum(units[job] for job in sorted(moving)))


def _node_block(old_node: Sequence[frozenset[int]], new_node: Sequence[frozenset[int]],
                units: Mapping[int, float]) -> np.ndarray:
    """GPU cost matrix of a node pair, ``[new gpu k, old gpu a]``, from weights and overlaps."""
    w_old = np.array([sum(units[j] for j in s) for s in old_node])
    w_new = np.array([sum(units[j] for j in s) for s in new_node])
    overlap = np.zeros((len(new_node), len(old_node)))
    old_at: dict[int, list[int]] = {}
    for a, s in enumerate(old_node):
        for job in s:
            old_at.setdefault(job, []).append(a)
    for k, s in enumerate(new_node):
        for job in s:
            for a in old_at.get(job, ()):
                overlap[k, a] += units[job]
    return w_new[:, None] + w_old[None, :] - 2.0 * overlap


def _node_pair(old_node: Sequence[frozenset[int]], new_node: Sequence[frozenset[int]],
               units: Mapping[int, float]) -> tuple[float, list[int]]:
    g = len(old_node)
    identity = list(range(g))
    if list(old_node) == list(new_node):
        return 0.0, identity
    if Counter(old_node) == Counter(new_node):          # same contents, GPUs permuted: match them
        free: dict[frozenset[int], list[int]] = {}
        for a, s in enumerate(old_node):
            free.setdefault(s, []).append(a)
        keep = [new_node[k] == old_node[k] for k in range(g)]
        for k in range(g):
            if keep[k]:
                free[new_node[k]].remove(k)
        assignment = [k if keep[k] else -1 for k in range(g)]
        for k in range(g):
            if not keep[k]:
                assignment[k] = free[new_node[k]].pop(0)
        return 0.0, assignment
    shared = set().union(*old_node) & set().union(*new_node) if g else set()
    if not shared:                                      # every permutation costs the same
        total = sum(units[j] for s in old_node for j in s) + sum(units[j] for s in new_node for j in s)
        return float(total), identity
    block = _node_block(old_node, new_node, units)
    cols = _assign(block)
    return float(block[np.arange(g), cols].sum()), [int(c) for c in cols]


def node_cost(old_node: Sequence[Collection[int]], new_node: Sequence[Collection[int]],
              gpus_of: Mapping[int, int]) -> tuple[float, list[int]]:
    """Algorithm 3: the least cost of running new node ``new_node`` where ``old_node`` ran, and
    the GPU permutation reaching it (``assignment[k]`` = the old GPU that new GPU ``k`` takes).

    Every job counts here; ``plan_migration`` passes only jobs present in both rounds."""
    if len(old_node) != len(new_node):
        raise ValueError(f"old node has {len(old_node)} GPUs, new node {len(new_node)}")
    o = [frozenset(s) for s in old_node]
    n = [frozenset(s) for s in new_node]
    units = _units(set().union(*o, *n), gpus_of)
    return _node_pair(o, n, units)


# ---- Algorithm 2 --------------------------------------------------------------------------------

def _common_match(old_node: Sequence[frozenset[int]], new_node: Sequence[frozenset[int]],
                  common: Collection[int], units: Mapping[int, float],
                  cache: dict) -> float:
    """Heaviest GPU matching of the jobs two nodes share (``M[i, j]`` in the module docstring)."""
    o = [s & common for s in old_node]
    n = [s & common for s in new_node]
    if all(len(s) <= 1 for s in o) and all(len(s) <= 1 for s in n):
        # each shared job is a separate complete block: min(GPUs before, GPUs after) of it match
        count_o = Counter(j for s in o for j in s)
        count_n = Counter(j for s in n for j in s)
        return sum(units[j] * min(count_o[j], count_n[j]) for j in common)
    if Counter(o) == Counter(n):
        return sum(units[j] for s in n for j in s)
    key = (tuple(sorted(tuple(sorted(s)) for s in o)), tuple(sorted(tuple(sorted(s)) for s in n)))
    if key not in cache:
        from scipy.optimize import linear_sum_assignment     # scipy is slow to import
        overlap = np.array([[sum(units[j] for j in b & a) for a in o] for b in n])
        rows, cols = linear_sum_assignment(overlap, maximize=True)
        cache[key] = float(overlap[rows, cols].sum())
    return cache[key]


def _renamed(new: Frozen, gpu_map: list[list[tuple[int, int]]], nodes: int, per_node: int) -> Frozen:
    out: Frozen = [[frozenset() for _ in range(per_node)] for _ in range(nodes)]
    for j, node in enumerate(new):
        for k, jobs in enumerate(node):
            n, g = gpu_map[j][k]
            out[n][g] = jobs
    return out


def _result(old: Frozen, new: Frozen, both: set[int], gpu_map: list[list[tuple[int, int]]],
            cost: float, nodes: int, per_node: int) -> MigrationPlan:
    plan = _renamed(new, gpu_map, nodes, per_node)
    before, after, naive = gpu_sets(old), gpu_sets(plan), gpu_sets(new)
    node_of = []
    for row in gpu_map:
        physical = {n for n, _ in row}
        node_of.append(physical.pop() if len(physical) == 1 else -1)
    if per_node == 0:
        node_of = list(range(nodes))
    return MigrationPlan(
        node_of=node_of,
        gpu_of=[[g for _, g in row] for row in gpu_map],
        plan=plan,
        migrated=_moved(before, after, both),
        cost=cost,
        naive=_moved(before, naive, both),
        gpu_map=gpu_map,
    )


def plan_migration(old: Plan, new: Plan, gpus_of: Mapping[int, int], *,
                   never_worse: bool = True) -> MigrationPlan:
    """Algorithm 2: rename ``new`` onto the physical nodes and GPUs of ``old`` so that the fewest
    jobs present in both rounds move (node renaming first, then GPUs within each node).

    ``gpus_of[job]`` is the GPU count of each job present in both rounds (others may be missing).
    Both plans must have the same shape (nodes x GPUs per node), else ValueError.

    The Hungarian objective amortises a job's cost over its GPUs, so moving one GPU of each of
    two multi-GPU jobs can cost less than moving a whole 1-GPU job, and the cheapest renaming
    can then migrate more jobs than no renaming at all (e.g. one node, old
    ``[{1}, {2, 3}, {1, 3}, {3}]``, new ``[{1, 2}, {3}, {1, 3}, {3}]``, jobs of 2, 1 and 3 GPUs:
    cost 5/6 moving jobs 1 and 3, against cost 1 moving job 2 alone). With ``never_worse``
    (the default) the new plan is then applied as it is (Gavel's naming) and ``cost`` is that
    naming's objective; ``never_worse=False`` is the paper's Algorithm 2 exactly."""
    nodes, per_node = _shape(old, new)
    o, n = _freeze(old), _freeze(new)
    both = _jobs(o) & _jobs(n)
    units = _units(both, gpus_of)
    ro = [[s & both for s in node] for node in o]            # line 2: jobs in both rounds only
    rn = [[s & both for s in node] for node in n]

    w_old = np.array([sum(units[j] for s in node for j in s) for node in ro]) if nodes else np.zeros(0)
    w_new = np.array([sum(units[j] for s in node for j in s) for node in rn]) if nodes else np.zeros(0)
    jobs_old = [set().union(*node) for node in ro]
    jobs_new = [set().union(*node) for node in rn]
    nodes_old: dict[int, set[int]] = {}
    nodes_new: dict[int, set[int]] = {}
    for i, jobs in enumerate(jobs_old):
        for job in jobs:
            nodes_old.setdefault(job, set()).add(i)
    for j, jobs in enumerate(jobs_new):
        for job in jobs:
            nodes_new.setdefault(job, set()).add(j)
    pairs = {(j, i) for job in both for i in nodes_old[job] for j in nodes_new[job]}

    match = np.zeros((nodes, nodes))                         # [new j, old i]
    cache: dict = {}
    for j, i in pairs:
        common = jobs_old[i] & jobs_new[j]
        match[j, i] = _common_match(ro[i], rn[j], common, units, cache)
    cost = w_new[:, None] + w_old[None, :] - 2.0 * match    # lines 3-5: node-pair costs
    node_of = _assign(cost)                                  # lines 6-7

    gpu_map = []
    for j in range(nodes):
        i = int(node_of[j])
        _, assignment = _node_pair(ro[i], rn[j], units)
        gpu_map.append([(i, a) for a in assignment])
    total = float(cost[np.arange(nodes), node_of].sum()) if nodes else 0.0
    result = _result(o, n, both, gpu_map, total, nodes, per_node)
    if never_worse and len(result.migrated) > len(result.naive):
        identity = [[(j, k) for k in range(per_node)] for j in range(nodes)]
        before, after = gpu_sets(o), gpu_sets(n)
        kept = sum(units[job] * len(before[job] ^ after[job]) for job in sorted(both))
        result = _result(o, n, both, identity, float(kept), nodes, per_node)
    return result


# ---- Appendix B ---------------------------------------------------------------------------------

def gpu_level_only(old: Plan, new: Plan, gpus_of: Mapping[int, int]) -> MigrationPlan:
    """Algorithm 5 (Appendix B): one Hungarian over every GPU of the cluster, nodes ignored.
    Cheaper to state, but with packing it may split a consolidated job across nodes."""
    nodes, per_node = _shape(old, new)
    o, n = _freeze(old), _freeze(new)
    both = _jobs(o) & _jobs(n)
    units = _units(both, gpus_of)
    flat_o = [s & both for node in o for s in node]
    flat_n = [s & both for node in n for s in node]
    block = _node_block(flat_o, flat_n, units)               # [new gpu, old gpu] over the cluster
    cols = _assign(block)
    total = float(block[np.arange(len(cols)), cols].sum()) if len(cols) else 0.0
    gpu_map = [[divmod(int(cols[j * per_node + k]), per_node) for k in range(per_node)]
               for j in range(nodes)]
    return _result(o, n, both, gpu_map, total, nodes, per_node)
