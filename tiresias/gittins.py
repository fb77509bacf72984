"""Gittins index of attained service under an empirical job-service distribution.

This module owns the *Gittins index* computation used by Tiresias' Discretized
2D-Gittins-index scheduler (Gu et al., NSDI'19, Pseudocode 1; thesis ch. III
§3.3.2) and the loading of the service distribution (GPU-seconds of past jobs,
e.g. ``/work/shared/data/tiresias/yarn-gput1000.csv``).  It is pure numpy: no
scheduler state, no I/O except :meth:`ServiceDistribution.from_csv`.

Definition (paper, Pseudocode 1, line 11/12).  With ``S`` the service of a job
drawn from the distribution ``D``, ``a`` the job's attained service
(``W_J * t_J``, GPU-seconds) and ``Δ`` the service quantum::

    G(a, Δ) = P(S - a <= Δ | S > a) / E[min(S - a, Δ) | S > a]

The higher the index, the higher the priority.  The paper's generic Pseudocode
takes ``G_J = sup_{Δ > 0} G(a, Δ)``; the *Discretized* 2D-Gittins scheduler
that Tiresias actually runs (§3.2.2 / thesis "Discretized 2D-Gittins index")
fixes ``Δ`` per queue (``Δ_i = Q_i^hi``, the queue's upper limit, ``Δ_K = ∞``
for the last queue).  :meth:`ServiceDistribution.index` /
:meth:`~ServiceDistribution.indices` compute the ratio for a *given* ``Δ``
(``Δ = inf`` allowed: ``G(a, ∞) = 1 / E[S - a | S > a]``);
:meth:`ServiceDistribution.sup_index` computes the paper's ``sup_{Δ>0}``.

Empirical evaluation.  With the samples sorted once and their prefix sums kept,
for ``a`` and ``Δ``::

    n_gt   = #{s > a}
    n_done = #{a < s <= a + Δ}
    P      = n_done / n_gt
    E      = (sum_{a < s <= a+Δ} (s - a) + Δ * #{s > a + Δ}) / n_gt

so each index costs two ``np.searchsorted`` look-ups (``O(log n)``).  The
prefix sums and the subtraction ``window - a * n_done`` use error-free
transformations (TwoSum / Veltkamp split), so the index keeps full relative
precision even when ``a`` lies an ulp below a sample (needs ``n < 2**26``).

Fallback beyond the history.  When no sample exceeds ``a`` (the job has
already received more service than every past job), the conditional
distribution is empty.  We then treat the job as certain to finish exactly at
the end of the next quantum: ``P = 1``, ``E = Δ``, i.e. ``G = 1 / Δ``; for
``Δ = inf`` we assume it needs as much again as it has attained (``E = a``),
i.e. ``G = 1 / a``.  The value is always finite and positive.  (The original
Tiresias simulator instead returns 0 — lowest priority — in this case.)
"""
from __future__ import annotations

import math
import os
from typing import Iterable, Union

import numpy as np

__all__ = ["ServiceDistribution"]

ArrayLike = Union[np.ndarray, float, Iterable[float]]

# Smallest positive conditional-expectation numerator; guards against
# floating-point cancellation making E <= 0 when the true value is tiny > 0.
_TINY = np.finfo(np.float64).tiny


