"""The event-driven simulator: arrivals, completions and the policy's own change points.

The simulator owns only a virtual clock and its events; everything else — job and node
state, lifecycle transitions, service accounting, placement and overhead models — is the
``tiresias.driver.Driver`` the live master uses too. Between events the driver accounts
``dt`` of attained service (``W * dt``) and, once a job's stall (pause/resume overhead) is
over, ``speed * dt`` of execution. At each event the simulator completes jobs, admits
arrivals and asks the driver for a pass; it predicts each started job's completion from its
remaining execution and speed. Time is in seconds.

Every run ends: the driver's progress guarantee keeps a resumed job running long enough to
make progress, and should no job execute for ``stall_limit`` seconds of simulated time
while jobs are active, ``tiresias.progress.StallError`` stops the run.
"""
from __future__ import annotations

import gc
import heapq
import math
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from ..cluster import ClusterSpec, skew_of
from ..driver import EPS, PLACEMENTS, Driver, DriverConfig
from ..packing.slots import Sharing
from ..policies.base import BY_ID, INF, JobState, Policy
from ..policies.gandiva import GandivaModel
from ..progress import DEFAULT_STALL_LIMIT, check_limit, check_stall
from .gandiva import simulate_gandiva
from .progressbar import progress_reporter
from .result import SimResult

