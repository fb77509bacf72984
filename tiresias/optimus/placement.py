"""Optimus' task placement (paper §4.2, Theorem 1): where each job's workers and aggregators go.

Jobs are placed smallest first (total dominant share of the cluster, then id). Nodes are kept
sorted by availability, descending (ties by index); a job goes on the first ``k`` nodes, for the
smallest ``k`` whose nodes can hold it with its workers and its aggregators spread as evenly as
possible (counts differing by at most one; first with the larger counts of both on the most
available nodes, so that extra workers and extra aggregators share nodes, then, if that does not
fit, with the aggregators' larger counts on the last nodes instead). After each job the nodes it used
are re-sorted. A job that fits nowhere is left out (paused until the next interval).

Availability of a node is the sum over resource types of its free amount divided by the largest
free amount of that type on any node at the start (each term in [0, 1]; one resource type is the
paper's "available CPU capacity"). ``transfer_time`` is the Fig. 10 / Appendix cost of a
placement: the slowest cross-node exchange of any aggregator or worker in a synchronous step.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from sortedcontainers import SortedList

from tiresias.optimus.allocation import Demand, dominant_share, fits, take


def node_availability(free: Mapping[str, float], scale: Mapping[str, float]) -> float:
    """Sum over resources of ``free[r] / scale[r]`` (resources with no scale ignored)."""
    return sum(free.get(r, 0.0) / s for r, s in scale.items() if s > 0)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts differing by at most one, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def _arrangements(w: int, p: int, k: int) -> list[tuple[list[int], list[int]]]:
    """Even splits of ``w`` workers and ``p`` aggregators over ``k`` nodes, best first: the extra
    worker and the extra aggregator on the same (most available) nodes, which keeps the most
    exchanges on-node (only while no node is left empty); then the aggregators' extras on the
    last nodes, which spreads the load."""
    workers = even_split(w, k)
    aligned = even_split(p, k)
    out = [(workers, aligned)] if k <= max(w, p, 1) else []
    if w % k and p % k:
        out.append((workers, aligned[::-1]))
    return out


def _holds(node: Mapping[str, float], per_worker: tuple[tuple[str, float], ...],
           per_aggregator: tuple[tuple[str, float], ...], workers: int, aggregators: int) -> bool:
    """Whether ``node`` has room for ``workers`` workers and ``aggregators`` aggregators."""
    for (r, dw), (_, da) in zip(per_worker, per_aggregator):
        if dw * workers + da * aggregators > node.get(r, 0.0) + 1e-9:
            return False
    return True


def _node_use(d: Demand, workers: int, aggregators: int) -> dict[str, float]:
    use: dict[str, float] = {}
    for r, v in d.workers.items():
        use[r] = use.get(r, 0.0) + v * workers
    for r, v in d.aggregators.items():
        use[r] = use.get(r, 0.0) + v * aggregators
    return use


def place_jobs(alloc: Mapping[int, tuple[int, int]], demand: Mapping[int, Demand],
               free: Sequence[Mapping[str, float]]) -> dict[int, list[tuple[int, int, int]]]:
    """job id -> [(node index, workers, aggregators)] for every job of ``alloc`` that fits;
    jobs allocated (0, 0) and jobs that fit nowhere are absent. ``free`` is not modified."""
    nodes = [dict(n) for n in free]
    kinds = sorted({r for n in nodes for r in n})
    scale = {r: max(n.get(r, 0.0) for n in nodes) for r in kinds}
    left = {r: sum(n.get(r, 0.0) for n in nodes) for r in kinds}
    total = dict(left)

    def size(job_id: int) -> float:
        w, p = alloc[job_id]
        d = demand[job_id]
        return w * dominant_share(d.workers, total) + p * dominant_share(d.aggregators, total)

    order = sorted((j for j, (w, p) in alloc.items() if w + p > 0), key=lambda j: (size(j), j))
    ranked = SortedList((-node_availability(n, scale), i) for i, n in enumerate(nodes))
    out: dict[int, list[tuple[int, int, int]]] = {}
    for job_id in order:
        w, p = alloc[job_id]
        d = demand[job_id]
        need = _node_use(d, w, p)
        per_worker = tuple((r, d.workers.get(r, 0.0)) for r in need)
        per_aggregator = tuple((r, d.aggregators.get(r, 0.0)) for r in need)
        if not fits(need, left):
            continue
        k_min = max([1] + [math.ceil(v / scale[r] - 1e-9) for r, v in need.items()
                           if v > 0 and scale.get(r, 0.0) > 0])
        k_max = min(w + p, len(nodes))
        head: list[int] = [i for _, i in ranked.islice(0, k_min - 1)] if k_min > 1 else []
        head_free = {r: sum(nodes[i].get(r, 0.0) for i in head) for r in need}
        chosen = None
        for k in range(k_min, k_max + 1):
            node = ranked[k - 1][1]
            head.append(node)
            for r in need:
                head_free[r] += nodes[node].get(r, 0.0)
            if not fits(need, head_free):
                continue
            for split_w, split_p in _arrangements(w, p, k):
                shares = list(zip(head, split_w, split_p))
                if all(_holds(nodes[i], per_worker, per_aggregator, nw, np_) for i, nw, np_ in shares):
                    chosen = shares
                    break
            if chosen is not None:
                break
        if chosen is None:
            continue
        out[job_id] = [(i, nw, np_) for i, nw, np_ in chosen if nw + np_ > 0]
        for i, nw, np_ in chosen:
            ranked.remove((-node_availability(nodes[i], scale), i))
            take(_node_use(d, nw, np_), nodes[i])
            ranked.add((-node_availability(nodes[i], scale), i))
        take(need, left)
    return out


def transfer_time(placement: Sequence[tuple[int, int, int]], bandwidth: float = 1.0,
                  unit: float = 1.0) -> float:
    """Data-transfer time of one synchronous step of a job placed as ``(node, workers,
    aggregators)``: each aggregator exchanges ``unit`` with each worker on another node and each
    worker with each aggregator on another node; the slowest endpoint over ``bandwidth``."""
    per_node: dict[int, list[int]] = {}
    for node, w, p in placement:
        counts = per_node.setdefault(node, [0, 0])
        counts[0] += w
        counts[1] += p
    workers = sum(c[0] for c in per_node.values())
    aggregators = sum(c[1] for c in per_node.values())
    slowest = 0
    for w, p in per_node.values():
        if p > 0:
            slowest = max(slowest, workers - w)
        if w > 0:
            slowest = max(slowest, aggregators - p)
    return slowest * unit / bandwidth
