"""Errors injected into a scheduler's estimates (Optimus §6.3, Fig. 15): an estimate is the
truth times ``1 ± e``, the sign drawn per job (seeded), the error shrinking with the job's
progress (``e`` scaled by the fraction of its work still to do). Pure functions."""
from __future__ import annotations

import numpy as np


def error_signs(seed: int, job_id: int) -> tuple[int, int]:
    """(sign of the remaining-steps error, sign of the speed error) of one job, each ±1,
    the same for the same ``(seed, job_id)``."""
    draws = np.random.default_rng([int(seed), int(job_id)]).integers(0, 2, size=2)
    return int(2 * draws[0] - 1), int(2 * draws[1] - 1)


def error_factor(error: float, sign: int, remaining_fraction: float) -> float:
    """``1 + sign · error · remaining_fraction`` (the fraction clamped to [0, 1])."""
    if error < 0:
        raise ValueError(f"error must be >= 0, got {error}")
    fraction = min(1.0, max(0.0, remaining_fraction))
    return 1.0 + sign * error * fraction
