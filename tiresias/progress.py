"""The progress guarantee: a resumed job runs long enough to make progress, and a run in which
no job makes progress stops with a clear error.

A preempted job pays for its pause and resume before it makes progress again (``overheads``).
A policy that recomputes priorities often (continuous LAS every second) can preempt a job
again before its resume is over, so every job only ever pays overhead and the run never ends.

The rule (applied by ``tiresias.driver.Driver``, so the simulator and the live master share
it): a job (re)started at ``s`` with resume cost ``r`` cannot be preempted before::

    s + max(min_run, min_run_factor x r)

``r`` is the pause + resume charge of the overhead model (``tiresias.overheads``, or the
measured ``preemption_cost``) when the job resumes after a preemption, 0 at its first start
and 0 when the simulator charges no overheads (``--no-overheads``, ``--original``), so then
the guard is ``min_run`` (default 0: no guard at all, every figure as before). The default
factor 2 keeps a resumed job for its stall plus as much useful work as the stall cost.
Factor 0 switches the guarantee off.

The stall detector (``check_stall``) is the safety net of the simulator: when jobs are
active and none of them executed for ``stall_limit`` seconds of simulated time,
``StallError`` stops the run (the command line turns it into exit status 1 and one line).
"""
from __future__ import annotations

import argparse

DEFAULT_MIN_RUN_FACTOR = 2.0
DEFAULT_MIN_RUN = 0.0
DEFAULT_STALL_LIMIT = 2 * 86400.0


class StallError(RuntimeError):
    """No job made progress for the stall limit while jobs were active."""


def check_limit(limit: float) -> None:
    if not 0.0 < limit < float("inf"):
        raise ValueError(f"stall limit must be a finite number of seconds > 0, got {limit!r}")


def check_guard(min_run_factor: float, min_run: float) -> None:
    """``ValueError`` unless both settings of the guarantee are finite and >= 0."""
    for name, value in (("min_run_factor", min_run_factor), ("min_run", min_run)):
        if not 0.0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def protected_until(start: float, resume_cost: float, min_run_factor: float = DEFAULT_MIN_RUN_FACTOR,
                    min_run: float = DEFAULT_MIN_RUN) -> float:
    """The earliest time a job (re)started at ``start`` with ``resume_cost`` may be preempted."""
    return start + max(min_run, min_run_factor * resume_cost)


def check_stall(now: float, last_progress: float, limit: float, active: int, running: int) -> None:
    """``StallError`` when ``limit`` seconds have passed since a job last executed (the driver's
    ``last_progress``; it moves on while no job is active)."""
    if now - last_progress > limit:
        raise StallError(
            f"no job made progress for {now - last_progress:.0f} s of simulated time (t={now:.0f} s, "
            f"{active} jobs active, {running} running): jobs are preempted before they resume "
            f"(raise --min-run-factor, or --stall-limit if the trace really idles that long)")


def add_arguments(p: argparse.ArgumentParser, live: bool = False) -> None:
    """``--min-run-factor`` and ``--min-run`` (the simulator's, or with ``live`` the master's)."""
    cost = ("the overhead model's pause + resume" if live else
            "the pause + resume charged; 0 with --no-overheads or --original")
    p.add_argument("--min-run-factor", type=float, default=DEFAULT_MIN_RUN_FACTOR, metavar="FACTOR",
                   help=f"progress guarantee: a job (re)started at s with resume cost r ({cost}) cannot be "
                        f"preempted before s + max(MIN_RUN, FACTOR x r); 0 switches it off")
    p.add_argument("--min-run", type=float, default=DEFAULT_MIN_RUN, metavar="SECONDS",
                   help="progress guarantee: the least a (re)started job runs before it can be preempted")
