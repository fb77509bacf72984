"""The allocators Optimus is compared with (paper §6.1): DRF and Tetris, over the same ``AllocJob``.

Both hand out *bundles* with a fixed ratio of workers to aggregators, as the paper sets them
(1:1): a job with ``w`` workers has ``min(ceil(w / ratio), max_aggregators)`` aggregators. A job's
first grant is its ``min_workers`` workers (with their aggregators), each later one a single worker
(with the aggregator it brings, if any), up to ``max_workers``. Both are work-conserving: they
stop only when no job's next grant fits the remaining capacity (or every job is at its maximum),
whatever the jobs' speed models say.

- DRF (progressive filling): the next grant goes to the job with the smallest dominant share
  (ties by job id). Shares only grow, so a heap keyed ``(share, job_id)`` is exact.
- Tetris: each grant goes to the job with the highest score
  ``a_j / mean(a) - W_j / mean(W)`` over the jobs whose next grant fits, where
  ``a_j = sum_r (g_jr / C_r) * (F_r / C_r)`` is Tetris' alignment of the grant ``g_j`` with the
  free capacity ``F`` (a grant that uses what is plentiful leaves less fragmentation) and
  ``W_j = (Q_j / f(p_j, w_j)) * s_j`` is the job's remaining work, its remaining time at its
  current size (at its first grant's size before it has one) times the dominant share it holds
  after the grant: small, nearly done jobs first, as in Tetris' SRTF term. Both terms are divided
  by their mean over the candidates, which is Tetris' own way of making them commensurate (its
  ``epsilon`` = mean alignment / mean remaining work, with the multiplier ``m`` = 1). Jobs with an
  unknown remaining time (no speed) come after every other. The score depends on the free
  capacity, so every candidate is rescored (vectorised) after each grant.
"""
from __future__ import annotations

import heapq
import math
from typing import Mapping, Sequence

import numpy as np

from tiresias.optimus.allocation import AllocJob, check_demands, dominant_share, fits, remaining_time, take


def _aggregators(workers: int, job: AllocJob, ratio: float) -> int:
    return min(math.ceil(workers / ratio), job.max_aggregators) if workers > 0 else 0


def _next_workers(job: AllocJob, workers: int) -> int | None:
    """Workers after the job's next grant; None when it is at its maximum."""
    nxt = max(1, min(job.min_workers, job.max_workers)) if workers == 0 else workers + 1
    return nxt if nxt <= job.max_workers else None


def _grant(job: AllocJob, w: int, p: int, w2: int, p2: int) -> dict[str, float]:
    use: dict[str, float] = {}
    for r, v in job.demand.workers.items():
        use[r] = use.get(r, 0.0) + v * (w2 - w)
    for r, v in job.demand.aggregators.items():
        use[r] = use.get(r, 0.0) + v * (p2 - p)
    return use


def _held(job: AllocJob, w: int, p: int) -> dict[str, float]:
    return _grant(job, 0, 0, w, p)


def _check_ratio(ratio: float) -> None:
    if not ratio > 0:
        raise ValueError(f"ratio (workers per aggregator) must be positive, got {ratio}")


def allocate_drf(jobs: Sequence[AllocJob], capacity: Mapping[str, float],
                 ratio: float = 1) -> dict[int, tuple[int, int]]:
    """job id -> (workers, aggregators) by DRF progressive filling of worker bundles."""
    _check_ratio(ratio)
    check_demands(jobs, capacity)
    free = {r: float(v) for r, v in capacity.items()}
    size = {job.job_id: (0, 0) for job in jobs}
    by_id = {job.job_id: job for job in jobs}
    heap = [(0.0, job.job_id) for job in jobs]
    heapq.heapify(heap)
    while heap:
        _, job_id = heapq.heappop(heap)
        job = by_id[job_id]
        w, p = size[job_id]
        w2 = _next_workers(job, w)
        if w2 is None:
            continue
        p2 = _aggregators(w2, job, ratio)
        grant = _grant(job, w, p, w2, p2)
        if not fits(grant, free):
            continue                      # capacity only shrinks: this grant never fits again
        take(grant, free)
        size[job_id] = (w2, p2)
        heapq.heappush(heap, (dominant_share(_held(job, w2, p2), capacity), job_id))
    return size


def allocate_tetris(jobs: Sequence[AllocJob], capacity: Mapping[str, float],
                    ratio: float = 1) -> dict[int, tuple[int, int]]:
    """job id -> (workers, aggregators) by Tetris' alignment + remaining-work score (module doc)."""
    _check_ratio(ratio)
    check_demands(jobs, capacity)
    kinds = sorted(capacity)
    cap = np.array([float(capacity[r]) for r in kinds])
    free = cap.copy()
    order = sorted(jobs, key=lambda j: j.job_id)
    n = len(order)
    size = [(0, 0)] * n
    grants = np.zeros((n, len(kinds)))
    work = np.full(n, math.inf)
    alive = np.ones(n, dtype=bool)

    def refresh(i: int) -> None:
        job = order[i]
        w, p = size[i]
        w2 = _next_workers(job, w)
        if w2 is None:
            alive[i] = False
            return
        p2 = _aggregators(w2, job, ratio)
        g = _grant(job, w, p, w2, p2)
        grants[i] = [g.get(r, 0.0) for r in kinds]
        at = (w, p) if w > 0 else (w2, p2)
        t = remaining_time(job.remaining, job.speed(at[1], at[0]))
        work[i] = t * dominant_share(_held(job, w2, p2), capacity)

    for i in range(n):
        refresh(i)
    while True:
        candidates = alive & np.all(grants <= free + 1e-9, axis=1)
        if not candidates.any():
            break
        idx = np.flatnonzero(candidates)
        align = (grants[idx] / cap) @ (free / cap)
        w_c = work[idx]
        finite = np.isfinite(w_c)
        score = np.full(len(idx), -np.inf)
        if finite.any():
            mean_a = align[finite].mean()
            mean_w = w_c[finite].mean()
            score[finite] = (align[finite] / mean_a if mean_a > 0 else 0.0) - \
                (w_c[finite] / mean_w if mean_w > 0 else 0.0)
        i = int(idx[int(np.argmax(score))])
        free -= grants[i]
        job = order[i]
        w2 = _next_workers(job, size[i][0])
        size[i] = (w2, _aggregators(w2, job, ratio))
        refresh(i)
    return {job.job_id: size[i] for i, job in enumerate(order)}