SimConfig = DriverConfig
__all__ = ["PLACEMENTS", "SimConfig", "SimResult", "simulate"]


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The event loop makes no reference cycles; Python's cyclic collector would only walk the
    jobs (tens of thousands of tracked objects) again and again, about 3% of a long run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(trace: Iterable, cluster: ClusterSpec | int, policy: Policy | GandivaModel, record: bool = False,
             progress: bool | Callable[[int, int, float], None] = False, config: SimConfig | None = None,
             max_events: int | None = None, stall_limit: float = DEFAULT_STALL_LIMIT,
             make_job: Callable[[object], JobState] | None = None,
             observe: Callable[[Driver], None] | None = None, sharing: Sharing | None = None,
             true_sharing: Sharing | None = None) -> SimResult:
    """Run ``trace`` (objects with job_id, submit_time, num_gpus, duration[, model, skew,
    batch_size]) to the
    end; ``StallError`` when no job executes for ``stall_limit`` simulated seconds. The Gandiva
    model (``tiresias.gandiva``) has its own simulation (``tiresias.sim.gandiva``).
    ``make_job`` builds a trace item's ``JobState`` (measured jobs: GPU range, true rate);
    ``observe`` is called before every pass (measured jobs report their progress);
    ``sharing`` gives GPU sharing's profile keys and the pair speeds it decides with
    (``config.packing``), ``true_sharing`` the speeds packed jobs really run at (default the
    same; a noisy profile decides, the true one runs)."""
    started_wall = time.perf_counter()
    check_limit(stall_limit)
    config = config or SimConfig()
    if config.defer_release:
        raise ValueError("defer_release is for the live master, not the simulator")
    if isinstance(cluster, int):
        if config.placement != "count":
            raise ValueError("node placement needs a ClusterSpec (nodes x GPUs), not a GPU count")
        cluster = ClusterSpec(1, cluster)
    if isinstance(policy, GandivaModel):
        return simulate_gandiva(trace, cluster, policy, config, record, progress, max_events, stall_limit)
    pending = sorted(trace, key=lambda j: (j.submit_time, j.job_id))
    for tj in pending:
        if tj.num_gpus > cluster.total_gpus:
            raise ValueError(f"job {tj.job_id} needs {tj.num_gpus} GPUs; the cluster has {cluster.total_gpus}")
    drv = Driver(policy, cluster, config, start=0.0 if not pending else min(0.0, pending[0].submit_time),
                 sharing=sharing, true_sharing=true_sharing)
    jobs: list[JobState] = []
    ends: list[tuple[float, int, int]] = []     # (end if not preempted, run token, job id)
    tokens: dict[int, int] = {}
    timeline: list = []
    nxt = 0
    events = 0
    total = len(pending)
    done = 0
    report = progress_reporter(progress, total)
    tick = config.decide_every
    heappush, heappop = heapq.heappush, heapq.heappop
    running = drv.running
    with _collector_paused():
        while nxt < total or policy.active:
            t_arrival = pending[nxt].submit_time if nxt < total else INF
            while ends and tokens.get(ends[0][2]) != ends[0][1]:
                heappop(ends)                       # stale: that run was preempted
            t_done = ends[0][0] if ends else INF
            if tick is None:
                t = min(t_arrival, t_done, drv.next_change())
            else:                                   # passes only at ticks; the policy's changes wait
                t_pass = (math.floor(drv.now / tick + 1e-9) + 1) * tick if policy.active else INF
                t = min(t_arrival, t_done, t_pass)
            if t == INF:
                stuck = [j.job_id for j in policy.active.values()][:5]
                raise RuntimeError(f"simulation stuck at t={drv.now}: jobs {stuck} can never run")
            drv.advance(t)
            now = drv.now
            if now - drv.last_progress > stall_limit and now - drv.progress() > stall_limit:
                check_stall(now, drv.last_progress, stall_limit, len(policy.active), len(drv.running))
            events += 1
            if max_events is not None and events > max_events:
                raise RuntimeError(f"more than {max_events} events")
            # completions
            finished = []
            due = now + EPS * max(1.0, now)
            while ends and ends[0][0] <= due:
                _, token, job_id = heappop(ends)
                if tokens.get(job_id) == token:
                    finished.append(running[job_id])
            if len(finished) > 1:
                finished.sort(key=BY_ID)
            for job in finished:
                tokens[job.job_id] += 1
                alone = drv.finish(job)
                job.executed = job.duration
                done += 1
                if record:
                    timeline.append((now, job.job_id, "end"))
                for other in alone:                 # its partner on shared GPUs: a new speed
                    tokens[other.job_id] = token = tokens[other.job_id] + 1
                    heappush(ends, (now + other.stall + other.remaining() / other.speed, token, other.job_id))
            # arrivals
            while nxt < total and pending[nxt].submit_time <= now + EPS:
                tj = pending[nxt]
                nxt += 1
                if make_job is not None:
                    job = make_job(tj)
                else:
                    model = getattr(tj, "model", None)
                    job = JobState(tj.job_id, int(tj.num_gpus), float(tj.submit_time), float(tj.duration),
                                   wait_since=float(tj.submit_time), model=model,
                                   skew=skew_of(model, getattr(tj, "skew", None)),
                                   batch_size=getattr(tj, "batch_size", None))
                jobs.append(job)
                drv.submit(job)
            if tick is not None and abs(now / tick - round(now / tick)) > 1e-9:
                continue                            # not a tick: arrivals and completions only
            if observe is not None:
                observe(drv)
            decision = drv.schedule()
            for job in decision.stopped:
                tokens[job.job_id] += 1
                if record:
                    timeline.append((now, job.job_id, "stop"))
            if record:
                timeline += [(now, job.job_id, "start") for job in decision.started]
            fresh = decision.started
            if decision.moved:
                seen = {j.job_id for j in fresh}
                fresh = fresh + [j for j in decision.moved if j.job_id not in seen]
            for job in fresh:
                tokens[job.job_id] = token = tokens.get(job.job_id, 0) + 1
                heappush(ends, (now + job.stall + job.remaining() / job.speed, token, job.job_id))
            if len(ends) > 2 * len(running) + 1024:      # mostly ends of preempted runs: drop them
                ends = [e for e in ends if tokens.get(e[2]) == e[1]]
                heapq.heapify(ends)
            if report is not None:
                report(done, len(drv.running), now)
    if report is not None:
        report(done, 0, drv.now, final=True)
    makespan = max((j.end_time for j in jobs), default=0.0) - (jobs[0].submit_time if jobs else 0.0)
    result = SimResult(policy.name, jobs, drv.capacity, makespan, drv.busy, drv.preemptions,
                       time.perf_counter() - started_wall, events, timeline, config.placement,
                       overhead_seconds=drv.overhead)
    if drv.nodes is not None:
        result.placement_waits = drv.nodes.waits
        result.repacks = drv.nodes.repacks
        result.migrations = drv.nodes.migrations
        result.migrations_naive = drv.nodes.migrations_naive
    return result
