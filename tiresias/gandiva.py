"""Gandiva as the original Tiresias simulator models it: node sets, packing, time slicing.

The thesis compares Tiresias with Gandiva's time-sharing scheduler in its large-scale
simulation (Table 3.6: Tiresias-L 2.00x better on average). The released simulator
(SymbioticLab/Tiresias, ``simulator/cluster.py``, ``--schedule gandiva``) models Gandiva
this way; this module re-implements that model (no code of it is copied):

* **Node sets.** Nodes are grouped into node sets, each dedicated to jobs of one GPU count
  ``g`` (a class): a set has ``ceil(g / GPUs per node)`` nodes and ``slots = set GPUs // g``
  places for a job.
* **Packing by GPU memory.** A new job goes to the least-loaded set of its class if its GPU
  memory share still fits there (load + share < slots: the released code's strict
  comparison); else it opens a new set on free nodes; else it is time-sliced onto the
  least-loaded set of its class; else (no set of its class, no free node) it waits, FIFO,
  until nodes are freed. The released code gives every model a memory share of 1 GPU (its
  per-model fractions are commented out, ``MEMORY_SHARE``), so a GPU holds one job at a time.
* **Time slicing.** In a set holding more jobs than slots, the jobs take turns: every
  switching period (60 s) the running ones go to the back. Jobs are long next to 60 s, so
  the turns are modelled by their fluid limit: each of ``n`` jobs on ``c`` slots progresses
  at ``c / n`` of its speed (times ``q / (q + r)`` when the cost models are on: ``r`` is the
  job's pause + resume, ``q`` the period), and each turn counts as one preemption.
* **Rebalancing.** At every event the GPUs are re-divided among the classes in proportion
  to their demand (jobs in sets x GPUs; waiting jobs do not count), capped at the demand: a
  class over its share by whole sets dissolves its least-loaded sets into its others (one
  set is always kept), then a class short of it opens sets on free nodes and jobs move
  there from its fuller sets. A set whose jobs all finished gives its nodes back.

Where this differs from the released code, on purpose: time advances from event to event
with the fluid turns, not in 10 s steps with a rotation on wall-clock multiples of 60 s; a
class grows and shrinks by the sets the GPU difference needs (the released code counts one
set per ``g`` GPUs, so a 1-GPU class asked to grow by 3 GPUs takes 3 nodes), and the
shrinking classes go first so that the nodes they free are used at once (the released code
would use them at its next 10 s step); waiting jobs are retried whenever nodes are free,
not only when a set empties; moves between sets cost nothing (they are not preemptions in
the released code either).
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from .cluster import ClusterSpec
from .policies.base import INF, JobState

MEMORY_SHARE = 1.0


@dataclass(eq=False, slots=True)
class Member:
    """A job in a node set: its execution left (``rem``, seconds at full speed) as of the set's
    clock ``mark``, and its progress per unit of the set's clock (``rate``)."""
    job: JobState
    rem: float
    eff: float              # progress per slice second when sliced (1 without cost models)
    mark: float = 0.0
    rate: float = 1.0
    token: int = 0

    def finish(self) -> float:
        return self.mark + self.rem / self.rate


