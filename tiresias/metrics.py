"""Summary figures of a simulation (seconds throughout) and the per-job CSV."""
from __future__ import annotations

import csv

import numpy as np

from .sim import SimResult


def summarize(result: SimResult) -> dict:
    jobs = [j for j in result.jobs if j.end_time is not None]
    jct = np.array([j.end_time - j.submit_time for j in jobs], dtype=float)
    delay = np.array([(j.first_start - j.submit_time) for j in jobs], dtype=float)

    def stats(prefix: str, values: np.ndarray) -> dict:
        if values.size == 0:
            return {f"avg_{prefix}": None, f"median_{prefix}": None, f"p95_{prefix}": None}
        return {f"avg_{prefix}": float(values.mean()), f"median_{prefix}": float(np.median(values)),
                f"p95_{prefix}": float(np.percentile(values, 95))}

    span = result.makespan
    return {
        "policy": result.policy,
        "jobs": len(jobs),
        **stats("jct", jct),
        **stats("queue_delay", delay),
        "makespan": span,
        "preemptions": result.preemptions,
        "gpu_utilization": result.busy_gpu_seconds / (result.capacity * span) if span > 0 else 0.0,
        "sim_wall_seconds": result.wall_seconds,
        "events": result.events,
        "placement": result.placement,
        "placement_waits": result.placement_waits,
        "repacks": result.repacks,
        "migrations": result.migrations,
        "migrations_without_matching": result.migrations_naive,
        "migrations_saved": result.migrations_naive - result.migrations,
        "overhead_seconds": result.overhead_seconds,
    }


def write_jobs_csv(result: SimResult, path: str) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["job_id", "num_gpus", "submit", "first_start", "end", "jct", "queue_delay", "preemptions",
                      "migrations", "overhead", "model", "skew"])
        for j in sorted(result.jobs, key=lambda j: j.job_id):
            out.writerow([j.job_id, j.num_gpus, j.submit_time, j.first_start, j.end_time,
                          j.end_time - j.submit_time, j.first_start - j.submit_time, j.preemptions,
                          j.migrations, j.overhead, j.model or "", j.skew])


def finish_time_fairness(result: SimResult) -> dict:
    """Themis' finish-time fairness, as Tesserae and Gavel report it: a job's rho = its JCT in
    the shared cluster / its JCT alone on its fair share, where the fair share is 1/N of the
    cluster with N the time-averaged number of active jobs over the job's lifetime (itself
    included); on that share a job asking g GPUs runs ``max(1, N g / C)`` times its isolated
    duration (C the cluster's GPUs). rho <= 1: the job did at least as well as on its share."""
    jobs = [j for j in result.jobs if j.end_time is not None and j.duration]
    if not jobs:
        return {"ftf_max": None, "ftf_mean": None, "ftf_p95": None}
    times = np.array(sorted({t for j in jobs for t in (j.submit_time, j.end_time)}), dtype=float)
    delta = np.zeros(times.size)
    np.add.at(delta, np.searchsorted(times, [j.submit_time for j in jobs]), 1.0)
    np.add.at(delta, np.searchsorted(times, [j.end_time for j in jobs]), -1.0)
    active = np.cumsum(delta)[:-1]                      # jobs active on [times[i], times[i+1])
    area = np.concatenate(([0.0], np.cumsum(active * np.diff(times))))   # integral of N up to times[i]
    start = np.array([j.submit_time for j in jobs])
    end = np.array([j.end_time for j in jobs])
    span = end - start
    n = np.where(span > 0, (np.interp(end, times, area) - np.interp(start, times, area)) / np.where(span > 0, span, 1), 1.0)
    gpus = np.array([j.num_gpus for j in jobs], dtype=float)
    ideal = np.array([j.duration for j in jobs]) * np.maximum(1.0, n * gpus / result.capacity)
    rho = span / ideal
    return {"ftf_max": float(rho.max()), "ftf_mean": float(rho.mean()), "ftf_p95": float(np.percentile(rho, 95))}
