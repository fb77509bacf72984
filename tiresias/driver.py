"""The one driver of scheduling policies, shared by the simulator and the live master.

It owns what neither a policy nor a clock should: the ``JobState`` records, node and GPU
state, lifecycle transitions (submit, start, preempt, finish, cancel), attained-service
accounting and the application of the policy's own state changes (demotions at a
threshold, promotions). A caller advances it to a time (``advance``: the simulator's
virtual clock, the master's real one), tells it what happened (``submit``, ``finish``,
``released``, node changes) and asks for a pass (``schedule``), which runs the policy's
``allocate`` and the placement and applies the decision.

Placement (``DriverConfig.placement``):

* ``count``: GPUs counted cluster-wide, no nodes — the original Tiresias simulator;
* ``tiresias``: consolidate jobs whose skew exceeds ``packlimit``, others where they limit
  fragmentation (``tiresias.placement``); a job admitted by count that cannot be consolidated
  waits for the next pass (or, with ``migrate``, the running jobs are repacked and renamed
  onto nodes with Tesserae's migration-minimizing matching);
* ``consolidate``: every job consolidated (YARN-CS' constraint); ``spread``: none is;
  ``most-free``: Pollux's simulator's (GPUs from the node with the most free first), to
  compare with its published figures.

GPU sharing (``DriverConfig.packing``, Tesserae; ``tiresias.packing``): passes come in rounds
(``decide_every``); each round the policy's order is planned on GPU slots (a GPU holds up to
two jobs; a job keeps its GPUs when they are free), pending jobs are packed onto placed ones by
matching over the co-location profile (``sharing``), and the plan is renamed onto the previous
one so that few jobs move; a packed job runs at its profiled speed, its partner alone again
once it leaves (``finish``).

Accounting is lazy: a running job's attained service, execution and stall are settled
(``settle``) when it stops, when the policy changes it, when it is moved, and before a pass
of a policy whose keys read them (``reads_running_progress``); between those, advancing the
clock costs nothing per job. Whether any job executed (the stall detector's
``last_progress``) is noted when a job stops or its stall changes, and for the jobs still
running only when asked (``progress``). The live master settles every running job at each
``advance`` (it shows them).

Costs (``tiresias.overheads``, simulator only): a resumed job stalls for its pause + resume
time (``overheads``); a multi-GPU job placed on more nodes than it needs runs slower by its
skew (``slowdown``).

Progress guarantee (``tiresias.progress``, simulator and live master): a job (re)started at
``s`` with resume cost ``r`` keeps its GPUs until ``s + max(min_run, min_run_factor x r)``
whatever its priority; ``r`` is the charged pause + resume in the simulator (0 without
overheads) and the modelled or measured one live, where the cost is real. A pass that spares
a protected job asks for another pass when its protection ends (``next_change``).

Live mode (``defer_release``): a preempted job keeps its GPUs ("draining") until the caller
says its processes are gone (``released``); a pass admits jobs onto GPUs that are free now,
so a job that needs a stopping job's GPUs starts at the pass after they drain. Nodes can go
offline (their jobs are preempted) and a job can be confined to some nodes (``eligible``,
e.g. where its declared memory fits); jobs admitted but not placeable carry a reason.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable

from . import overheads as ovh
from . import placement as plc
from . import progress
from .cluster import ClusterSpec
from .driver_config import PLACEMENTS, DriverConfig
from .nodes import Eligibility, Nodes
from .packing.guests import Guests
from .packing.matching import Candidate, pack, pack_greedy
from .packing.rounds import RoundJob, plan_round
from .packing.slots import GpuSlots, Sharing
from .policies.base import INF, Change, JobState, Policy, allocate, settle

EPS = 1e-9
__all__ = ["EPS", "PLACEMENTS", "Decision", "Driver", "DriverConfig", "settle"]


@dataclass
class Decision:
    """What a pass changed: jobs started, jobs preempted, running jobs moved (repack)."""
    started: list[JobState] = field(default_factory=list)
    stopped: list[JobState] = field(default_factory=list)
    moved: list[JobState] = field(default_factory=list)


class Driver:
    """Job and cluster state around one ``Policy``; see the module docstring."""

    def __init__(self, policy: Policy, cluster: ClusterSpec, config: DriverConfig | None = None,
                 start: float = 0.0, eligible: Eligibility | None = None, sharing: Sharing | None = None,
                 true_sharing: Sharing | None = None) -> None:
        self.policy = policy
        self.cluster = cluster
        self.config = config or DriverConfig()
        self.sharing = sharing                      # GPU sharing decides with these pair speeds
        self.true_sharing = true_sharing or sharing   # ... and packed jobs run at these
        self.slots = GpuSlots(cluster.nodes, cluster.gpus_per_node) if self.config.packing else None
        self._held: dict[int, frozenset[tuple[int, int]]] = {}   # live sharing: GPUs of stopped runs
        self._next_round = -INF                                  # live sharing: when the next round is due
        self._guest_of = Guests()     # allocation + sharing: a guest job -> the job whose GPUs it shares
        self._guest_wait: dict[int, tuple[int, float, float]] = {}   # live: guest -> (host, speeds) once it exited
        self._drain_pair: dict[int, int] = {}   # live: a stopped host -> its stopped guest, still on its GPUs
        self.capacity = cluster.total_gpus
        self.nodes = None if self.config.placement == "count" else Nodes(cluster, self.config)
        self.eligible = eligible
        self.jobs: dict[int, JobState] = {}
        self.running: dict[int, JobState] = {}
        self.draining: dict[int, plc.Allocation] = {}     # preempted, GPUs not given back yet
        self.reasons: dict[int, str] = {}                 # admitted by count, not placeable
        self.now = start
        self.used = 0
        self.busy = 0.0
        self.preemptions = 0
        self.overhead = 0.0
        self.last_progress = start          # a time a job executed or none was active (``progress``)
        self.guard_wake = INF               # when a job a pass spared loses its protection
        self._stall_end: dict[int, float] = {}           # running job -> its current stall end
        self._guards: list[tuple[float, int]] = []       # heap: (protected_until, id) of started jobs
        self._shield: dict[int, float] = {}              # running job -> its protection's end (future)
        self._costs: dict[tuple, float] = {}             # (model, GPUs) -> the model's resume cost
        self._awaiting: dict[int, tuple[int, int]] = {}  # live: a round's targets not started yet

    # --- time ----------------------------------------------------------------------------
    def advance(self, t: float) -> None:
        """Move the clock to ``t``: GPU busy time is accounted now, each running job's service
        and execution when it is settled (``settle``), whether it executed when it stops or
        when asked (``progress``)."""
        dt = t - self.now
        if dt <= 0:
            return
        if not self.policy.active:
            self.last_progress = t          # nothing to run: not a stall
        self.busy += self.used * dt
        self.now = t
        if self.config.defer_release:
            self.settle_all()

    def settle_all(self) -> None:
        """Account every running job's service and execution up to ``now``."""
        now = self.now
        for job in self.running.values():
            settle(job, now)

    def progress(self) -> float:
        """The last time a job executed, or none was active (the stall detector's measure):
        ``now`` when a running job's stall ended before it. Costs the running jobs when the
        last one noted is older than ``now``."""
        now = self.now
        if self.last_progress < now and any(end < now for end in self._stall_end.values()):
            self.last_progress = now
        return self.last_progress

    def _track(self, job: JobState) -> None:
        """``job`` runs with ``stall`` seconds left from ``settled``: when it executes again."""
        end = self._stall_end.get(job.job_id)
        if end is not None and end < self.now:
            self.last_progress = self.now       # it executed until now (its stall changes)
        self._stall_end[job.job_id] = job.settled + job.stall

    def _untrack(self, job: JobState) -> None:
        settle(job, self.now)
        end = self._stall_end.pop(job.job_id, None)
        if end is not None and end < self.now:
            self.last_progress = self.now       # it executed until it stopped
        self._shield.pop(job.job_id, None)      # a job that stopped keeps no GPUs

    def next_change(self) -> float:
        t = self.policy.next_change(self.running.values(), self.now)
        return t if self.guard_wake <= self.now or t < self.guard_wake else self.guard_wake

    def resume_cost(self, job: JobState) -> float:
        """Seconds ``job`` loses to a pause and resume: charged by the simulator with
        ``overheads`` (else 0), real in the live master (the measured cost, else the model)."""
        if not (self.config.overheads or self.config.defer_release):
            return 0.0
        cost = self.config.preemption_cost
        if cost is not None:
            return cost
        key = (job.model, job.num_gpus)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = ovh.preemption_cost(job.model, job.num_gpus)
        return cost

    def _guard(self, job: JobState) -> None:
        if job.protected_until > self.now:
            heapq.heappush(self._guards, (job.protected_until, job.job_id))
            self._shield[job.job_id] = job.protected_until
        else:
            self._shield.pop(job.job_id, None)

    def _expire(self, limit: float) -> None:
        """Protections that end by ``limit`` are over."""
        heap, shield = self._guards, self._shield
        while heap and heap[0][0] <= limit:
            until, jid = heapq.heappop(heap)
            if shield.get(jid) == until:
                del shield[jid]

    def _protected(self, limit: float) -> frozenset[int]:
        """The running jobs protected past ``limit`` (the progress guarantee)."""
        self._expire(limit)
        running = self.running
        return frozenset(jid for until, jid in self._guards
                         if jid in running and running[jid].protected_until == until)

    def _shielded(self, limit: float) -> frozenset[int]:
        """The same jobs as ``_protected`` (for a pass, where their order does not matter)."""
        self._expire(limit)
        return frozenset(self._shield)

    # --- lifecycle -------------------------------------------------------------------------
    def submit(self, job: JobState) -> None:
        if job.num_gpus > self.capacity:
            raise ValueError(f"job {job.job_id} needs {job.num_gpus} GPUs; the cluster has {self.capacity}")
        self.jobs[job.job_id] = job
        self.policy.add(job, self.now)

    def finish(self, job: JobState) -> list[JobState]:
        """A running job completed: it leaves the cluster and the policy. Returns the running
        jobs whose speed changed (a partner that shared its GPUs now runs alone)."""
        self._untrack(job)
        job.running = False
        self.policy.remove(job, self.now)      # first: a job that left is not filed as waiting
        self.policy.stopped(job, self.now)
        job.end_time = self.now
        del self.running[job.job_id]
        self.used -= job.num_gpus
        alloc = self.nodes.alloc.get(job.job_id, []) if self.nodes is not None else []
        if self.nodes is not None:
            self.nodes.release(job)
        if self.slots is None:
            return []
        if self.policy.allocates:
            return self._left_allocated(job, alloc)
        return self._left_slots([job])

    def remove(self, job: JobState) -> None:
        """A job leaves for good (cancelled, failed): running, draining or waiting."""
        if job.running:
            self.finish(job)
        else:
            self.released(job)
            job.end_time = self.now
            self.policy.remove(job, self.now)
            self._leave_plan(job)
        self.reasons.pop(job.job_id, None)

    def released(self, job: JobState) -> None:
        """A preempted job's processes are gone: its draining GPUs are free again (a guest
        stopped with it still on them: once that one's are gone too)."""
        alloc = self.draining.pop(job.job_id, None)
        guest = self._drain_pair.pop(job.job_id, None)
        for host, other in list(self._drain_pair.items()):
            if other == job.job_id:
                del self._drain_pair[host]
        if alloc and guest is not None and guest in self.draining:
            self.draining[guest] = alloc
        elif alloc is not None and self.nodes is not None:
            self.nodes.give_back(alloc)
        if self._held.pop(job.job_id, None) is not None:
            self._sync_slots()

    def preempt(self, job: JobState) -> None:
        """Stop a running job outside a pass (e.g. its node was lost)."""
        self._stop([job])

    def abort_start(self, job: JobState) -> None:
        """A job this pass started could not be launched (or its run asked to be requeued):
        back to waiting, GPUs free at once (not a preemption); with GPU sharing under an
        allocation policy, a guest on its GPUs keeps them (``_left_allocated``)."""
        self._untrack(job)
        job.running = False
        job.wait_since = self.now
        self.policy.stopped(job, self.now)
        del self.running[job.job_id]
        self.used -= job.num_gpus
        alloc = self.nodes.alloc.get(job.job_id, []) if self.nodes is not None else []
        if self.nodes is not None:
            self.nodes.release(job)
        if self.slots is not None and self.policy.allocates:
            self._left_allocated(job, alloc)

    def withdraw(self, job: JobState) -> None:
        """Take a job out of scheduling for good (cancelled). A running or draining one keeps
        its GPUs until ``released``."""
        if job.running:
            self._stop([job])
        self.policy.remove(job, self.now)
        self.reasons.pop(job.job_id, None)
        self._leave_plan(job)

    def _leave_plan(self, job: JobState) -> None:
        """GPU sharing: a job that left for good (not running) gives up its planned GPUs."""
        if self.slots is not None and not job.running:
            self.slots.release(job.job_id)    # a stopped run's GPUs stay held until ``released``

    def restore(self, job: JobState, alloc: plc.Allocation | None, draining: bool = False,
                gpus: list[tuple[int, list[int]]] | None = None, host: int | None = None) -> None:
        """A restarted master re-attaches a job found running (or draining) on ``alloc``; with
        GPU sharing, ``gpus`` names its very GPUs (a partner's run may hold them too), and
        under an allocation policy ``host`` the job restored earlier whose GPUs these are."""
        self.submit(job)
        if alloc is None:
            return
        if host is not None and self.policy.allocates:
            if draining:
                self.draining[job.job_id] = []
                if host in self.draining:
                    self._drain_pair[host] = job.job_id
                return
            if host in self.running:
                self._guest_of[job.job_id] = host
                self.used -= job.num_gpus        # on its host's GPUs
            elif self.nodes is not None:         # its host stopped and left it the GPUs
                self.nodes.alloc[job.job_id] = self.draining.get(host) or alloc
                self.draining[host] = []
            job.running = True
            job.settled = self.now
            self._track(job)
            self._guard(job)
            self.running[job.job_id] = job
            self.used += job.num_gpus
            self.policy.started(job, self.now)
            return
        if self.nodes is not None:
            self.nodes.give_back(alloc, sign=-1)
        if draining:
            self.draining[job.job_id] = alloc
            self._restore_slots(job, gpus, draining)
            return
        if self.nodes is not None:
            self.nodes.alloc[job.job_id] = alloc
        job.running = True
        job.settled = self.now
        self._track(job)
        self._guard(job)
        self.running[job.job_id] = job
        self.used += job.num_gpus
        self.policy.started(job, self.now)
        self._restore_slots(job, gpus, draining)

    def _restore_slots(self, job: JobState, gpus: list[tuple[int, list[int]]] | None, draining: bool) -> None:
        if self.slots is None or not gpus:
            return
        cells = frozenset((node, g) for node, ids in gpus for g in ids)
        if draining:
            self._held[job.job_id] = cells
        else:
            self.slots.add(job.job_id, cells)
        self._sync_slots()

    # --- the pass --------------------------------------------------------------------------
    def apply_changes(self) -> None:
        """Apply the policy's due changes (demotions, promotions) to the jobs."""
        now = self.now
        while (change := self.policy.due(now)) is not None:
            if change.job.running:
                settle(change.job, now)
            _apply(change, now)
            self.policy.changed(change, now)

    def schedule(self) -> Decision:
        """One scheduling pass at ``now``: policy order, placement, start and stop."""
        now = self.now
        self.apply_changes()
        if self.policy.allocates:
            return self._schedule_allocations()
        if self.slots is not None:
            return self._schedule_round()
        if self.policy.reads_running_progress:
            self.settle_all()
        if self.config.defer_release:
            to_start, to_stop = self._pass_live()
        else:
            to_start, to_stop = self._allocate(self.capacity)
            if self.nodes is not None:
                # place the admitted jobs on the GPUs the preempted ones free; a preempted job
                # whose GPUs nobody could use after all (placement blocked) keeps running
                nodes = self.nodes
                held = {job.job_id: nodes.release(job) for job in to_stop}
                if self.config.migrate:      # a repack moves the running jobs that stay
                    stopping = {job.job_id for job in to_stop}
                    staying = {jid: j for jid, j in self.running.items() if jid not in stopping}
                else:
                    staying = {}
                if to_start:
                    to_start = nodes.place_all(to_start, staying, now)
                if held:
                    to_stop = [job for job in to_stop if not nodes.retake(job, held[job.job_id])]
        self._stop(to_stop)
        for job in to_start:
            self._start(job)
        moved: list[JobState] = []
        if self.nodes is not None and self.nodes.moved:
            moved, self.nodes.moved = self.nodes.moved, []
            for job in moved:
                self._track(job)
                self._guard(job)
        if self.used > self.capacity:
            raise AssertionError(f"{self.used} GPUs allocated of {self.capacity} at t={now}")
        return Decision(to_start, to_stop, moved)

    def _schedule_allocations(self) -> Decision:
        """A round of an allocation policy (``tiresias.policies.elastic``): jobs whose GPU count
        changes are stopped and started again at the new count, jobs whose aggregator count
        alone changes keep running at their new speed (``Decision.moved``: new end times).
        Protected jobs (progress guarantee) keep their counts. Live, a job the round could not
        start (its last run still draining, or GPUs that stopping runs still hold) starts at
        the first pass that can place it before the next round; the simulator, with nothing
        draining, leaves it for the next round as Optimus does. With GPU sharing, the jobs the
        round left without GPUs are then packed onto running ones (``_pack_allocated``)."""
        now, policy = self.now, self.policy
        self.settle_all()
        limit = now + EPS * max(1.0, abs(now))
        keep = {jid: (self.running[jid].num_gpus, self.running[jid].aggregators) for jid in self._protected(limit)
                if jid not in self._guest_of}
        capacity = {"gpu": float(self.capacity - sum(w for w, _ in keep.values())),
                    "cpu": float(self.cluster.total_cpus - sum(p for _, p in keep.values()))}
        targets = policy.allocations(now, capacity, self.cluster.gpus_per_node, keep)
        if targets is None:
            started = self._start_at(self._awaiting) if self._awaiting else []
            return Decision(started + self._start_guests()) if self._guest_wait else Decision(started)
        self._guest_wait.clear()
        resized = sorted((j for jid, j in self.running.items() if jid not in self._guest_of
                          and targets.get(jid, (0, 0))[0] != j.num_gpus), key=lambda j: j.job_id)
        gone = {j.job_id for j in resized}
        unpaired = sorted((self.running[g] for g, h in self._guest_of.items()   # host resized, or
                           if h in gone or targets.get(g, (0, 0))[0] > 0),       # GPUs of its own
                          key=lambda j: j.job_id)
        alone = self._stop(unpaired)
        if self.nodes is not None and not self.config.defer_release:
            for job in resized:
                self.nodes.release(job)
        self._stop(resized)
        stop = unpaired + resized
        self._awaiting = {jid: t for jid, t in targets.items() if t[0] > 0 and jid in policy.active
                          and not policy.active[jid].running}
        started = self._start_at(self._awaiting)
        if not self.config.defer_release:
            self._awaiting = {}
        fresh = {j.job_id for j in started}
        adjusted = []
        for job in self.running.values():
            target = targets.get(job.job_id)
            if job.job_id in fresh or target is None or target[1] == job.aggregators or job.job_id in self._guest_of:
                continue
            job.aggregators = target[1]          # its keys spread or packed live: no restart
            self._set_rate(job)
            self._track(job)
            adjusted.append(job)
        self.guard_wake = INF
        if self.slots is not None:
            dropped, shared, changed = self._pack_allocated()
            stop += dropped
            started += shared
            alone += changed
        fresh = {j.job_id for j in started}
        adjusted = list({j.job_id: j for j in adjusted + alone if j.running and j.job_id not in fresh}.values())
        return Decision(started, stop, adjusted)

    def _solo_speed(self, job: JobState, alloc: plc.Allocation) -> None:
        """``job``'s speed alone on ``alloc``: its rate there, else the placement's slowdown."""
        self._set_rate(job)
        if job.rate is None:
            job.speed = self.nodes.speed_on(job, alloc) if self.nodes is not None else 1.0

    def _run_alone(self, job: JobState) -> None:
        """A job's partner left its GPUs: it runs at its own speed from now on."""
        settle(job, self.now)
        self._solo_speed(job, self.nodes.alloc.get(job.job_id, []) if self.nodes is not None else [])
        self._track(job)

    def _pack_allocated(self) -> tuple[list[JobState], list[JobState], list[JobState]]:
        """GPU sharing under an allocation policy: after the round's allocation, the jobs it
        left without GPUs are matched onto running jobs of their GPU count (``matching``), each
        running on its host's GPUs until the next round, where the matching is made anew: a
        pair it keeps goes on running, a guest it moves or drops stops. Both jobs of a pair
        run at their rates times their packed speeds. Live, a guest moved to another host
        starts there once its run has exited (``_start_guests``). Returns (guests stopped,
        guests started, running jobs whose speed changed)."""
        sharing, active = self.sharing, self.policy.active
        if sharing is None:
            return [], [], []
        current = dict(self._guest_of)
        placed = [j for j in self.running.values() if j.may_share and j.job_id not in current]
        pending = [j for j in active.values() if j.may_share and (j.job_id in current or (
            not j.running and j.job_id not in self.draining and j.job_id not in self._awaiting))]
        cand = {j.job_id: Candidate(j.job_id, j.num_gpus, sharing.kind(j), True) for j in placed + pending}
        rule = pack if self.config.packing == "tesserae" else pack_greedy
        pairs = rule([cand[j.job_id] for j in placed], [cand[j.job_id] for j in pending], sharing.pair)
        host_of = {p.pending: p.placed for p in pairs}
        dropped = sorted((self.running[g] for g, h in current.items() if host_of.get(g) != h),
                         key=lambda j: j.job_id)
        changed = self._stop(dropped)
        speeds = self._packed_speeds(pairs)
        started = []
        for p in pairs:
            host, guest = self.running[p.placed], active[p.pending]
            if guest.job_id in self.draining:          # live: its run elsewhere exits first
                self._guest_wait[guest.job_id] = (host.job_id, speeds[host.job_id], speeds[guest.job_id])
                continue
            kept = guest.running
            self._pair(host, guest, speeds[host.job_id], speeds[guest.job_id])
            (changed if kept else started).append(guest)
            changed.append(host)
        return dropped, started, changed

    def _pair(self, host: JobState, guest: JobState, host_speed: float, guest_speed: float) -> None:
        """``guest`` runs on ``host``'s GPUs (started now unless it already does), both at their
        speeds alone there times their packed speeds."""
        alloc = self.nodes.alloc.get(host.job_id, []) if self.nodes is not None else []
        if guest.running:
            settle(guest, self.now)
        else:
            guest.aggregators = max(1, guest.aggregators)
            self._start(guest)
            self.used -= guest.num_gpus          # on its host's GPUs
            self._guest_of[guest.job_id] = host.job_id
        self._solo_speed(guest, alloc)
        guest.speed *= guest_speed
        self._track(guest)
        self._run_alone(host)
        host.speed *= host_speed
        self._track(host)

    def _start_guests(self) -> list[JobState]:
        """Live, between rounds: the guests the round moved to another host start there once
        their last run has exited (while the host still runs with no other guest)."""
        started = []
        for guest_id, (host_id, host_speed, guest_speed) in sorted(self._guest_wait.items()):
            guest, host = self.policy.active.get(guest_id), self.running.get(host_id)
            if guest is not None and guest_id in self.draining and host is not None:
                continue
            del self._guest_wait[guest_id]
            if guest is None or guest.running or host is None or self.guest_on(host_id) is not None:
                continue
            self._pair(host, guest, host_speed, guest_speed)
            started.append(guest)
        return started

    def host_of(self, job_id: int) -> int | None:
        """Allocation and sharing: the job whose GPUs ``job_id`` runs on as its guest."""
        return self._guest_of.get(job_id)

    def guest_on(self, job_id: int) -> int | None:
        """Allocation and sharing: the guest running on ``job_id``'s GPUs."""
        return self._guest_of.guest_on(job_id)

    def partner(self, job_id: int) -> int | None:
        """GPU sharing: the running job ``job_id`` shares its GPUs with (None: alone)."""
        if self.slots is None or job_id not in self.running:
            return None
        if self.policy.allocates:
            other = self._guest_of.get(job_id)
            return other if other is not None else self.guest_on(job_id)
        other = self.slots.partner.get(job_id)
        return other if other in self.running else None

    def _schedule_round(self) -> Decision:
        """A round with GPU sharing (``tiresias.packing.rounds``): the policy's order, protected
        jobs first (progress guarantee); jobs left out stop, jobs planned start, running jobs
        whose GPUs the plan changed migrate, and every job runs at its packed speed
        (``Decision.moved``: running jobs with a new speed or GPUs). The simulator charges a
        migration a pause and resume; live, a migration is a stop by checkpoint and a start on
        the new GPUs, and a planned job starts at the first pass after the GPUs it is planned on
        are released by the runs stopped there (``released``); passes between rounds only do
        that."""
        now, policy, nodes, slots = self.now, self.policy, self.nodes, self.slots
        assert nodes is not None and slots is not None
        live = self.config.defer_release
        if live and now < self._next_round:
            return Decision(self._start_planned())
        self.settle_all()
        limit = now + EPS * max(1.0, abs(now))
        keep = self._protected(limit)
        ordered = list(policy.ordered(now))
        if keep:
            ordered = [j for j in ordered if j.job_id in keep] + [j for j in ordered if j.job_id not in keep]
        sharing = self.sharing
        jobs = [RoundJob(j.job_id, j.num_gpus, sharing.kind(j) if sharing else None, j.may_share,
                         nodes.consolidate(j)) for j in ordered]
        plan = plan_round(jobs, self.cluster.nodes, self.cluster.gpus_per_node,
                          sharing.pair if sharing else None, slots.previous(), self.config.packing,
                          keep_in_place=not self.config.fresh_plans)
        gpus = plan.gpus()
        migrated = [self.running[jid] for jid in plan.migrated if jid in self.running]
        stop = [j for j in self.running.values() if j.job_id not in gpus] + (migrated if live else [])
        stop.sort(key=lambda j: j.job_id)
        if not live:
            for job in stop:
                nodes.release(job)
        self._stop(stop)
        partners = {p.placed: p.pending for p in plan.pairs}
        partners.update({p.pending: p.placed for p in plan.pairs})
        slots.set(plan.plan, partners)
        nodes.migrations_naive += len(plan.naive)
        if live:
            for job in migrated:
                job.migrations += 1
                nodes.migrations += 1
            self._next_round = now + (self.config.decide_every or 0.0)
            return Decision(self._start_planned(), stop)
        nodes.assign({jid: slots.allocation(jid) for jid in gpus}, [sum(1 for g in node if g) for node in plan.plan])
        moved = []
        for job in migrated:
            nodes.migrate(job, now)
            moved.append(job)
        start = sorted((policy.active[jid] for jid in gpus if jid not in self.running), key=lambda j: j.job_id)
        for job in start:
            self._start(job)
        speeds = self._packed_speeds(plan.pairs)
        fresh = {j.job_id for j in start}
        seen = {j.job_id for j in moved}
        for job in self.running.values():
            speed = nodes.speed_on(job, slots.allocation(job.job_id)) * speeds.get(job.job_id, 1.0)
            if speed != job.speed:
                if job.job_id not in fresh:
                    settle(job, now)
                job.speed = speed
                if job.job_id not in fresh and job.job_id not in seen:
                    moved.append(job)
        for job in moved:
            self._track(job)
            self._guard(job)
        self.used = slots.busy()
        return Decision(start, stop, sorted(moved, key=lambda j: j.job_id))

    def _start_planned(self) -> list[JobState]:
        """Live: start the jobs the round planned that are not running, each once the runs
        stopped on its GPUs are gone (and its own last run too)."""
        slots, active = self.slots, self.policy.active
        assert slots is not None and self.nodes is not None
        held = set().union(*self._held.values()) if self._held else set()
        started = []
        for job_id in sorted(slots.gpus):
            job = active.get(job_id)
            if job is None or job.running:
                continue
            if job_id in self.draining or slots.gpus[job_id] & held:
                self.reasons[job_id] = "waits for the GPUs of stopped runs to be released"
                continue
            self.reasons.pop(job_id, None)
            self._start(job)
            started.append(job)
        self._sync_slots()
        return started

    def _sync_slots(self) -> None:
        """Live GPU sharing: the node state from the running jobs' planned GPUs and the GPUs
        stopped runs still hold."""
        slots, nodes = self.slots, self.nodes
        assert slots is not None and nodes is not None
        busy = set().union(*(slots.gpus.get(jid, frozenset()) for jid in self.running), *self._held.values())
        per_node = [0] * self.cluster.nodes
        for node, _ in busy:
            per_node[node] += 1
        nodes.assign({jid: slots.allocation(jid) for jid in self.running}, per_node)
        self.used = len(busy)

    def gpu_ids(self, job_id: int) -> list[tuple[int, list[int]]] | None:
        """GPU sharing: the GPUs of each node the round planned for ``job_id`` (None without
        sharing: the caller picks free GPUs on the allocation's nodes)."""
        if self.slots is None or job_id not in self.slots.gpus:
            return None
        by_node: dict[int, list[int]] = {}
        for node, gpu in sorted(self.slots.gpus[job_id]):
            by_node.setdefault(node, []).append(gpu)
        return sorted(by_node.items())

    def _left_allocated(self, job: JobState, alloc: plc.Allocation) -> list[JobState]:
        """Allocation and sharing: a guest that leaves leaves its host alone; a host that
        leaves (``alloc``: its GPUs, just given back) leaves them to its guest, which runs on
        alone until the next round. Returns the job that now runs alone."""
        host_id = self._guest_of.pop(job.job_id, None)
        if host_id is not None:
            self.used += job.num_gpus            # the caller took them back: they were the host's
            host = self.running.get(host_id)
            if host is None:
                return []
            self._run_alone(host)
            return [host]
        guest_id = self.guest_on(job.job_id)
        if guest_id is None:
            return []
        if self.nodes is not None:
            plc.apply(self.nodes.free, alloc)
            self.nodes.alloc[guest_id] = alloc
        return [self._guest_inherits(guest_id)]

    def _guest_inherits(self, guest_id: int) -> JobState:
        """The host of ``guest_id`` left: the guest runs on alone, on GPUs now its own."""
        del self._guest_of[guest_id]
        guest = self.running[guest_id]
        self.used += guest.num_gpus
        self._run_alone(guest)
        return guest

    def _packed_speeds(self, pairs) -> dict[int, float]:
        """Every packed job's normalised speed, from the true profile (a noisy one decided);
        with ``learn_profiles`` the deciding profile learns them (the simulator's stand-in for
        the speeds a live job reports)."""
        truth, active, sharing = self.true_sharing, self.policy.active, self.sharing
        if truth is sharing or truth is None or sharing is None:
            return {jid: s for p in pairs for jid, s in ((p.placed, p.placed_speed), (p.pending, p.pending_speed))}
        out = {}
        for p in pairs:
            a, b = active[p.placed], active[p.pending]
            real = truth.pair(truth.kind(a), truth.kind(b))
            if not (real and min(real) > 0):
                real = (p.placed_speed, p.pending_speed)
            out[p.placed], out[p.pending] = real
            if self.config.learn_profiles:
                sharing.observe(sharing.kind(a), sharing.kind(b), *real)
        return out

    def _left_slots(self, jobs: list[JobState]) -> list[JobState]:
        """Jobs left their shared GPUs: their partners run alone from now on."""
        slots, changed = self.slots, []
        assert slots is not None
        for job in jobs:
            other = slots.release(job.job_id)
            partner = self.running.get(other) if other is not None else None
            if partner is not None:
                self._run_alone(partner)
                changed.append(partner)
        if self.config.defer_release:
            self._sync_slots()
        else:
            self.used = slots.busy()
        return changed

    def _start_at(self, targets: dict[int, tuple[int, int]]) -> list[JobState]:
        """Start the waiting jobs of ``targets`` at their (GPUs, aggregators) where they can be
        placed now (a job whose last run is still draining waits); those started leave it."""
        now, policy = self.now, self.policy
        starts = []
        for job_id in sorted(targets):
            gpus, aggregators = targets[job_id]
            job = policy.active.get(job_id)
            if job is None or job.running:
                del targets[job_id]
                continue
            if job_id in self.draining:
                continue
            if gpus != job.num_gpus:
                policy.resize(job, gpus, now)
            job.aggregators = aggregators
            starts.append(job)
        if self.nodes is not None:
            started = self.nodes.place_all(starts, {}, now, self.eligible)
        else:
            started, free = [], self.capacity - self.used
            for job in starts:
                if job.num_gpus <= free:
                    started.append(job)
                    free -= job.num_gpus
        for job in started:
            self._start(job)
            targets.pop(job.job_id, None)
        return started

    def _set_rate(self, job: JobState) -> None:
        """A job with a true rate (simulated measured jobs) runs at it on its placement."""
        if job.rate is None:
            return
        alloc = self.nodes.alloc.get(job.job_id) if self.nodes is not None else None
        nodes = len(alloc) if alloc else -(-job.num_gpus // self.cluster.gpus_per_node)
        job.speed = job.rate(job.num_gpus, max(1, job.aggregators), nodes)

    def _allocate(self, capacity: int, fits=None) -> tuple[list[JobState], list[JobState]]:
        """The policy's pass; when it would preempt a protected job (progress guarantee), the
        pass again with every protected running job kept, and a wake-up when the first of
        those it spared may be preempted."""
        now = self.now
        running = self.running.values()
        to_start, to_stop = allocate(self.policy, capacity, running, now, fits)
        limit = now + EPS * max(1.0, abs(now))
        spared = [job.protected_until for job in to_stop if job.protected_until > limit]
        if not spared:
            self.guard_wake = INF
            return to_start, to_stop
        keep = self._shielded(limit)
        self.guard_wake = min(spared)
        return allocate(self.policy, capacity, running, now, fits, keep)

    def _pass_live(self, rounds: int = 4) -> tuple[list[JobState], list[JobState]]:
        """Live pass: a job admitted by count that no placement can hold (even with the
        preemptions) is set aside and the pass runs again, so that it does not keep GPUs from
        the jobs after it; then the preempted jobs' GPUs drain and the admitted jobs are
        placed on GPUs free now (the rest start at the pass after the drain)."""
        now, nodes = self.now, self.nodes
        capacity = sum(max(0, f) for f in nodes.free) + self.used
        blocked: dict[int, str] = {}
        draining = self.draining

        def fits(job: JobState, free: int) -> bool:    # a job whose last run still exits waits
            return job.job_id not in blocked and job.job_id not in draining

        for attempt in range(rounds):
            admitted, to_stop = self._allocate(capacity, fits)
            saved = (list(nodes.free), dict(nodes.alloc))
            held = {job.job_id: nodes.release(job) for job in to_stop}
            stopping = {job.job_id for job in to_stop}
            staying = {jid: j for jid, j in self.running.items() if jid not in stopping}
            placed = {j.job_id for j in nodes.place_all(admitted, staying, now, self.eligible)}
            unplaced = [j for j in admitted if j.job_id not in placed]
            if unplaced and attempt + 1 < rounds:
                for job in unplaced:
                    blocked[job.job_id] = nodes.why_not(job, self.eligible, bool(self.draining))
                nodes.free, nodes.alloc = saved
                continue
            to_stop = [job for job in to_stop if not nodes.retake(job, held[job.job_id])]
            to_start = self._defer(admitted, [j for j in admitted if j.job_id in placed], to_stop, held,
                                   staying, now)
            self.reasons.update(blocked)
            for job_id in draining:
                if job_id in self.policy.active and job_id not in self.running:
                    self.reasons[job_id] = "waits for its previous run to exit"
            return to_start, to_stop
        raise AssertionError("unreachable")

    def _defer(self, admitted: list[JobState], placed: list[JobState], to_stop: list[JobState],
               held: dict, staying: dict, now: float) -> list[JobState]:
        """Live: the stopped jobs' GPUs drain first; place the admitted jobs on free GPUs only."""
        nodes = self.nodes
        for job in placed:
            nodes.release(job)
        for job in to_stop:
            if held[job.job_id] is not None:
                nodes.give_back(held[job.job_id], sign=-1)
                self.draining[job.job_id] = held[job.job_id]
        self.reasons = {}
        started = nodes.place_all(admitted, staying, now, self.eligible)
        got = {j.job_id for j in started}
        for job in admitted:
            if job.job_id not in got:
                self.reasons[job.job_id] = nodes.why_not(job, self.eligible, bool(self.draining))
        return started

    def _stop(self, jobs: Iterable[JobState]) -> list[JobState]:
        """Preempt ``jobs``. Live, their GPUs drain until ``released``. With GPU sharing under
        an allocation policy, a stopped guest leaves its host alone, and a stopped host leaves
        its GPUs to a guest that goes on running. Returns the running jobs whose speed changed."""
        now = self.now
        jobs = list(jobs)
        paired = bool(self._guest_of)
        stopping = {job.job_id for job in jobs} if paired else ()
        changed = []
        for job in jobs:
            if paired:
                host = self._guest_of.pop(job.job_id, None)
                guest = self.guest_on(job.job_id)
                if guest in stopping:
                    guest = None
            else:
                host = guest = None
            if host is not None:
                self.used += job.num_gpus            # it held none of its own
            self._untrack(job)
            job.running = False
            job.preemptions += 1
            job.wait_since = now
            job.last_run = now
            self.policy.stopped(job, now)
            self.preemptions += 1
            del self.running[job.job_id]
            self.used -= job.num_gpus
            if guest is not None and self.nodes is not None and job.job_id in self.nodes.alloc:
                self.nodes.alloc[guest] = self.nodes.alloc.pop(job.job_id)     # its guest runs on there
                if self.config.defer_release:
                    self.nodes.alloc[job.job_id] = []   # its own run exits first
            if self.config.defer_release and self.nodes is not None and job.job_id in self.nodes.alloc:
                alloc = self.nodes.alloc.pop(job.job_id)
                self.draining[job.job_id] = alloc      # GPUs still busy: taken, not yet free
                if self.slots is not None and not self.policy.allocates:    # ... these very GPUs
                    self._held[job.job_id] = self.slots.gpus.get(job.job_id, frozenset())
            elif host is not None and self.config.defer_release:
                self.draining[job.job_id] = []       # its run on the host's GPUs exits first
                if host in stopping:
                    self._drain_pair[host] = job.job_id
            if host is not None and host in self.running and host not in stopping:
                self._run_alone(self.running[host])
                changed.append(self.running[host])
            if guest is not None:
                changed.append(self._guest_inherits(guest))
        return changed

    def _start(self, job: JobState) -> None:
        now, config = self.now, self.config
        job.running = True
        if now > job.wait_since:
            job.waited += now - job.wait_since
        cost = 0.0
        if job.first_start is None:
            job.first_start = now
            if config.overheads and config.start_cost:
                cost = config.start_cost
                job.stall += cost
                job.overhead += cost
                self.overhead += cost
        elif job.preemptions:
            cost = self.resume_cost(job)
            if config.overheads:
                job.stall += cost
                job.overhead += cost
                self.overhead += cost
        job.protected_until = progress.protected_until(now, cost, config.min_run_factor, config.min_run)
        self._guard(job)
        job.settled = now
        if job.rate is not None:
            self._set_rate(job)
        self._track(job)
        self.running[job.job_id] = job
        self.used += job.num_gpus
        self.policy.started(job, now)

    # --- nodes (live) --------------------------------------------------------------------------
    def allocation(self, job_id: int) -> plc.Allocation | None:
        if self.nodes is None:
            return None
        return self.nodes.alloc.get(job_id) or self.draining.get(job_id)

    def set_online(self, node: int, online: bool) -> list[JobState]:
        """Take a node offline (its running jobs are preempted and returned) or back online."""
        if self.nodes is None:
            raise ValueError("node state needs node placement")
        hit = []
        if not online:
            hit = [self.running[jid] for jid, a in list(self.nodes.alloc.items())
                   if jid in self.running and any(n == node for n, _ in a)]
            hit += [self.running[g] for g, h in self._guest_of.items() if h in {j.job_id for j in hit}]
            self._stop(hit)
        self.nodes.set_online(node, online)
        return hit


def _apply(change: Change, now: float) -> None:
    job = change.job
    if change.kind == "demote":
        job.service = max(job.service, change.service)
    elif change.kind == "promote":
        job.service = 0.0
        job.waited = 0.0
        job.wait_since = now
    else:
        raise ValueError(f"unknown policy change {change.kind!r}")