def _window_minus(csum: np.ndarray, cerr: np.ndarray, lo, hi, a, m) -> np.ndarray:
    """``sum(s[lo:hi]) - a * m`` with error-free transformations.

    The window sum is ``csum`` / ``cerr`` differences (double-double); the
    subtraction of the two prefix sums (TwoSum) and ``a * m`` (Veltkamp split,
    exact for integer ``m < 2**26``) are carried exactly, so the result keeps
    full relative precision even when ``a`` sits an ulp below a sample.
    """
    a = np.asarray(a, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    x, y = csum[hi], csum[lo]
    d = x - y
    z = d - x
    d_err = (x - (d - z)) + (-y - z)          # TwoSum(x, -y) error
    c = 134217729.0 * a                        # 2**27 + 1
    a_hi = c - (c - a)
    a_lo = a - a_hi
    return (d - a_hi * m) + ((d_err - a_lo * m) + (cerr[hi] - cerr[lo]))


class ServiceDistribution:
    """Empirical distribution of job service (GPU-seconds); immutable."""

    __slots__ = ("_s", "_csum", "_cerr", "_n")

    def __init__(self, samples: Iterable[float]) -> None:
        arr = np.asarray(list(samples) if not isinstance(samples, np.ndarray) else samples,
                         dtype=np.float64).ravel()
        if arr.size == 0:
            raise ValueError("ServiceDistribution needs at least one sample")
        if arr.size >= 2**26:
            raise ValueError("at most 2**26 - 1 samples are supported")
        if not np.all(np.isfinite(arr)):
            raise ValueError("service samples must be finite")
        if np.any(arr <= 0):
            bad = float(arr[arr <= 0][0])
            raise ValueError(f"service samples must be positive (got {bad!r})")
        s = np.sort(arr)
        s.flags.writeable = False
        # Prefix sums as an unevaluated pair hi + lo ("double-double"):
        # sum(s[:k]) == csum[k] + cerr[k] to ~1e-16 relative of the *window*
        # sums we take, not of the running total (Knuth TwoSum on each step of
        # the sequential cumsum).  Without it, a window sum minus a*n_done loses
        # precision when `attained` sits just below a sample.
        hi_ = np.cumsum(s)
        prev = np.concatenate(([0.0], hi_[:-1]))
        z = hi_ - prev
        step_err = (prev - (hi_ - z)) + (s - z)
        csum = np.concatenate(([0.0], hi_))            # csum[k] ~ sum(s[:k])
        cerr = np.concatenate(([0.0], np.cumsum(step_err)))
        for arr_ in (csum, cerr):
            arr_.flags.writeable = False
        self._s = s
        self._csum = csum
        self._cerr = cerr
        self._n = int(s.size)

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_csv(cls, path: Union[str, os.PathLike]) -> "ServiceDistribution":
        """Load a one-column CSV: a header line, then one positive number per line.

        Blank lines are ignored; CRLF line endings are accepted.  Any other
        line that is not a single finite positive number raises ``ValueError``
        naming ``file:line`` (1-based).
        """
        p = os.fspath(path)
        samples: list[float] = []
        with open(p, "r", encoding="utf-8", newline="") as fh:
            header = fh.readline()
            if header == "":
                raise ValueError(f"{p}:1: empty file (expected a header line)")
            for lineno, raw in enumerate(fh, start=2):
                text = raw.strip()
                if not text:
                    continue
                try:
                    v = float(text)
                except ValueError:
                    raise ValueError(f"{p}:{lineno}: not a number: {text!r}") from None
                if not math.isfinite(v) or v <= 0:
                    raise ValueError(f"{p}:{lineno}: service must be a finite positive number, got {text!r}")
                samples.append(v)
        if not samples:
            raise ValueError(f"{p}: no samples after the header")
        return cls(samples)

    # ----------------------------------------------------------- properties
    @property
    def samples(self) -> np.ndarray:
        """Sorted samples (read-only view)."""
        return self._s

    def __len__(self) -> int:
        return self._n

    @property
    def mean(self) -> float:
        return float(self._csum[-1] / self._n)

    @property
    def max(self) -> float:
        return float(self._s[-1])

    def __repr__(self) -> str:
        return f"ServiceDistribution(n={self._n}, min={self._s[0]:g}, mean={self.mean:g}, max={self.max:g})"

    # -------------------------------------------------------------- indices
    def index(self, attained: float, quantum: float) -> float:
        """``G(attained, quantum)``; see the module docstring (incl. fallback)."""
        return float(self.indices(np.float64(attained), np.float64(quantum)))

    def indices(self, attained: ArrayLike, quantum: ArrayLike) -> np.ndarray:
        """Vectorized :meth:`index`; ``attained`` and ``quantum`` broadcast.

        Raises ``ValueError`` for negative/NaN ``attained`` or for a
        non-positive/NaN ``quantum`` (``inf`` is allowed).
        """
        a = np.asarray(attained, dtype=np.float64)
        q = np.asarray(quantum, dtype=np.float64)
        # (a >= 0) is False for NaN, so the negated test catches both.
        if not np.all(a >= 0) or np.any(np.isinf(a)):
            raise ValueError("attained service must be finite and >= 0")
        if not np.all(q > 0):
            raise ValueError("quantum must be > 0 (inf allowed)")
        a, q = np.broadcast_arrays(a, q)

        s, csum, cerr, n = self._s, self._csum, self._cerr, self._n
        end = a + q  # inf where q is inf
        lo = np.searchsorted(s, a, side="right")    # first sample > a
        hi = np.searchsorted(s, end, side="right")  # first sample > a + q
        n_gt = n - lo
        n_done = hi - lo
        n_over = n - hi

        beyond = n_gt == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            # sum_{a < s <= a+q} (s - a); the window sum is split into hi/lo parts.
            sum_done = _window_minus(csum, cerr, lo, hi, a, n_done)
            # Δ * n_over, but 0 (not NaN) when Δ is inf and n_over is 0.
            over = np.where(n_over > 0, q * n_over, 0.0)
            e_num = np.maximum(sum_done + over, _TINY)  # true value > 0 whenever n_gt > 0
            # P / E = (n_done / n_gt) / (e_num / n_gt) = n_done / e_num
            g = n_done / e_num
            fallback = np.where(np.isinf(q), 1.0 / np.maximum(a, self._s[-1]), 1.0 / q)
        out = np.where(beyond, fallback, g)
        return out.astype(np.float64, copy=False)

    def sup_index(self, attained: float) -> float:
        """The paper's ``sup_{Δ>0} G(attained, Δ)`` (Pseudocode 1, generic form).

        For an empirical distribution the ratio is decreasing in ``Δ`` between
        consecutive samples, so the supremum is attained at ``Δ = s_k - a``
        for some sample ``s_k > a``; cost ``O(#{s > a})``.  Beyond the history
        the fallback is ``1 / a`` (the ``Δ = inf`` fallback of :meth:`index`).
        """
        a = float(attained)
        if not (a >= 0) or math.isinf(a):
            raise ValueError("attained service must be finite and >= 0")
        s, csum, cerr, n = self._s, self._csum, self._cerr, self._n
        lo = int(np.searchsorted(s, a, side="right"))
        if lo == n:
            return 1.0 / max(a, float(s[-1]))
        k = np.arange(lo, n)
        m = k - lo + 1                                   # samples done by Δ = s_k - a
        done = _window_minus(csum, cerr, lo, k + 1, a, m)   # sum_{lo..k} (s_j - a)
        e_num = np.maximum(done + (s[k] - a) * (n - 1 - k), _TINY)
        return float(np.max(m / e_num))