class NodeSet:
    """Nodes dedicated to ``gpus``-GPU jobs. Its clock ``v`` runs at 1 per second while every
    member has a slot and at ``slots / n`` when ``n`` members share the slots; a member
    progresses ``rate`` per unit of it."""

    def __init__(self, sid: int, gpus: int, nodes: int, slots: int, now: float) -> None:
        self.sid, self.gpus, self.nodes, self.slots = sid, gpus, nodes, slots
        self.members: dict[int, Member] = {}
        self.t = now
        self.v = 0.0
        self.sliced = False
        self.heap: list[tuple[float, int, int]] = []    # (finish on the clock, token, job id)
        self.tokens = itertools.count(1)                 # unique per heap entry: stale ones are skipped
        self.version = 0

    def load(self) -> float:
        return len(self.members) * MEMORY_SHARE

    def running(self) -> int:
        return min(len(self.members), self.slots)

    def speed(self) -> float:
        n = len(self.members)
        return self.slots / n if n > self.slots else 1.0

    def advance(self, t: float) -> None:
        if t > self.t:
            self.v += (t - self.t) * self.speed()
            self.t = t

    def left(self, m: Member) -> float:
        return max(0.0, m.rem - (self.v - m.mark) * m.rate)

    def add(self, job: JobState, rem: float, eff: float, sliced_time: dict[int, float]) -> None:
        self.members[job.job_id] = m = Member(job, rem, eff)
        self._remark(m, sliced_time, eff if self.sliced else 1.0, fresh=True)
        self._regime(sliced_time)

    def remove(self, job_id: int, sliced_time: dict[int, float]) -> float:
        """Take a member out; its execution left."""
        m = self.members.pop(job_id)
        rem = self.left(m)
        if self.sliced:
            sliced_time[job_id] = sliced_time.get(job_id, 0.0) + self.v - m.mark
        self._regime(sliced_time)
        self.version += 1
        return rem

    def _remark(self, m: Member, sliced_time: dict[int, float], rate: float, fresh: bool = False) -> None:
        """Restate ``m`` at the set's clock: its execution left, from now on at ``rate``."""
        if not fresh:
            if self.sliced:
                sliced_time[m.job.job_id] = sliced_time.get(m.job.job_id, 0.0) + self.v - m.mark
            m.rem = self.left(m)
        m.mark, m.rate = self.v, rate
        m.token = next(self.tokens)
        heapq.heappush(self.heap, (m.finish(), m.token, m.job.job_id))
        self.version += 1

    def _regime(self, sliced_time: dict[int, float]) -> None:
        """Members share the slots now, or no longer: restate every member's rate."""
        sliced = len(self.members) > self.slots
        if sliced != self.sliced:
            for m in self.members.values():
                self._remark(m, sliced_time, m.eff if sliced else 1.0)
            self.sliced = sliced

    def _top(self) -> tuple[float, int, int] | None:
        while self.heap:
            fin, token, jid = self.heap[0]
            m = self.members.get(jid)
            if m is not None and m.token == token:
                return self.heap[0]
            heapq.heappop(self.heap)
        return None

    def next_end(self) -> float:
        top = self._top()
        return INF if top is None else self.t + max(0.0, top[0] - self.v) / self.speed()

    def done(self) -> list[int]:
        """Members whose execution is over at the set's clock (the first one always: its end
        was the event)."""
        out = []
        while (top := self._top()) is not None:
            if out and top[0] > self.v + 1e-9 * max(1.0, abs(top[0])):
                break
            heapq.heappop(self.heap)
            out.append(top[2])
        return out


