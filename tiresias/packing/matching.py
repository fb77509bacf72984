"""Who shares GPUs with whom: Tesserae's maximum-weight matching (Algorithm 4) and Gavel's
greedy rule, over plain data.

A round has *placed* jobs (given GPUs of their own, in priority order, while GPUs lasted) and
*pending* jobs (left without). Packing puts a pending job on the GPUs of a placed job, at most
two jobs per GPU. The candidates form a bipartite graph placed x pending with an edge only
between jobs of the same GPU count, weighted by the pair's summed normalised throughput when
they share (each job's speed relative to running alone, from the profile store). There is no
edge when either job must not share (``may_share`` false: high priority, ``--no-share`` at
submit), when the pair does not fit in GPU memory (the tables' 0.0 rows), when the profile
knows nothing of the pair, or when the shared speeds sum to no more than 1 (running the
placed job alone does as well). Tesserae takes the maximum-weight matching of that graph
(``scipy.optimize.linear_sum_assignment``, the Hungarian algorithm the paper uses), solved for
each GPU count apart since edges never cross counts. Gavel's greedy rule, the baseline the
paper beats, walks the pending jobs in priority order and gives each the free placed partner
of its GPU count with the highest summed throughput.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

Speeds = Callable[[Hashable, Hashable], "tuple[float, float] | None"]   # by profile key


@dataclass(frozen=True)
class Candidate:
    """A job as packing sees it: its id, GPU count, profile key and whether it may share."""
    job_id: int
    gpus: int
    kind: Hashable = None          # the profile store's key (model, batch size, GPUs)
    may_share: bool = True


@dataclass(frozen=True)
class Pair:
    """A pending job packed onto a placed job's GPUs, with both jobs' normalised speeds."""
    placed: int
    pending: int
    placed_speed: float
    pending_speed: float

    @property
    def weight(self) -> float:
        return self.placed_speed + self.pending_speed


def edge(a: Candidate, b: Candidate, speeds: Speeds) -> tuple[float, float] | None:
    """The speeds of ``a`` and ``b`` sharing their GPUs, or None when they must not share."""
    if a.gpus != b.gpus or not (a.may_share and b.may_share) or a.job_id == b.job_id:
        return None
    return _gain(speeds(a.kind, b.kind))


def _gain(pair: tuple[float, float] | None) -> tuple[float, float] | None:
    if pair is None:
        return None
    sa, sb = pair
    if sa <= 0.0 or sb <= 0.0 or sa + sb <= 1.0:
        return None
    return sa, sb


def pack(placed: Sequence[Candidate], pending: Sequence[Candidate], speeds: Speeds) -> list[Pair]:
    """Tesserae's packing: the maximum-weight matching of placed x pending (see the module
    docstring); pairs sorted by placed job id."""
    pairs: list[Pair] = []
    for gpus in sorted({c.gpus for c in placed} & {c.gpus for c in pending}):
        left = [c for c in placed if c.gpus == gpus and c.may_share]
        right = [c for c in pending if c.gpus == gpus and c.may_share]
        if not left or not right:
            continue
        # speeds depend on the profile keys only: one lookup per pair of kinds, then the
        # job x job weights by indexing (hundreds of pending jobs, tens of kinds)
        kinds_l = sorted({c.kind for c in left}, key=repr)
        kinds_r = sorted({c.kind for c in right}, key=repr)
        at_l = {k: i for i, k in enumerate(kinds_l)}
        at_r = {k: i for i, k in enumerate(kinds_r)}
        by_kind = np.zeros((len(kinds_l), len(kinds_r), 2))
        for i, ka in enumerate(kinds_l):
            for j, kb in enumerate(kinds_r):
                e = _gain(speeds(ka, kb))
                if e is not None:
                    by_kind[i, j] = e
        cells = by_kind[np.array([at_l[c.kind] for c in left])[:, None],
                        np.array([at_r[c.kind] for c in right])[None, :]]
        weight = cells.sum(axis=2)
        if not weight.any():
            continue
        from scipy.optimize import linear_sum_assignment     # scipy is slow to import
        rows, cols = linear_sum_assignment(weight, maximize=True)
        for i, j in zip(rows.tolist(), cols.tolist()):
            if weight[i, j] > 0.0:           # a zero-weight cell of the assignment: no edge
                pairs.append(Pair(left[i].job_id, right[j].job_id, float(cells[i, j, 0]),
                                  float(cells[i, j, 1])))
    pairs.sort(key=lambda p: p.placed)
    return pairs


def pack_greedy(placed: Sequence[Candidate], pending: Sequence[Candidate], speeds: Speeds) -> list[Pair]:
    """Gavel's greedy rule: each pending job, in the given (priority) order, takes the unpaired
    placed job of its GPU count with the highest summed throughput (ties: the earlier placed)."""
    free = list(placed)
    pairs: list[Pair] = []
    cache: dict[tuple, tuple[float, float] | None] = {}

    def cached(ka: Hashable, kb: Hashable) -> tuple[float, float] | None:
        if (ka, kb) not in cache:
            cache[ka, kb] = speeds(ka, kb)
        return cache[ka, kb]

    for b in pending:
        best, best_e, best_i = None, None, -1
        for i, a in enumerate(free):
            e = edge(a, b, cached)
            if e is not None and (best_e is None or e[0] + e[1] > best_e[0] + best_e[1]):
                best, best_e, best_i = a, e, i
        if best is not None and best_e is not None:
            pairs.append(Pair(best.job_id, b.job_id, best_e[0], best_e[1]))
            del free[best_i]
    pairs.sort(key=lambda p: p.placed)
    return pairs


def total_weight(pairs: Sequence[Pair]) -> float:
    return sum(p.weight for p in pairs)
