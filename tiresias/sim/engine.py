"""The event-driven simulator: arrivals, completions and the policy's own change points.

Between events every running job gains ``dt`` of attained service (``W * dt``) and, once its
stall (pause/resume overhead) is over, ``speed * dt`` of execution. At each event the
simulator completes jobs, admits arrivals, lets the policy refresh, and runs the same
``allocate`` pass the live master will run; jobs left out are preempted and jobs admitted are
placed on nodes (``SimConfig.placement``):

* ``count``: GPUs counted cluster-wide, no nodes — the original Tiresias simulator;
* ``tiresias``: consolidate jobs whose skew exceeds ``packlimit``, others where they limit
  fragmentation (``tiresias.placement``); a job admitted by count that cannot be consolidated
  waits for the next event (or, with ``migrate``, the running jobs are repacked and renamed
  onto nodes with Tesserae's migration-minimizing matching);
* ``consolidate``: every job consolidated (YARN-CS' constraint); ``spread``: none is.

Costs (``tiresias.overheads``): a resumed job stalls for its pause + resume time
(``overheads``); a multi-GPU job placed on more nodes than it needs runs slower by its skew
(``slowdown``). Time is in seconds.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .. import overheads as ovh
from .. import placement as plc
from ..cluster import ClusterSpec, skew_of
from ..policies.base import INF, JobState, Policy, allocate

EPS = 1e-9
PLACEMENTS = ("count", "tiresias", "consolidate", "spread")


@dataclass
class SimConfig:
    placement: str = "count"
    packlimit: float = plc.DEFAULT_PACKLIMIT
    overheads: bool = False        # charge pause + resume on every resume after a preemption
    slowdown: bool = False         # slow down skewed jobs placed unconsolidated
    migrate: bool = False          # repack + Hungarian renaming when consolidation is blocked

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")


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
    placement: str = "count"
    placement_waits: int = 0          # admitted by count, not placeable (consolidation blocked)
    repacks: int = 0
    migrations: int = 0               # jobs moved by repacks (with the matching)
    migrations_naive: int = 0         # ... had the new plan been applied without renaming nodes
    overhead_seconds: float = 0.0


def simulate(trace: Iterable, cluster: ClusterSpec | int, policy: Policy, record: bool = False,
             progress: bool | Callable[[int, int, float], None] = False, config: SimConfig | None = None,
             max_events: int | None = None) -> SimResult:
    """Run ``trace`` (objects with job_id, submit_time, num_gpus, duration[, model, skew]) to the end."""
    started_wall = time.perf_counter()
    config = config or SimConfig()
    if isinstance(cluster, int):
        if config.placement != "count":
            raise ValueError("node placement needs a ClusterSpec (nodes x GPUs), not a GPU count")
        cluster = ClusterSpec(1, cluster)
    capacity = cluster.total_gpus
    nodes = None if config.placement == "count" else _Nodes(cluster, config)
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
    overhead = 0.0
    total = len(pending)
    done = 0
    report = _progress_reporter(progress, total)
    while nxt < total or policy.active:
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
                job.service += job.num_gpus * dt
                if job.stall > 0.0:
                    s = job.stall if job.stall < dt else dt
                    job.stall -= s
                    job.executed += (dt - s) * job.speed
                else:
                    job.executed += dt * job.speed
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
            if nodes is not None:
                nodes.release(job)
            policy.remove(job, now)
            done += 1
            if record:
                timeline.append((now, job.job_id, "end"))
        # arrivals
        while nxt < total and pending[nxt].submit_time <= now + EPS:
            tj = pending[nxt]
            nxt += 1
            model = getattr(tj, "model", None)
            job = JobState(tj.job_id, int(tj.num_gpus), float(tj.submit_time), float(tj.duration),
                           wait_since=float(tj.submit_time), model=model,
                           skew=skew_of(model, getattr(tj, "skew", None)))
            jobs.append(job)
            policy.add(job, now)
        policy.refresh(running.values(), now)
        to_start, to_stop = allocate(policy, capacity, running.values(), now)
        if nodes is not None:
            # place the admitted jobs on the nodes the preempted ones free; a preempted job
            # whose GPUs nobody could use after all (placement blocked) keeps running
            held = {job.job_id: nodes.release(job) for job in to_stop}
            stopping = {job.job_id for job in to_stop}
            staying = {jid: j for jid, j in running.items() if jid not in stopping}
            to_start = nodes.place_all(to_start, staying, now)
            to_stop = [job for job in to_stop if not nodes.retake(job, held[job.job_id])]
        for job in to_stop:
            job.running = False
            tokens[job.job_id] += 1
            job.preemptions += 1
            job.wait_since = now
            job.last_run = now
            policy.stopped(job, now)
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
            elif config.overheads and job.preemptions:
                cost = ovh.preemption_cost(job.model, job.num_gpus)
                job.stall += cost
                job.overhead += cost
                overhead += cost
            running[job.job_id] = job
            used += job.num_gpus
            policy.started(job, now)
            if record:
                timeline.append((now, job.job_id, "start"))
        if to_start or (nodes is not None and nodes.moved):
            for job in (to_start if nodes is None else _union(to_start, nodes.moved)):
                tokens[job.job_id] = token = tokens.get(job.job_id, 0) + 1
                heapq.heappush(ends, (now + job.stall + job.remaining() / job.speed, token, job.job_id))
            if nodes is not None:
                nodes.moved = []
        if used > capacity:
            raise AssertionError(f"{used} GPUs allocated of {capacity} at t={now}")
        if report is not None:
            report(done, len(running), now)
    if report is not None:
        report(done, 0, now, final=True)
    makespan = max((j.end_time for j in jobs), default=0.0) - (jobs[0].submit_time if jobs else 0.0)
    result = SimResult(policy.name, jobs, capacity, makespan, busy, preemptions,
                       time.perf_counter() - started_wall, events, timeline, config.placement,
                       overhead_seconds=overhead)
    if nodes is not None:
        result.placement_waits = nodes.waits
        result.repacks = nodes.repacks
        result.migrations = nodes.migrations
        result.migrations_naive = nodes.migrations_naive
    return result


def _union(a: list[JobState], b: list[JobState]) -> list[JobState]:
    seen = {j.job_id for j in a}
    return a + [j for j in b if j.job_id not in seen]


class _Nodes:
    """Node-level GPU state of the simulated cluster (mechanism around ``tiresias.placement``)."""

    def __init__(self, cluster: ClusterSpec, config: SimConfig) -> None:
        self.per = cluster.gpus_per_node
        self.count = cluster.nodes
        self.free = [self.per] * cluster.nodes
        self.alloc: dict[int, plc.Allocation] = {}
        self.config = config
        self.waits = 0
        self.repacks = 0
        self.migrations = 0
        self.migrations_naive = 0
        self.moved: list[JobState] = []      # running jobs migrated this event (new end times)

    def consolidate(self, job: JobState) -> bool:
        mode = self.config.placement
        return mode == "consolidate" or (mode == "tiresias" and plc.needs_consolidation(job.skew, self.config.packlimit))

    def release(self, job: JobState) -> plc.Allocation | None:
        alloc = self.alloc.pop(job.job_id, None)
        if alloc is not None:
            plc.apply(self.free, alloc, +1)
        return alloc

    def retake(self, job: JobState, alloc: plc.Allocation | None) -> bool:
        """Give ``job`` its released GPUs back if they are all still free."""
        if alloc is None or any(self.free[n] < g for n, g in alloc):
            return False
        plc.apply(self.free, alloc)
        self.alloc[job.job_id] = alloc
        return True

    def _take(self, job: JobState, alloc: plc.Allocation) -> None:
        plc.apply(self.free, alloc)
        self.alloc[job.job_id] = alloc
        consolidated = plc.is_consolidated(alloc, self.per)
        job.speed = ovh.placement_speed(job.skew, consolidated) if self.config.slowdown else 1.0

    def place_all(self, to_start: list[JobState], running: dict[int, JobState], now: float) -> list[JobState]:
        """Place admitted jobs, consolidated ones and larger ones first; return those placed."""
        placed = []
        order = sorted(to_start, key=lambda j: (not self.consolidate(j), -j.num_gpus, j.job_id))
        for job in order:
            alloc = plc.place(self.free, job.num_gpus, self.consolidate(job), self.per)
            if alloc is None and self.config.migrate:
                alloc = self._repack(job, running, now)
            if alloc is None:
                self.waits += 1
                continue
            self._take(job, alloc)
            placed.append(job)
        placed.sort(key=lambda j: j.job_id)
        return placed

    def _repack(self, job: JobState, running: dict[int, JobState], now: float) -> plc.Allocation | None:
        """Place every running job plus ``job`` from scratch; rename nodes to move the fewest."""
        members = [(j.job_id, j.num_gpus, self.consolidate(j)) for j in running.values()]
        members.append((job.job_id, job.num_gpus, True))
        # jobs placed earlier this pass are running-to-be: keep them in the repack too
        pending = [jid for jid in self.alloc if jid not in running and jid != job.job_id]
        members += [(jid, sum(g for _, g in self.alloc[jid]), True) for jid in pending]
        plan = plc.repack(members, self.count, self.per)
        if plan is None:
            return None
        old = {jid: self.alloc[jid] for jid in plan if jid in self.alloc}
        relabel, moved, naive = plc.migration_plan(old, plan, self.count)
        self.repacks += 1
        self.migrations += moved
        self.migrations_naive += naive
        new = {jid: [(relabel[n], g) for n, g in a] for jid, a in plan.items()}
        self.free = [self.per] * self.count
        self.alloc = {}
        for jid, alloc in new.items():
            if jid == job.job_id:
                continue
            changed = old.get(jid) is not None and sorted(old[jid]) != sorted(alloc)
            plc.apply(self.free, alloc)
            self.alloc[jid] = alloc
            moved_job = running.get(jid)
            if changed and moved_job is not None:
                moved_job.migrations += 1
                if self.config.overheads:
                    cost = ovh.preemption_cost(moved_job.model, moved_job.num_gpus)
                    moved_job.stall += cost
                    moved_job.overhead += cost
                moved_job.speed = (ovh.placement_speed(moved_job.skew, plc.is_consolidated(alloc, self.per))
                                   if self.config.slowdown else 1.0)
                self.moved.append(moved_job)
        return new[job.job_id]


def _progress_reporter(progress, total: int):
    """A callable ``(done, running, now, final=False)`` drawing a tqdm bar, or None."""
    if not progress:
        return None
    if callable(progress):
        return lambda done, run, now, final=False: progress(done, total, now)
    from tqdm import tqdm
    bar = tqdm(total=total, unit="job", desc="simulating", mininterval=0.5, leave=True)
    state = {"done": 0, "last": 0.0}

    def report(done: int, run: int, now: float, final: bool = False) -> None:
        t = time.perf_counter()
        if final or t - state["last"] > 0.5:
            bar.update(done - state["done"])
            state["done"] = done
            state["last"] = t
            bar.set_postfix_str(f"day {now / 86400:.1f}, running {run}", refresh=False)
            if final:
                bar.close()
    return report
