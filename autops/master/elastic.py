"""pMaster's elasticity: profiles, packing into clusters, revert, recycling and scaling.

This is the mechanism around the pure policy of ``assignment`` and ``scaling``
(thesis §4.3.3):

* **Profiling** (§4.3.3.1): a new job first runs on temporary aggregators of its own (as many
  as it asked for). Agents report iteration durations (one record per period), aggregators
  the CPU time of every key. After ``warmup`` + ``profile_iters`` iterations the standalone
  iteration duration ``D_j`` and the per-key CPU times ``e_t`` are known; ``e_t`` keeps being
  calibrated from the aggregators' reports while the job runs.
* **Assignment** (§4.3.3.2, §4.3.3.4): pMaster forwards the job to the best-fit cluster by free
  CPU (or opens a new one); that cluster's controller packs the job's keys with Pseudocode 3
  onto its aggregators, using the job's temporaries when it needs new ones, and live-migrates
  the keys. Temporaries left empty are released. A job that would need more aggregators than
  it asked for stays on its temporaries ("dedicated").
* **Feedback** (§4.3.3.3): when a packed job runs below ``(1 - LossLimit)`` of its standalone
  speed for ``window`` iterations, it is reverted: it moves to ``k`` aggregators of its own
  (``k`` = reverts so far, at most what it asked for), which are not used for packing.
* **Job exit and periods** (§4.3.3.3-4): empty aggregators are released at once; from the
  least-loaded one up, aggregators whose tasks fit elsewhere are drained and recycled; every
  ``period`` the same runs on every cluster, idle aggregators beyond ``spare`` are given back
  and empty clusters dissolve. Allocations below ``threshold`` aggregators wait for the next
  period (hybrid scaling).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..wire import protocol as wire
from .assignment import LOSS_LIMIT, busy_fraction, final_moves, job_demand, pack_job, recycle, spread_by_bytes
from .migration import Migrations
from .outbox import Outbox
from .pool import AggInfo, Clock, Cluster, JobInfo, PoolState
from .providers import Provider
from .scaling import admissible, allocate_now, choose_cluster, cluster_free_cpu, idle_to_release

log = logging.getLogger("autops.master.elastic")

EWMA = 0.3


def weighted_median(samples: list[tuple[int, float]]) -> float:
    """Median iteration duration over ``(iterations, mean duration)`` records."""
    ordered = sorted(samples, key=lambda s: s[1])
    half = sum(c for c, _ in ordered) / 2
    seen = 0
    for count, duration in ordered:
        seen += count
        if seen >= half:
            return duration
    return ordered[-1][1]


@dataclass
class ElasticConfig:
    enabled: bool = True
    loss_limit: float = LOSS_LIMIT
    warmup_iters: int = 3
    profile_iters: int = 10
    window: int = 100
    cluster_size: int = 8
    period: float = 10.0
    threshold: int = 1
    spare: int = 0
    job_timeout: float = 30.0          # no word from any worker: the job is gone
    job_idle_timeout: float = 1800.0   # words but no progress (pushes, new iterations): a squatter, or a long pause


class Elastic:
    """Drives jobs through profiling -> packed | dedicated and keeps the pool small.

    It changes the records of ``state`` (aggregator states, clusters, job tables through
    ``migrations``), tells aggregators their cycles through ``outbox``, starts and stops
    aggregators through ``provider``, and reads time from ``clock``. What pMaster itself must
    do (answer waiting ranks, release timed-out jobs) it returns.
    """

    def __init__(self, state: PoolState, outbox: Outbox, config: ElasticConfig, provider: Provider,
                 migrations: Migrations, clock: Clock | None = None) -> None:
        self.state = state
        self.outbox = outbox
        self.cfg = config
        self.provider = provider
        self.migrations = migrations
        self.clock = clock or state.clock
        self.next_period = self.clock() + config.period
        self.pending_reverts: list[str] = []

    # --- bookkeeping helpers -----------------------------------------------------------
    def empty(self, agg: str) -> bool:
        """No key of any job on ``agg``, none moving to it, no migration from or to it, no
        replica on it, and no job given it that has not declared its keys yet (a job that
        shares a busy aggregator is given it at registration and declares a moment later)."""
        return not self.state.tasks_on(agg) and not self.migrations.active(aggs={agg}) \
            and not any(agg in job.replicas.values() or (not job.keys and agg in job.aggregators)
                        for job in self.state.jobs.values())

    def capacity(self) -> int | None:
        return self.provider.capacity(len(self.state.live_aggregators()))

    # --- job arrival ---------------------------------------------------------------------
    def refuse_reason(self, requested: int) -> str | None:
        """Admission control (§4.3.3.5): None when the job's worst case can be met."""
        if requested <= 0:
            return None
        cap = self.capacity()
        busy = self.state.busy_count()
        if not admissible(requested, cap, busy):
            return (f"admission refused: the job asks for {requested} aggregator(s) (its worst case) but "
                    f"the pool can give {max(0, cap - busy)} now ({busy} busy of {cap}); retry later, ask for "
                    f"fewer, or add aggregators (`autops aggregator --master ...` or --max-aggregators)")
        return None

    def reserve(self, job: JobInfo) -> None:
        """Temporary aggregators for a new job (profiling); some may still be starting."""
        if not self.cfg.enabled:
            job.state = "dedicated"
        want = job.requested
        idle = self.state.idle()
        if want == 0:
            take = idle
            if not take:
                started = self.provider.start(1)
                if started:
                    job.pending = set(started)
                    return
                live = self.state.live_aggregators()
                if not live:
                    raise ValueError("no aggregator is registered with this master; start one with "
                                     "`autops aggregator --master ADDRESS`")
                load = self.state.load_bytes()
                shared = min(live, key=lambda a: (load.get(a.agg_id, 0), a.agg_id))
                job.aggregators = [shared.agg_id]
                job.best_effort = True
                job.state = "best-effort"
                log.info("job %s shares %s (no idle aggregator, no reservation asked for)", job.job, shared.agg_id)
                return
        else:
            take = idle[:want]
        for a in take:
            a.state, a.reserved_for, a.cluster = ("temporary" if self.cfg.enabled else "active"), job.job, None
        job.aggregators = [a.agg_id for a in take]
        job.temps = list(job.aggregators)
        short = want - len(take)
        if short > 0:
            started = self.provider.start(short)
            job.pending = set(started)
            if len(started) < short:
                log.warning("job %s: only %d of %d aggregators could be started", job.job,
                            len(take) + len(started), want)

    def aggregator_registered(self, agg: AggInfo) -> JobInfo | None:
        """A new aggregator: a temporary of the job that waited for it, else idle. Returns the
        job whose temporaries are now all up (pMaster answers its waiting ranks)."""
        for job in self.state.jobs.values():
            if agg.agg_id in job.pending:
                job.pending.discard(agg.agg_id)
                agg.state, agg.reserved_for = "temporary", job.job
                job.aggregators.append(agg.agg_id)
                job.temps.append(agg.agg_id)
                return None if job.pending else job
        if agg.state not in ("idle", "temporary", "active", "draining"):
            agg.state = "idle"
        return None

    # --- profiles ------------------------------------------------------------------------
    def on_profile(self, job: JobInfo, msg: wire.Message) -> None:
        count, duration = int(msg["count"]), msg.get("duration")
        iteration = int(msg["iteration"])
        job.last_heard = self.clock()           # its workers are there
        if count > 0 and iteration > job.iterations:
            job.last_progress = job.last_heard  # and it moves on (see ``expired_jobs``)
        job.iterations = max(job.iterations, iteration)
        if count <= 0 or not isinstance(duration, (int, float)) or duration <= 0:
            return
        job.rank_d[msg["rank"]] = float(duration)
        job.measured = max(job.rank_d.values())
        if msg["rank"] != (min(job.ranks) if job.ranks else 0):
            return                      # one rank's records drive the job's profile (rank 0's for a job
                                        # adopted after a restart, whose ranks have not registered again)
        if job.state == "profiling" and job.iterations > self.cfg.warmup_iters:
            job.samples.append((count, float(duration)))
            job.standalone = weighted_median(job.samples)
            job.profiled = sum(c for c, _ in job.samples)
        elif job.state in ("packed", "dedicated") and job.standalone:
            # calibration: the profile is the job's best case; a faster period lowers it (it was
            # taken while something else, e.g. another job's migration, slowed the machine)
            if duration < job.standalone:
                job.standalone = (1 - EWMA) * job.standalone + EWMA * duration
            if job.state != "packed":
                return
            job.recent.append((count, float(duration)))
            while sum(c for c, _ in job.recent) - job.recent[0][0] >= self.cfg.window:
                job.recent.popleft()
            seen = sum(c for c, _ in job.recent)
            mean = sum(c * d for c, d in job.recent) / seen
            job.low_iters = seen if job.standalone / mean < 1 - self.cfg.loss_limit else 0
            if seen >= self.cfg.window and job.low_iters and not self.migrations.active(job=job.job):
                self.revert(job)

    def on_aggregator_profile(self, profile: dict) -> None:
        for job_id, keys in (profile or {}).items():
            job = self.state.jobs.get(job_id)
            if job is None or not isinstance(keys, dict):
                continue
            for key, entry in keys.items():
                try:
                    cpu, iters = float(entry[0]), int(entry[1])
                except (TypeError, ValueError, IndexError):
                    continue
                if iters <= 0 or key not in job.keys:
                    continue
                job.last_heard = job.last_progress = self.clock()   # pushes and pulls on its aggregators
                e = cpu / iters
                old = job.e.get(key)
                job.e[key] = e if old is None else (1 - EWMA) * old + EWMA * e
            job.e_reports += 1

    # --- the periodic driver -------------------------------------------------------------
    def expired_jobs(self, now: float) -> list[str]:
        """Jobs pMaster releases: those none of whose workers was heard from for ``job_timeout``
        (their workers are gone), and those that made no progress for ``job_idle_timeout``.
        Progress is a profile record of iterations past the job's last, or an aggregator's report
        of pushes and pulls of its keys; registering again and records of no new iterations are
        not, so a job id held by someone who only keeps talking (a squatter) loses its
        aggregators after the idle timeout, while a job in a long evaluation or checkpoint phase
        (its workers still send their records) keeps them that long."""
        expired = []
        for job in self.state.jobs.values():
            # a job adopted after a restart counts as heard from when adopted, and by its profiles
            if not (job.ranks or job.adopted):
                continue
            if now - job.last_heard > self.cfg.job_timeout:
                log.warning("job %s: no worker heard from for %.0fs; releasing it", job.job, now - job.last_heard)
                expired.append(job.job)
            elif now - job.last_progress > self.cfg.job_idle_timeout:
                log.warning("job %s: no progress (pushes, new iterations) for %.0fs; releasing it", job.job,
                            now - job.last_progress)
                expired.append(job.job)
        return expired

    def tick(self, now: float) -> None:
        """Pack the jobs whose profile is complete; every ``period`` run ``period_pass``."""
        if not self.cfg.enabled:
            return
        for job in list(self.state.jobs.values()):
            if (job.state == "profiling" and not job.best_effort and not job.pending and job.keys
                    and job.profiled >= self.cfg.profile_iters and job.e_reports >= 2
                    and not job.parked and not self.migrations.active(job=job.job)):
                self.pack(job)
        if now >= self.next_period:
            self.next_period = now + self.cfg.period
            self.period_pass()

    # --- packing (arrival) ---------------------------------------------------------------
    def pack(self, job: JobInfo) -> None:
        costs = [job.cost(k) for k in job.keys]
        demand = job_demand(job.standalone, costs)
        state = self.state
        free = {c.name: cluster_free_cpu(state.loads(state.cluster_aggs(c)), self.cfg.cluster_size)
                for c in state.clusters.values()}
        name = choose_cluster(free, demand)
        cluster = state.clusters.get(name) if name else None
        candidates = state.cluster_aggs(cluster) if cluster else []
        temps = [a for a in job.temps if a in state.aggs]
        result = pack_job(job.job, job.standalone, [(k, job.cost(k)) for k in job.keys], state.loads(candidates),
                          lambda i: temps[i] if i < len(temps) else f"+{i}")
        table, opened = result
        if any(a not in temps for a in opened) or not temps and opened:
            job.state = "dedicated"
            for a in temps:
                self.state.aggs[a].state, self.state.aggs[a].exclusive = "active", job.job
            cluster = cluster or self.state.open_cluster()
            cluster.aggs.update(temps)
            cluster.jobs.add(job.job)
            job.cluster = cluster.name
            log.info("job %s needs more aggregators than it asked for; it keeps its %d", job.job, len(temps))
            self.update_cycles(temps)
            return
        cluster = cluster or self.state.open_cluster()
        cluster.jobs.add(job.job)
        job.cluster = cluster.name
        for a in opened:
            info = self.state.aggs[a]
            info.state, info.reserved_for, info.cluster = "active", None, cluster.name
            cluster.aggs.add(a)
        job.state = "packed"
        job.low_iters = 0
        job.recent.clear()
        job.aggregators = sorted(set(table.values()))
        log.info("job %s (D=%.3fs, demand %.2f aggregators) packed into cluster %s on %s (asked for %d)",
                 job.job, job.standalone, demand, cluster.name, job.aggregators, job.requested)
        leftovers = [a for a in temps if a not in opened]
        self.migrate(job, table, after=leftovers)

    def migrate(self, job: JobInfo, table: dict[str, str], after: list[str] = ()) -> None:
        """Move keys; when all batches are done refresh cycles and release ``after`` if empty."""
        involved = set(table.values()) | {job.table[k] for k in table if k in job.table}
        left = {"n": 0}

        def done(batch, ok):
            left["n"] -= 1
            if left["n"] == 0:
                self._settle(job.job, involved, after)

        mids = self.migrations.start(job, table, on_done=done)
        left["n"] = len(mids)
        homes = [a for a in job.aggregators if a in self.state.aggs]
        if homes and job.home not in homes:
            job.home = homes[0]
        if not mids:
            self._settle(job.job, involved, after)

    def _settle(self, job_id: str, involved: set, release: list[str]) -> None:
        self.update_cycles(involved)
        for a in release:
            info = self.state.aggs.get(a)
            if info is not None and self.empty(a):
                self.release_aggregator(a)

    # --- feedback ----------------------------------------------------------------------
    def revert(self, job: JobInfo, force: bool = False) -> None:
        job.reverts += 1
        k = max(1, min(job.reverts, job.requested or 1))
        idle = self.state.idle()
        if len(idle) + self.provider.can_start(0) < k:
            log.warning("job %s runs %.0f%% slower than standalone but no aggregator is free to revert it",
                        job.job, 100 * (1 - job.standalone / job.measured))
            job.reverts -= 1
            job.low_iters = 0
            job.recent.clear()
            return
        if not allocate_now(k, self.cfg.threshold) and not force:
            if job.job not in self.pending_reverts:
                self.pending_reverts.append(job.job)     # hybrid scaling: at the next period
            job.reverts -= 1
            return
        log.info("job %s ran below %.0f%% of its standalone speed for %d iterations: reverting onto %d "
                 "aggregator(s) of its own", job.job, 100 * (1 - self.cfg.loss_limit), job.low_iters, k)
        job.low_iters = 0
        job.recent.clear()
        take = [a.agg_id for a in idle[:k]]
        started = self.provider.start(k - len(take)) if len(take) < k else []
        if started:
            job.revert_waiting = (k, take, set(started))
            for a in take:
                self.state.aggs[a].state, self.state.aggs[a].exclusive = "active", job.job
            return
        if not take:
            log.warning("job %s: no aggregator could be had to revert it", job.job)
            job.reverts -= 1
            return
        self._revert_onto(job, take)

    def _revert_onto(self, job: JobInfo, aggs: list[str]) -> None:
        cluster = self.state.clusters.get(job.cluster) or self.state.open_cluster()
        job.cluster = cluster.name
        for a in aggs:
            info = self.state.aggs[a]
            info.state, info.exclusive, info.cluster, info.reserved_for = "active", job.job, cluster.name, None
            cluster.aggs.add(a)
        old = {job.table[k] for k in job.keys}
        table = spread_by_bytes([(k, job.cost(k) or job.keys[k].nbytes * 1e-10) for k in job.keys], aggs)
        job.state = "dedicated"
        job.aggregators = sorted(aggs)
        self.migrate(job, table, after=sorted(old - set(aggs)))

    def registered_for_revert(self, agg: AggInfo) -> bool:
        for job in self.state.jobs.values():
            waiting = job.revert_waiting
            if waiting and agg.agg_id in waiting[2]:
                waiting[2].discard(agg.agg_id)
                waiting[1].append(agg.agg_id)
                agg.state, agg.exclusive = "active", job.job
                if not waiting[2]:
                    job.revert_waiting = None
                    self._revert_onto(job, waiting[1])
                return True
        return False

    # --- job exit and periods --------------------------------------------------------------
    def release_job(self, job_id: str) -> bool:
        """A job ended (all ranks done, or timed out): forget it and its migrations, tell its
        aggregators, then release or recycle what it leaves. False when it is not known."""
        job = self.state.jobs.pop(job_id, None)
        if job is None:
            return False
        self.migrations.forget_job(job_id)
        for agg_id in set(job.aggregators) | job.touched:
            self.outbox.send_agg(agg_id, wire.RELEASE_JOB, None, job=job_id)
        self.job_released(job)
        return True

    def job_released(self, job: JobInfo) -> None:
        cluster = self.state.clusters.get(job.cluster) if job.cluster else None
        if cluster is not None:
            cluster.jobs.discard(job.job)
        for a in set(job.touched) | set(job.temps) | set(job.aggregators):
            info = self.state.aggs.get(a)
            if info is None:
                continue
            if info.exclusive == job.job:
                info.exclusive = None
            if info.reserved_for == job.job:
                info.reserved_for = None
            if self.empty(a) and info.state != "idle":
                self.release_aggregator(a)
        if self.cfg.enabled and cluster is not None:
            self.update_cycles(cluster.aggs)
            self.recycle_cluster(cluster)

    def release_aggregator(self, agg: str) -> None:
        info = self.state.aggs.get(agg)
        if info is None:
            return
        for cluster in self.state.clusters.values():
            cluster.aggs.discard(agg)
        info.state, info.cluster, info.exclusive, info.reserved_for, info.busy = "idle", None, None, None, None
        self.outbox.send_agg(agg, wire.CYCLE, None, jobs={})
        idle = [a for a in self.state.idle() if self.provider.owns(a.agg_id)]
        if self.provider.owns(agg) and len(idle) > self.cfg.spare:
            self.provider.stop(agg)
            self.state.forget_aggregator(agg)
        log.info("aggregator %s released", agg)

    def recycling_plan(self, cluster: Cluster) -> tuple[list[str], dict[str, dict[str, str]]]:
        """The recycling decision for ``cluster`` (``assignment.recycle``, applied whole): the
        aggregators to drain, in order, and job -> key -> aggregator for the keys that move."""
        aggs = self.state.cluster_aggs(cluster)
        loads = self.state.loads(aggs)
        tasks: dict[str, list] = {a: [] for a in aggs}
        durations = {}
        for job in self.state.jobs.values():
            if job.standalone is None:
                continue
            durations[job.job] = job.standalone
            for key, owner in job.table.items():
                if owner in tasks:
                    tasks[owner].append((job.job, (job.job, key), job.cost(key)))   # ids unique across jobs
        plan = recycle(loads, tasks, durations, self.cfg.loss_limit)
        by_job: dict[str, dict[str, str]] = {}
        for (job_id, key), dest in final_moves(plan).items():
            by_job.setdefault(job_id, {})[key] = dest
        return [victim for victim, _ in plan], by_job

    def recycle_cluster(self, cluster: Cluster) -> None:
        """Drain and release the aggregators ``recycling_plan`` names (not while keys move there)."""
        if self.migrations.active(aggs=cluster.aggs):
            return
        victims, by_job = self.recycling_plan(cluster)
        if not victims:
            return
        for victim in victims:
            self.state.aggs[victim].state = "draining"
        log.info("recycling aggregator(s) %s: %d tasks move elsewhere", victims,
                 sum(len(t) for t in by_job.values()))
        for job_id, table in by_job.items():
            job = self.state.jobs[job_id]
            job.aggregators = sorted({table.get(k, job.table[k]) for k in job.keys})
            self.migrate(job, table, after=victims)

    def period_pass(self) -> None:
        for job_id in list(self.pending_reverts):
            self.pending_reverts.remove(job_id)
            job = self.state.jobs.get(job_id)
            if job is not None and job.state == "packed":
                self.revert(job, force=True)
        for cluster in list(self.state.clusters.values()):
            aggs = self.state.aggs
            loads = self.state.loads([a for a in cluster.aggs if a in aggs and aggs[a].state == "active"])
            for a in idle_to_release({a: j for a, j in loads.items() if self.empty(a)}, self.cfg.spare):
                self.release_aggregator(a)
            self.recycle_cluster(cluster)
            if not cluster.aggs and not cluster.jobs:
                del self.state.clusters[cluster.name]

    # --- cycles --------------------------------------------------------------------------
    def update_cycles(self, aggs) -> None:
        loads = self.state.loads([a for a in aggs if a in self.state.aggs])
        for agg, jobs in loads.items():
            self.outbox.send_agg(agg, wire.CYCLE, None, jobs={j: [d, e] for j, (d, e) in jobs.items()})
            self.state.aggs[agg].busy = busy_fraction(jobs) if jobs else 0.0
