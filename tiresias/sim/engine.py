"""The event-driven simulator: arrivals, completions and the policy's own change points.

Between events every running job gains ``dt`` of execution and ``W * dt`` of service. At
each event the simulator completes jobs, admits arrivals, lets the policy refresh, and runs
the same ``allocate`` pass the live master will run; jobs left out are preempted. GPUs are
counted cluster-wide here (node placement and overhead models plug in through ``fits`` and
the optional costs). Time is in seconds.
"""
from __future__ import annotations

import heapq
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..policies.base import INF, JobState, Policy, allocate

EPS = 1e-9


@dataclass
class SimResult:
    policy: str
    jobs: list[JobState]
    capacity: int
    makespan: float
    busy_gpu_seconds: float
    preemptions: int
    wall_seconds: float
    events: int = 0
    timeline: list = field(default_factory=list)   # (time, job_id, "start"|"stop"|"end") when recorded


def simulate(trace: Iterable, capacity: int, policy: Policy, record: bool = False,
             progress: bool = False, fits: Callable[[JobState, int], bool] | None = None,
             max_events: int | None = None) -> SimResult:
    """Run ``trace`` (objects with job_id, submit_time, num_gpus, duration[, model, skew]) to the end."""
    started_wall = time.perf_counter()
    pending = sorted(trace, key=lambda j: (j.submit_time, j.job_id))
    for tj in pending:
        if tj.num_gpus > capacity:
            raise ValueError(f"job {tj.job_id} needs {tj.num_gpus} GPUs; the cluster has {capacity}")
    jobs: list[JobState] = []
    running: dict[int, JobState] = {}
    ends: list[tuple[float, int, int]] = []     # (end if not preempted, run token, job id)
    tokens: dict[int, int] = {}
    timeline: list = []
    now = 0.0 if not pending else min(0.0, pending[0].submit_time)
    nxt = 0
    busy = 0.0
    used = 0
    events = 0
    preemptions = 0
    total = len(pending)
    done = 0
    last_report = 0.0
    while nxt < total or policy.active:
        # next event time
        t_arrival = pending[nxt].submit_time if nxt < total else INF
        while ends and tokens.get(ends[0][2]) != ends[0][1]:
            heapq.heappop(ends)                 # stale: that run was preempted
        t_done = ends[0][0] if ends else INF
        t_policy = policy.next_change(running.values(), now)
        t = min(t_arrival, t_done, t_policy)
        if t == INF:
            stuck = [j.job_id for j in policy.active.values()][:5]
            raise RuntimeError(f"simulation stuck at t={now}: jobs {stuck} can never run")
        dt = max(0.0, t - now)
        if dt > 0:
            for job in running.values():
                job.executed += dt
                job.service += job.num_gpus * dt
            busy += used * dt
            now = t
        events += 1
        if max_events is not None and events > max_events:
            raise RuntimeError(f"more than {max_events} events")
        # completions
        finished = []
        while ends and ends[0][0] <= now + EPS * max(1.0, now):
            _, token, job_id = heapq.heappop(ends)
            if tokens.get(job_id) == token:
                finished.append(running[job_id])
        for job in sorted(finished, key=lambda j: j.job_id):
            job.executed = job.duration
            job.running = False
            tokens[job.job_id] += 1
            policy.stopped(job, now)
            job.end_time = now
            del running[job.job_id]
            used -= job.num_gpus
            policy.remove(job, now)
            done += 1
            if record:
                timeline.append((now, job.job_id, "end"))
        # arrivals
        while nxt < total and pending[nxt].submit_time <= now + EPS:
            tj = pending[nxt]
            nxt += 1
            job = JobState(tj.job_id, int(tj.num_gpus), float(tj.submit_time), float(tj.duration),
                           wait_since=float(tj.submit_time), skew=float(getattr(tj, "skew", None) or 0.0),
                           model=getattr(tj, "model", None))
            jobs.append(job)
            policy.add(job, now)
        policy.refresh(running.values(), now)
        to_start, to_stop = allocate(policy, capacity, running.values(), now, fits)
        for job in to_stop:
            job.running = False
            tokens[job.job_id] += 1
            policy.stopped(job, now)
            job.preemptions += 1
            job.wait_since = now
            job.last_run = now
            preemptions += 1
            del running[job.job_id]
            used -= job.num_gpus
            if record:
                timeline.append((now, job.job_id, "stop"))
        for job in to_start:
            job.running = True
            job.waited += max(0.0, now - job.wait_since)
            if job.first_start is None:
                job.first_start = now
            running[job.job_id] = job
            used += job.num_gpus
            tokens[job.job_id] = token = tokens.get(job.job_id, 0) + 1
            heapq.heappush(ends, (now + job.remaining(), token, job.job_id))
            policy.started(job, now)
            if record:
                timeline.append((now, job.job_id, "start"))
        if used > capacity:
            raise AssertionError(f"{used} GPUs allocated of {capacity} at t={now}")
        if progress and time.perf_counter() - last_report > 1.0:
            last_report = time.perf_counter()
            print(f"\r  t={now / 86400:8.1f} d  finished {done}/{total} jobs  running {len(running)}  "
                  f"waiting {len(policy.active) - len(running)}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    makespan = max((j.end_time for j in jobs), default=0.0) - (jobs[0].submit_time if jobs else 0.0)
    return SimResult(policy.name, jobs, capacity, makespan, busy, preemptions,
                     time.perf_counter() - started_wall, events, timeline)
