"""Optimus' resource-to-speed models (paper §3.2): eq. (3) (async) and eq. (4) (sync), fitted by NNLS.

``p`` is the number of aggregators (parameter servers), ``w`` the number of workers, a speed is in
training steps per second. Synchronous: ``f = 1 / (t0*M/w + t1 + t2*w/p + t3*w + t4*p)`` with
``M`` the global batch; asynchronous: ``f = w / (t0 + t1*w/p + t2*w + t3*p)``. Both are linear in
theta once inverted (``1/f`` for sync, ``w/f`` for async), which ``scipy.optimize.nnls`` solves
with theta >= 0. Rows are divided by their target, so the fit minimises the relative error of the
step time (to first order, that of the speed), the measure the paper's Fig. 8 reports.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SpeedModel:
    """A fitted eq. (4) (``sync``, five thetas) or eq. (3) (async, four thetas); ``batch`` is
    ``M`` of eq. (4) (None: 1, theta0 then holds the whole per-batch compute time)."""
    sync: bool
    theta: tuple[float, ...]
    batch: float | None = None

    def step_time(self, p: int, w: int) -> float:
        """Seconds per training step at ``p`` aggregators and ``w`` workers (inf when either is 0)."""
        if p <= 0 or w <= 0:
            return math.inf
        t = self.theta
        if self.sync:
            m = 1.0 if self.batch is None else self.batch
            return t[0] * m / w + t[1] + t[2] * w / p + t[3] * w + t[4] * p
        return (t[0] + t[1] * w / p + t[2] * w + t[3] * p) / w

    def speed(self, p: int, w: int) -> float:
        """Training steps per second at ``p`` aggregators and ``w`` workers (0 when either is 0)."""
        if p <= 0 or w <= 0:
            return 0.0
        t = self.theta
        if self.sync:
            m = 1.0 if self.batch is None else self.batch
            den = t[0] * m / w + t[1] + t[2] * w / p + t[3] * w + t[4] * p
            return math.inf if den <= 0 else 1.0 / den
        den = t[0] + t[1] * w / p + t[2] * w + t[3] * p
        return math.inf if den <= 0 else w / den


def _features(p: float, w: float, sync: bool, batch: float) -> list[float]:
    if sync:
        return [batch / w, 1.0, w / p, w, p]
    return [1.0, w / p, w, p]


def fit_speed(samples: Sequence[tuple[int, int, float]], sync: bool = True,
              batch: float | None = None) -> SpeedModel:
    """Eq. (4) (``sync``) or eq. (3) fitted on ``(p, w, steps per second)`` samples, theta >= 0."""
    if not samples:
        raise ValueError("fit_speed needs at least one (p, w, speed) sample, got none")
    m = 1.0 if batch is None else float(batch)
    rows, targets = [], []
    for p, w, f in samples:
        if p < 1 or w < 1:
            raise ValueError(f"sample (p={p}, w={w}, f={f}): p and w must be at least 1")
        if not (math.isfinite(f) and f > 0):
            raise ValueError(f"sample (p={p}, w={w}, f={f}): the speed must be positive and finite")
        rows.append(_features(float(p), float(w), sync, m))
        targets.append(1.0 / f if sync else w / f)
    a = np.asarray(rows, dtype=float)
    b = np.asarray(targets, dtype=float)
    from scipy.optimize import nnls      # scipy is slow to import; most commands never fit

    theta, _ = nnls(a / b[:, None], np.ones_like(b))
    return SpeedModel(sync, tuple(float(x) for x in theta), batch)


def profile_configs(max_p: int, max_w: int, count: int = 5, seed: int = 0) -> list[tuple[int, int]]:
    """``count`` distinct ``(p, w)`` for the short pre-run profiles, spread over [1, max_p] x [1, max_w].

    Always (1, 1) and one at ``w = max_w`` (with a seeded ``p``); the rest a Latin-hypercube draw
    (one ``w`` per equal slice of the ``w`` range, the ``p`` slices shuffled), topped up by
    seeded draws when two coincide. Every cell of the grid when it has no more than ``count``.
    """
    if max_p < 1 or max_w < 1:
        raise ValueError(f"max_p and max_w must be at least 1, got {max_p}, {max_w}")
    if count < 1:
        return []
    cells = max_p * max_w
    if cells <= count:
        return [(p, w) for w in range(1, max_w + 1) for p in range(1, max_p + 1)]
    rng = random.Random(seed)
    chosen: list[tuple[int, int]] = [(1, 1)]
    if count > 1:
        top = (rng.randint(1, max_p), max_w)
        if top not in chosen:
            chosen.append(top)
    rest = count - len(chosen)
    p_slices = list(range(rest))
    rng.shuffle(p_slices)
    for i in range(rest):
        w = 1 + int((i + rng.random()) * max_w / rest)
        p = 1 + int((p_slices[i] + rng.random()) * max_p / rest)
        cell = (min(p, max_p), min(w, max_w))
        if cell not in chosen:
            chosen.append(cell)
    while len(chosen) < count:
        cell = (rng.randint(1, max_p), rng.randint(1, max_w))
        if cell not in chosen:
            chosen.append(cell)
    return chosen
