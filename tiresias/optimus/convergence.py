"""Optimus' convergence model (paper §3.1): clean a job's loss points and fit eq. (1).

The model is ``l = 1 / (beta0 * k + beta1) + beta2`` with every beta >= 0, fitted online on the
loss points ``(k, loss)`` a job has reported so far, after outlier replacement and normalisation
by the largest loss seen. ``beta2`` (the loss the curve tends to) is found by a 1-D search; for a
fixed ``beta2`` the curve is linear in ``1 / (l - beta2) = beta0 * k + beta1``, which
``scipy.optimize.nnls`` solves with rows weighted by ``(l - beta2) ** 2`` (the derivative of
``l`` in ``1 / (l - beta2)``), so that the fit is judged on the loss, not on its reciprocal. The
search keeps the ``beta2`` whose curve has the least squared loss error.

When a job has converged (``ConvergenceFit.converged_step``) depends on the *target* of its total
improvement, named by ``target``:

- ``TARGET_LIMIT`` (``"limit"``, the default, the issue's definition): from the first loss to the
  fitted limit ``beta2``;
- ``TARGET_CAP`` (``"cap"``): from the first loss to the fitted loss at the job's epoch cap
  ``cap_step``, i.e. the improvement the job can still make before it is stopped anyway.

Eq. (1) approaches its limit like ``1/k``, far slower than measured curves flatten, so "within
``delta`` of the limit" lies several times too late on them even when ``beta2`` equals the curve's
true best (bench/optimus_models.py); the ``"cap"`` target reads the fit only inside the job's own
horizon. ``remaining_steps`` stops at ``cap_step`` under either target.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

TARGET_LIMIT = "limit"    # total improvement: first loss -> the fitted limit beta2
TARGET_CAP = "cap"        # total improvement: first loss -> the fitted loss at the epoch cap
TARGETS = (TARGET_LIMIT, TARGET_CAP)
GRID = 40                 # beta2 candidates on [0, min loss) before the bounded refinement
TOP = 1.0 - 1e-9          # beta2 stays strictly below the smallest (normalised) loss


def _epochs(steps: Sequence[float], steps_per_epoch: float | None) -> list[float]:
    if steps_per_epoch is None:
        return [float(i) for i in range(len(steps))]
    if steps_per_epoch <= 0:
        raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
    return [math.floor(k / steps_per_epoch) for k in steps]


def clean_losses(points: Sequence[tuple[float, float]], steps_per_epoch: float | None = None,
                 window: int = 5) -> list[tuple[float, float]]:
    """The points sorted by step, each outlier replaced by the average of its two neighbours.

    A point is an outlier when its loss lies outside [min loss of the next ``window`` epochs, max
    loss of the previous ``window`` epochs]; a bound with no epoch on its side is not checked.
    With ``steps_per_epoch`` None each point is its own epoch. Neighbours are the raw adjacent
    points (one at either end).
    """
    pts = sorted((float(k), float(v)) for k, v in points)
    n = len(pts)
    if n < 3 or window < 1:
        return pts
    steps = [k for k, _ in pts]
    losses = [v for _, v in pts]
    epochs = _epochs(steps, steps_per_epoch)
    # one min and one max per distinct epoch, in order
    keys: list[float] = []
    lows: list[float] = []
    highs: list[float] = []
    for e, v in zip(epochs, losses):
        if keys and keys[-1] == e:
            lows[-1] = min(lows[-1], v)
            highs[-1] = max(highs[-1], v)
        else:
            keys.append(e)
            lows.append(v)
            highs.append(v)
    out = []
    for i, (k, v) in enumerate(pts):
        e = epochs[i]
        after = slice(bisect.bisect_right(keys, e), bisect.bisect_right(keys, e + window))
        before = slice(bisect.bisect_left(keys, e - window), bisect.bisect_left(keys, e))
        lo = min(lows[after], default=-math.inf)
        hi = max(highs[before], default=math.inf)
        if lo <= v <= hi:
            out.append((k, v))
            continue
        near = [losses[j] for j in (i - 1, i + 1) if 0 <= j < n]
        out.append((k, sum(near) / len(near)))
    return out


@dataclass(frozen=True)
class ConvergenceFit:
    """Eq. (1) fitted on normalised losses (raw loss / ``scale``)."""
    beta0: float
    beta1: float
    beta2: float
    scale: float          # the largest raw loss, used to normalise
    first_step: float
    first_loss: float     # the first (cleaned) loss, normalised
    points: int

    def loss(self, k: float) -> float:
        """Normalised loss the fit predicts at step ``k`` (``inf`` where the curve has no value)."""
        den = self.beta0 * k + self.beta1
        return math.inf if den <= 0 else 1.0 / den + self.beta2

    def raw_loss(self, k: float) -> float:
        return self.scale * self.loss(k)

    def step_at_loss(self, y: float) -> float:
        """The first step (from ``first_step`` on) where the fitted normalised loss is at most
        ``y``; ``math.inf`` if the curve never gets there."""
        if self.loss(self.first_step) <= y:
            return self.first_step
        if y <= self.beta2 or self.beta0 <= 0:
            return math.inf
        return max(self.first_step, (1.0 / (y - self.beta2) - self.beta1) / self.beta0)

    def target_loss(self, target: str = TARGET_LIMIT, cap_step: float | None = None) -> float:
        """The normalised loss the total improvement runs to: ``beta2`` for ``"limit"``, the
        fitted loss at ``cap_step`` for ``"cap"`` (which needs ``cap_step``)."""
        if target == TARGET_LIMIT:
            return self.beta2
        if target == TARGET_CAP:
            if cap_step is None:
                raise ValueError("target 'cap' needs cap_step (the step of the epoch cap)")
            return self.loss(cap_step)
        raise ValueError(f"target must be one of {TARGETS}, not {target!r}")

    def converged_step(self, delta: float = 0.05, *, target: str = TARGET_LIMIT,
                       cap_step: float | None = None) -> float:
        """The first step (from ``first_step`` on) where the loss is within ``delta`` of the total
        improvement from ``first_loss`` to ``target_loss(target, cap_step)``; ``math.inf`` if
        never (no improvement to make, or a flat fit)."""
        end = self.target_loss(target, cap_step)
        gap = delta * (self.first_loss - end)
        if not gap > 0:
            return math.inf
        return self.step_at_loss(end + gap)

    def remaining_steps(self, k_now: float, delta: float = 0.05, cap_step: float | None = None, *,
                        target: str = TARGET_LIMIT) -> float:
        """Steps still to run from ``k_now``: ``max(0, min(converged, cap_step) - k_now)``."""
        end = self.converged_step(delta, target=target, cap_step=cap_step)
        if cap_step is not None:
            end = min(end, cap_step)
        return max(0.0, end - k_now)


def _fit_line(k: np.ndarray, y: np.ndarray, beta2: float) -> tuple[float, float, float]:
    """(beta0, beta1, squared loss error) of the weighted linearised fit at ``beta2``."""
    from scipy.optimize import nnls      # scipy is slow to import; most commands never fit

    gap = y - beta2
    weight = gap * gap
    design = np.column_stack((k * weight, weight))
    (b0, b1), _ = nnls(design, gap)          # weight * (1 / gap) = gap
    den = b0 * k + b1
    if np.any(den <= 0):
        return b0, b1, math.inf
    err = 1.0 / den + beta2 - y
    return b0, b1, float(err @ err)


def fit_convergence(points: Sequence[tuple[float, float]],
                    steps_per_epoch: float | None = None) -> ConvergenceFit | None:
    """Eq. (1) fitted on ``points`` = ``(k, loss)``; None with fewer than 3 points or no positive loss."""
    if len(points) < 3:
        return None
    cleaned = clean_losses(points, steps_per_epoch)
    scale = max(float(v) for _, v in points)
    if not math.isfinite(scale) or scale <= 0:
        return None
    k = np.array([p[0] for p in cleaned], dtype=float)
    y = np.array([p[1] for p in cleaned], dtype=float) / scale
    if not np.all(np.isfinite(y)):
        return None
    y = np.maximum(y, 0.0)
    floor = float(y.min())
    first = (float(k[0]), float(y[0]))
    if floor <= 0:                                # a loss of zero: the limit is zero
        b0, b1, _ = _fit_line(k, y + 1e-12, 0.0)
        return ConvergenceFit(b0, b1, 0.0, scale, first[0], first[1], len(cleaned))
    top = floor * TOP
    grid = np.linspace(0.0, top, GRID)
    errors = [_fit_line(k, y, b2)[2] for b2 in grid]
    best = int(np.argmin(errors))
    beta2 = float(grid[best])
    lo, hi = grid[max(0, best - 1)], grid[min(GRID - 1, best + 1)]
    if hi > lo:
        from scipy.optimize import minimize_scalar

        res = minimize_scalar(lambda b2: _fit_line(k, y, b2)[2], bounds=(lo, hi), method="bounded",
                              options={"xatol": 1e-6 * max(floor, 1e-12)})
        if res.success and res.fun <= errors[best]:
            beta2 = float(res.x)
    b0, b1, _ = _fit_line(k, y, beta2)
    return ConvergenceFit(float(b0), float(b1), beta2, scale, first[0], first[1], len(cleaned))
