"""Node-level GPU state of the cluster: free GPUs per node, each job's allocation, placement
of admitted jobs (``tiresias.placement``), repacking with migration-minimizing renaming, and
a round's plan when GPUs are shared. The driver (``tiresias.driver``) owns one; this module
holds the mechanism, the rules are ``tiresias.placement`` and ``tiresias.packing``."""
from __future__ import annotations

from typing import Callable

from . import overheads as ovh
from . import placement as plc
from . import progress
from .cluster import ClusterSpec
from .driver_config import DriverConfig
from .policies.base import BY_ID, JobState, settle

Eligibility = Callable[[JobState], "list[bool] | None"]


class Nodes:
    """Node-level GPU state of the cluster (mechanism around ``tiresias.placement``)."""

    def __init__(self, cluster: ClusterSpec, config: DriverConfig) -> None:
        self.per = cluster.gpus_per_node
        self.count = cluster.nodes
        self.free = [self.per] * cluster.nodes
        self.offline: set[int] = set()
        self.alloc: dict[int, plc.Allocation] = {}
        self.config = config
        self.waits = 0
        self.repacks = 0
        self.migrations = 0
        self.migrations_naive = 0
        self.moved: list[JobState] = []      # running jobs migrated this pass (new end times)

    def set_online(self, node: int, online: bool) -> None:
        if not 0 <= node < self.count:
            raise ValueError(f"no node {node}")
        if online and node in self.offline:
            self.offline.discard(node)
            self.free[node] += self.per
        elif not online and node not in self.offline:
            self.offline.add(node)
            self.free[node] -= self.per       # may go negative while its jobs drain

    def consolidate(self, job: JobState) -> bool:
        mode = self.config.placement
        return mode == "consolidate" or (mode == "tiresias" and plc.needs_consolidation(job.skew, self.config.packlimit))

    def give_back(self, alloc: plc.Allocation, sign: int = +1) -> None:
        for node, g in alloc:
            self.free[node] += sign * g

    def release(self, job: JobState) -> plc.Allocation | None:
        alloc = self.alloc.pop(job.job_id, None)
        if alloc is not None:
            self.give_back(alloc)
        return alloc

    def retake(self, job: JobState, alloc: plc.Allocation | None) -> bool:
        """Give ``job`` its released GPUs back if they are all still free."""
        if alloc is None or any(self.free[n] < g for n, g in alloc):
            return False
        plc.apply(self.free, alloc)
        self.alloc[job.job_id] = alloc
        return True

    def _take(self, job: JobState, alloc: plc.Allocation) -> None:
        self.alloc[job.job_id] = alloc
        if len(alloc) == 1:                  # one node: consolidated, full speed
            node, gpus = alloc[0]
            if self.free[node] < gpus:
                raise AssertionError(f"node {node} over-allocated")
            self.free[node] -= gpus
            job.speed = 1.0
            return
        plc.apply(self.free, alloc)
        consolidated = plc.is_consolidated(alloc, self.per)
        job.speed = ovh.placement_speed(job.skew, consolidated) if self.config.slowdown else 1.0

    def assign(self, allocs: dict[int, plc.Allocation], busy: list[int]) -> None:
        """A round's plan (GPU sharing): every job's nodes, and GPUs busy per node (a shared
        GPU counts once)."""
        self.alloc = dict(allocs)
        self.free = [self.per - b - (self.per if n in self.offline else 0) for n, b in enumerate(busy)]

    def speed_on(self, job: JobState, alloc: plc.Allocation) -> float:
        """A job's speed alone on ``alloc`` (slower when spread and ``slowdown``)."""
        if len(alloc) <= 1 or not self.config.slowdown:
            return 1.0
        return ovh.placement_speed(job.skew, plc.is_consolidated(alloc, self.per))

    def migrate(self, job: JobState, now: float) -> None:
        """A running job moves to other GPUs (a round's plan): counted, and charged."""
        self.migrations += 1
        self._move(job, now)

    def _move(self, job: JobState, now: float) -> None:
        """A running job moves: with overheads it pauses and resumes, protected after."""
        settle(job, now)
        job.migrations += 1
        if self.config.overheads:
            cost = ovh.preemption_cost(job.model, job.num_gpus)
            job.stall += cost
            job.overhead += cost
            job.protected_until = progress.protected_until(now, cost, self.config.min_run_factor,
                                                           self.config.min_run)

    def _free_for(self, job: JobState, eligible: Eligibility | None) -> list[int]:
        free = [max(0, f) for f in self.free]
        mask = eligible(job) if eligible is not None else None
        if mask is not None:
            free = [f if ok else 0 for f, ok in zip(free, mask)]
        return free

    def place_all(self, to_start: list[JobState], running: dict[int, JobState], now: float,
                  eligible: Eligibility | None = None) -> list[JobState]:
        """Place admitted jobs, consolidated ones and larger ones first; return those placed."""
        placed = []
        order = to_start if len(to_start) < 2 else \
            sorted(to_start, key=lambda j: (not self.consolidate(j), -j.num_gpus, j.job_id))
        most_free = self.config.placement == "most-free"
        for job in order:
            free = self.free if eligible is None and not self.offline else self._free_for(job, eligible)
            if most_free:
                alloc = plc.place_most_free(free, job.num_gpus)
            else:
                alloc = plc.place(free, job.num_gpus, self.consolidate(job), self.per)
            if alloc is None and self.config.migrate:
                alloc = self._repack(job, running, now)
            if alloc is None:
                self.waits += 1
                continue
            self._take(job, alloc)
            placed.append(job)
        if len(placed) > 1:
            placed.sort(key=BY_ID)
        return placed

    def why_not(self, job: JobState, eligible: Eligibility | None, draining: bool) -> str:
        """Why an admitted job found no placement (for the operator)."""
        free = self._free_for(job, None)
        mask = eligible(job) if eligible is not None else None
        if mask is not None and not any(mask):
            return "no node has the memory it declared (free + lendable remote memory)"
        if mask is not None:
            usable = sum(f for f, ok in zip(free, mask) if ok)
            if usable < job.num_gpus <= sum(free):
                return "free GPUs are on nodes without the memory it declared"
        if sum(free) >= job.num_gpus and self.consolidate(job):
            need = plc.min_nodes(job.num_gpus, self.per)
            return (f"skew {job.skew:.2f} > PACKLIMIT {self.config.packlimit:.2f}: waits for "
                    f"{job.num_gpus} GPUs on {need} node(s) (free GPUs are fragmented)")
        if draining:
            return "waits for the GPUs of preempted jobs to be released"
        return "not enough free GPUs on online nodes"

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
                self._move(moved_job, now)
                moved_job.speed = (ovh.placement_speed(moved_job.skew, plc.is_consolidated(alloc, self.per))
                                   if self.config.slowdown else 1.0)
                self.moved.append(moved_job)
        return new[job.job_id]
