"""The event-driven simulation of ``tiresias.gandiva``'s model (Gandiva as the original
Tiresias simulator models it): arrivals, completions, node sets and their fluid time slices.

Between events every node set's clock runs (``NodeSets.advance``); at an event the simulator
completes the jobs whose execution is over, places arrivals (or keeps them waiting), retries
the waiting jobs, rebalances the classes and retries again. With the cost models on, a
sliced job progresses at ``q / (q + r)`` of its share (``r``: its pause + resume, ``q``: the
switching period); node sets are consolidated, so no placement slowdown applies. Every job
in a set progresses, so the run ends; the stall detector checks it all the same.
"""
from __future__ import annotations

import heapq
import time
from typing import Callable, Iterable

from .. import overheads as ovh
from ..cluster import ClusterSpec, skew_of
from ..driver import EPS, DriverConfig
from ..gandiva import NodeSets
from ..policies.base import INF, JobState
from ..policies.gandiva import GandivaModel
from ..progress import DEFAULT_STALL_LIMIT, check_stall
from .progressbar import progress_reporter
from .result import SimResult


def simulate_gandiva(trace: Iterable, cluster: ClusterSpec, model: GandivaModel, config: DriverConfig,
                     record: bool = False, progress: bool | Callable = False, max_events: int | None = None,
                     stall_limit: float = DEFAULT_STALL_LIMIT) -> SimResult:
    """Run ``trace`` under the Gandiva model on ``model.cluster`` (else ``cluster``)."""
    started_wall = time.perf_counter()
    shape = model.cluster or cluster
    pending = sorted(trace, key=lambda j: (j.submit_time, j.job_id))
    for tj in pending:
        if tj.num_gpus > shape.total_gpus:
            raise ValueError(f"job {tj.job_id} needs {tj.num_gpus} GPUs; the cluster has {shape.total_gpus}")
    sets = NodeSets(shape)
    now = min(0.0, pending[0].submit_time) if pending else 0.0
    ends: list[tuple[float, int, int]] = []           # (time, set version, set id)
    jobs: list[JobState] = []
    effs: dict[int, float] = {}
    timeline: list = []
    busy = last_progress = 0.0
    active = done = events = nxt = 0
    total = len(pending)
    report = progress_reporter(progress, total)
    while nxt < total or active:
        while ends and (ends[0][2] not in sets.sets or sets.sets[ends[0][2]].version != ends[0][1]):
            heapq.heappop(ends)
        t = min(pending[nxt].submit_time if nxt < total else INF, ends[0][0] if ends else INF)
        if t == INF:
            raise RuntimeError(f"simulation stuck at t={now}: {len(sets.waiting)} jobs wait for nodes")
        if sets.sets or not active:
            last_progress = t
        busy += sets.used_gpus() * (t - now)
        now = t
        sets.advance(now)
        check_stall(now, last_progress, stall_limit, active, sum(s.running() for s in sets.sets.values()))
        events += 1
        if max_events is not None and events > max_events:
            raise RuntimeError(f"more than {max_events} events")
        while ends and ends[0][0] <= now + EPS * max(1.0, now):
            _, version, sid = heapq.heappop(ends)
            s = sets.sets.get(sid)
            if s is None or s.version != version:
                continue
            for jid in s.done():
                job = s.members[jid].job
                sets.finish(jid)
                _close(job, now, sets.sliced_time.pop(jid, 0.0), model.switch, effs.pop(jid))
                active -= 1
                done += 1
                if record:
                    timeline.append((now, jid, "end"))
        while nxt < total and pending[nxt].submit_time <= now + EPS:
            tj = pending[nxt]
            nxt += 1
            job = _job(tj)
            jobs.append(job)
            active += 1
            eff = effs[job.job_id] = _efficiency(job, config, model.switch)
            if sets.place(job, job.duration, eff, now):
                _started(job, now, record, timeline)
            else:
                sets.waiting.append((job, job.duration, eff))
        for job in sets.place_waiting(now):
            _started(job, now, record, timeline)
        sets.rebalance(now)
        for job in sets.place_waiting(now):
            _started(job, now, record, timeline)
        for sid in sets.changed:
            s = sets.sets.get(sid)
            if s is not None and s.members:
                heapq.heappush(ends, (s.next_end(), s.version, sid))
        sets.changed.clear()
        if report is not None:
            report(done, len(sets.where), now)
    if report is not None:
        report(done, 0, now, final=True)
    makespan = max((j.end_time for j in jobs), default=0.0) - (jobs[0].submit_time if jobs else 0.0)
    return SimResult(model.name, jobs, shape.total_gpus, makespan, busy, sum(j.preemptions for j in jobs),
                     time.perf_counter() - started_wall, events, timeline, "node-sets",
                     overhead_seconds=sum(j.overhead for j in jobs))


def _job(tj) -> JobState:
    model = getattr(tj, "model", None)
    return JobState(tj.job_id, int(tj.num_gpus), float(tj.submit_time), float(tj.duration),
                    wait_since=float(tj.submit_time), model=model, skew=skew_of(model, getattr(tj, "skew", None)))


def _efficiency(job: JobState, config: DriverConfig, switch: float) -> float:
    """Progress per second of a time slice: ``q / (q + r)`` with the cost models, else 1."""
    if not config.overheads:
        return 1.0
    cost = config.preemption_cost
    if cost is None:
        cost = ovh.preemption_cost(job.model, job.num_gpus)
    return switch / (switch + cost)


def _started(job: JobState, now: float, record: bool, timeline: list) -> None:
    job.first_start = now
    job.running = True
    job.waited = now - job.submit_time
    if record:
        timeline.append((now, job.job_id, "start"))


def _close(job: JobState, now: float, sliced: float, switch: float, eff: float) -> None:
    """A job ended: its turns in time slices count as preemptions, their cost as overhead."""
    job.running = False
    job.end_time = now
    job.executed = job.duration
    job.preemptions = int(sliced * eff // switch)        # a turn holds a slot q + r seconds
    job.overhead = sliced * (1.0 - eff)