@dataclass
class NodeSets:
    """The node sets of a cluster, the jobs in them and the jobs waiting for a set."""
    cluster: ClusterSpec
    free: int = -1                                   # free nodes
    classes: dict[int, list[NodeSet]] = field(default_factory=dict)
    where: dict[int, NodeSet] = field(default_factory=dict)
    waiting: list[tuple[JobState, float, float]] = field(default_factory=list)   # (job, rem, eff), FIFO
    sliced_time: dict[int, float] = field(default_factory=dict)   # slice seconds per job (turns)
    changed: set[int] = field(default_factory=set)   # sets whose next end moved
    sets: dict[int, NodeSet] = field(default_factory=dict)
    next_sid: int = 0

    def __post_init__(self) -> None:
        if self.free < 0:
            self.free = self.cluster.nodes

    def shape(self, gpus: int) -> tuple[int, int]:
        """(nodes, slots) of a set for ``gpus``-GPU jobs."""
        per = self.cluster.gpus_per_node
        nodes = math.ceil(gpus / per)
        return nodes, nodes * per // gpus

    def used_gpus(self) -> int:
        return sum(s.running() * s.gpus for s in self.sets.values())

    def advance(self, t: float) -> None:
        for s in self.sets.values():
            s.advance(t)

    # --- placement --------------------------------------------------------------------------
    def place(self, job: JobState, rem: float, eff: float, now: float) -> bool:
        g = job.num_gpus
        sets = self.classes.get(g, [])
        least = min(sets, key=NodeSet.load) if sets else None
        if least is not None and least.load() + MEMORY_SHARE < least.slots:
            target = least                                         # packs by memory
        else:
            target = self._open(g, now)
            if target is None:
                target = least                                     # time slicing
        if target is None:
            return False
        self._put(target, job, rem, eff)
        return True

    def place_waiting(self, now: float) -> list[JobState]:
        """Retry the waiting jobs in FIFO order; the ones placed."""
        placed, still = [], []
        for job, rem, eff in self.waiting:
            if self.place(job, rem, eff, now):
                placed.append(job)
            else:
                still.append((job, rem, eff))
        self.waiting = still
        return placed

    def _open(self, g: int, now: float) -> NodeSet | None:
        nodes, slots = self.shape(g)
        if nodes > self.free:
            return None
        self.free -= nodes
        s = NodeSet(self.next_sid, g, nodes, slots, now)
        self.next_sid += 1
        self.sets[s.sid] = s
        self.classes.setdefault(g, []).append(s)
        return s

    def _put(self, s: NodeSet, job: JobState, rem: float, eff: float) -> None:
        s.add(job, rem, eff, self.sliced_time)
        self.where[job.job_id] = s
        self.changed.add(s.sid)

    def _take(self, job_id: int) -> tuple[JobState, float, float]:
        s = self.where.pop(job_id)
        m = s.members[job_id]
        rem = s.remove(job_id, self.sliced_time)
        self.changed.add(s.sid)
        return m.job, rem, m.eff

    def finish(self, job_id: int) -> None:
        """A job completed: out of its set; an empty set gives its nodes back."""
        s = self.where[job_id]
        self._take(job_id)
        if not s.members:
            self._dissolve(s)

    def _dissolve(self, s: NodeSet) -> None:
        self.classes[s.gpus].remove(s)
        if not self.classes[s.gpus]:
            del self.classes[s.gpus]
        del self.sets[s.sid]
        s.version += 1
        self.free += s.nodes
        self.changed.discard(s.sid)

    # --- rebalancing ------------------------------------------------------------------------
    def rebalance(self, now: float) -> None:
        """Re-divide the GPUs among the classes in proportion to their demand (see the module
        docstring): classes over their share give whole sets back first, then classes under
        it open sets on the free nodes, the smallest GPU count first."""
        demand = {g: sum(len(s.members) for s in sets) * g for g, sets in self.classes.items()}
        total = sum(demand.values())
        if total == 0:
            return
        per, gpus = self.cluster.gpus_per_node, self.cluster.total_gpus
        diff, set_gpus = {}, {}
        for g in sorted(demand):
            set_gpus[g] = self.shape(g)[0] * per
            target = min(math.floor(demand[g] / total * gpus), demand[g])
            diff[g] = target - len(self.classes[g]) * set_gpus[g]
        for g in sorted(demand):
            if diff[g] < 0:
                self._shrink(g, min(-diff[g] // set_gpus[g], len(self.classes[g]) - 1))
        for g in sorted(demand):
            if diff[g] > 0:
                opened = [s for s in (self._open(g, now) for _ in range(math.ceil(diff[g] / set_gpus[g]))) if s]
                if opened:
                    self._spread(g)

    def _spread(self, g: int) -> None:
        """Move jobs from the fullest sets of class ``g`` to the emptiest until loads differ by
        at most one job."""
        sets = self.classes[g]
        while True:
            full, empty = max(sets, key=NodeSet.load), min(sets, key=NodeSet.load)
            if len(full.members) - len(empty.members) <= 1:
                return
            jid = next(reversed(full.members))
            self._put(empty, *self._take(jid))

    def _shrink(self, g: int, count: int) -> None:
        for _ in range(count):
            s = min(self.classes[g], key=NodeSet.load)
            moved = [self._take(jid) for jid in list(s.members)]
            self._dissolve(s)
            for job, rem, eff in moved:
                self._put(min(self.classes[g], key=NodeSet.load), job, rem, eff)
