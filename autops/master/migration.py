"""pMaster's side of live tensor migration (thesis §4.3.2, Fig. 4.5).

A batch moves keys of one job, all with the same aggregation settings, from one aggregator
to another. Everything large moves while the job trains; the switch itself, at an
iteration boundary, moves only counters:

1. ``MIGRATE_PREPARE`` to the new aggregator: it creates the keys in the incoming state
   (it holds pushes and parks pulls until the hand-over) in memory populated ahead. In
   ``server`` mode a new replica of the keys gets ``REPLICA_PREPARE`` at the same time and
   makes the memory for their state ready likewise; step 2 waits for both.
2. ``MIGRATE_INIT`` to the old aggregator. A key's cutover is its open iteration plus
   ``LEAD_ITERATIONS``, recorded in the job's table as "new owner from cutover + 1 on"; the
   old one serves everything up to the cutover, puts the new address into those pull
   replies (the agents map the new owner's memory ahead) and REDIRECTs anything later. It
   tells the new owner at once which workers' buffers to map. A ``server``-mode key first
   sends its state (master copy, optimizer state, step) to its *followers* -- the new owner,
   unless it holds the key as its replica already, and the new owner's replica when that is
   a new one -- and then every step's averaged gradient, as to a replica (``replication``);
   its cutover is decided once its followers hold the state and reported with
   ``MIGRATE_CUTOVER``. Keys switch one by one as their state arrives, so none is followed
   for longer than its own copy and lead take.
3. The old aggregator hands each key over once its cutover iteration is complete
   (``TENSOR_COPY``: the counter; state only where no follower holds it) and reports
   ``TENSOR_COPY_DONE``; the new one reports ``WORKER_DONE`` once all workers pushed the
   next iteration to it, with the longest any key's complete first iteration waited for its
   hand-over there (``wait_ms``: the pause the switch itself put on the workers).
4. With both reports for a key, the table owns the new aggregator and ``MIGRATE_DROP`` tells
   the old one to forget the key.
"""
from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..wire import protocol as wire
from .outbox import Outbox
from .pool import Clock, JobInfo, PoolState
from .replication import choose_replica, replica_info

log = logging.getLogger("autops.master.migration")

# iterations between the hand-over order and the cutover: the agents learn of the move from
# the pull replies of the iterations in between and prepare for it (map, connect)
LEAD_ITERATIONS = 2
RECENT = 16     # completed batches ``status`` lists


@dataclass
class Batch:
    mid: int
    job: str
    src: str
    dst: str
    keys: list
    phase: str = "prepare"          # prepare -> init -> copying -> done | failed
    copied: set = field(default_factory=set)
    workers: set = field(default_factory=set)
    completed: set = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    replicas: dict = field(default_factory=dict)    # key -> replica the new owner keeps (server mode)
    followers: dict = field(default_factory=dict)   # key -> aggregators its state is copied to ahead
    first: dict = field(default_factory=dict)       # key -> first iteration the new owner serves
    handover_wait_ms: float = 0.0   # longest a key's whole first iteration waited for its hand-over
    switch_seen: dict = field(default_factory=dict)  # the new owner's clock: first_push_at, handover_at, done_at
    prepare: dict = field(default_factory=dict)     # the settings MIGRATE_PREPARE carried (for new replicas)
    readying: set = field(default_factory=set)      # new replicas still making their memory ready
    dst_info: dict | None = None    # how the workers reach the new owner, once it prepared
    on_done: Callable[["Batch", bool], None] | None = None


class Migrations:
    """Migration batches in flight, driven by pMaster's message loop; ``state`` is the pool
    whose tables they change, ``outbox`` carries the control messages, ``clock`` times them."""

    def __init__(self, state: PoolState, outbox: Outbox, clock: Clock | None = None) -> None:
        self.state = state
        self.outbox = outbox
        self.clock = clock or state.clock
        self.batches: dict[int, Batch] = {}
        self.moving: dict[tuple[str, str], int] = {}     # (job, key) -> mid
        self.completed = 0          # keys
        self.failed = 0             # keys
        self.durations: list[float] = []   # seconds per completed batch (last 100)
        self.recent: list[dict] = []       # the last completed batches: where, when they switched
        self._mids = itertools.count(1)

    def active(self, job: str | None = None, aggs: set | None = None) -> list[Batch]:
        return [b for b in self.batches.values()
                if (job is None or b.job == job) and (aggs is None or b.src in aggs or b.dst in aggs)]

    def start(self, job: JobInfo, plan: dict[str, str],
              on_done: Callable[[Batch, bool], None] | None = None) -> list[int]:
        """Move ``key -> new aggregator`` for the keys of ``job`` not moving already."""
        groups: dict[tuple, list[str]] = {}
        for key, dst in sorted(plan.items()):
            src = job.table.get(key)
            if src is None or src == dst or (job.job, key) in self.moving:
                continue
            conf = job.conf(job.keys[key].tensor)
            sig = (src, dst, conf["mode"], conf["average"], conf["optimizer"], json.dumps(conf["hp"], sort_keys=True))
            groups.setdefault(sig, []).append(key)
        mids = []
        for (src, dst, mode, average, optimizer, hp), keys in groups.items():
            if src not in self.state.aggs or dst not in self.state.aggs:
                log.warning("migration of %d keys of %s from %s to %s skipped: aggregator unknown",
                            len(keys), job.job, src, dst)
                continue
            batch = Batch(next(self._mids), job.job, src, dst, keys, started=self.clock(), on_done=on_done)
            self.batches[batch.mid] = batch
            for key in keys:
                self.moving[(job.job, key)] = batch.mid
            job.touched.add(dst)
            if mode == "server":
                batch.replicas = self._replicas(job, keys, dst)
                batch.followers = self._followers(job, keys, src, dst, batch.replicas)
            batch.prepare = dict(mid=batch.mid, job=job.job, secret=job.secret, world_size=job.world_size,
                                 mode=mode, average=average, optimizer=optimizer, hp=json.loads(hp))
            self.outbox.send_agg(dst, wire.MIGRATE_PREPARE, lambda msg, b=batch: self._prepared(b, msg),
                                 **batch.prepare, keys=[job.keys[k].to_wire() for k in keys],
                                 replicas={k: replica_info(self.state, r) for k, r in batch.replicas.items()})
            self._ready_replicas(job, batch)
            mids.append(batch.mid)
        return mids

    def _replicas(self, job: JobInfo, keys: list[str], dst: str) -> dict[str, str]:
        """The replicas the new owner keeps for ``keys``: the current ones, unless that is
        the new owner itself. The job's record changes when the key has moved: until then
        the old owner's replica is the one that holds its state."""
        out = {}
        if not job.replicate:
            return out
        for key in keys:
            replica = job.replicas.get(key)
            if replica is None or replica == dst or replica not in self.state.aggs:
                replica = choose_replica(self.state, dst)
            if replica is not None:
                job.touched.add(replica)
                out[key] = replica
        return out

    def _followers(self, job: JobInfo, keys: list[str], src: str, dst: str,
                   replicas: dict[str, str]) -> dict[str, list[str]]:
        """Where each server-mode key's state must be before its switch: the new owner,
        unless it is the key's replica already (kept current by the old owner), and the new
        owner's replica when it is not the key's current one (nor the old owner, which the
        new owner then sends the state after the switch)."""
        out = {}
        for key in keys:
            current = job.replicas.get(key) if job.replicate else None
            if current not in self.state.aggs:
                current = None
            wanted = [] if current == dst else [dst]
            new_replica = replicas.get(key)
            if new_replica not in (None, current, src):
                wanted.append(new_replica)
            out[key] = wanted
        return out

    # --- replies -----------------------------------------------------------------------
    def _prepared(self, batch: Batch, msg: wire.Message | None) -> None:
        if batch.mid not in self.batches:
            return
        if msg is None or msg.op == wire.ERROR:
            self._fail(batch, "the new aggregator did not prepare: " +
                       (msg["message"] if msg is not None else "no answer"), drop_dst=msg is None)
            return
        dst = self.state.aggs.get(batch.dst)
        if dst is None:
            self._fail(batch, "the new aggregator is gone", drop_dst=False)
            return
        batch.phase = "init"
        batch.dst_info = {"endpoints": dst.endpoints, "host": dst.host, "segments": msg.get("segments") or []}
        if not batch.readying:
            self._init(batch, batch.dst_info)

    def _ready_replicas(self, job: JobInfo, batch: Batch) -> None:
        """Server mode: new replicas of the keys make the memory for the state they will
        receive ready, as the new owner does and at the same time (``REPLICA_PREPARE``), so
        that their serving threads do not fault it in; the hand-over waits for them."""
        backing: dict[str, list[str]] = {}
        for key, aggs in batch.followers.items():
            for agg in aggs:
                if agg != batch.dst and agg in self.state.aggs:
                    backing.setdefault(agg, []).append(key)
        batch.readying = set(backing)
        for agg, keys in sorted(backing.items()):
            self.outbox.send_agg(agg, wire.REPLICA_PREPARE, lambda m, b=batch, a=agg: self._replica_ready(b, a, m),
                                 **batch.prepare, keys=[job.keys[k].to_wire() for k in keys])

    def _replica_ready(self, batch: Batch, agg: str, msg: wire.Message | None) -> None:
        """A new replica's answer to REPLICA_PREPARE; the hand-over starts once the new owner
        and every new replica answered (a replica's error or silence only costs it page
        faults later)."""
        if batch.mid not in self.batches or agg not in batch.readying:
            return
        if msg is None or msg.op == wire.ERROR:
            log.warning("migration %d of job %s: replica %s did not make memory ready: %s", batch.mid, batch.job,
                        agg, msg["message"] if msg is not None else "no answer")
        batch.readying.discard(agg)
        if not batch.readying and batch.dst_info is not None:
            self._init(batch, batch.dst_info)

    def _init(self, batch: Batch, info: dict) -> None:
        """MIGRATE_INIT to the old owner: ``info`` is how the workers reach the new one."""
        followers = {k: [replica_info(self.state, a) for a in aggs if a in self.state.aggs]
                     for k, aggs in batch.followers.items() if aggs}
        self.outbox.send_agg(batch.src, wire.MIGRATE_INIT, lambda m, b=batch: self._initiated(b, m),
                             mid=batch.mid, job=batch.job, to=batch.dst, info=info, keys=batch.keys,
                             lead=LEAD_ITERATIONS, followers=followers)

    def _initiated(self, batch: Batch, msg: wire.Message | None) -> None:
        if batch.mid not in self.batches:
            return
        if msg is None or msg.op == wire.ERROR:
            self._fail(batch, "the old aggregator did not start the hand-over: " +
                       (msg["message"] if msg is not None else "no answer"), drop_dst=True)
            return
        batch.phase = "copying"
        self._cut(batch, msg.get("cutovers") or {})

    def cutover(self, msg: wire.Message, sender: str | None = None) -> None:
        """The old owner's MIGRATE_CUTOVER: keys whose state went ahead switch after these
        iterations; ignored unless ``sender`` (as for ``copy_done``) is the batch's source."""
        batch = self.batches.get(msg["mid"])
        if batch is None or sender not in (None, batch.src):
            return
        self._cut(batch, msg["cutovers"])

    def _cut(self, batch: Batch, cutovers: dict) -> None:
        """Record cutovers: the table names the new owner from the next iteration on."""
        job = self.state.jobs.get(batch.job)
        for key, cut in cutovers.items():
            if key in batch.keys and type(cut) is int and key not in batch.completed:
                batch.first[key] = cut + 1
                if job is not None:
                    job.moves[key] = (batch.dst, cut + 1)

    def copy_done(self, msg: wire.Message, sender: str | None = None) -> None:
        """The old owner's TENSOR_COPY_DONE; ignored unless ``sender`` (when given: the
        aggregator it came from, "" for an unknown peer) is the batch's source."""
        batch = self.batches.get(msg["mid"])
        if batch is None or sender not in (None, batch.src):
            return
        if msg.get("error"):
            self._fail(batch, f"the copy was refused: {msg['error']}", drop_dst=True)
            return
        batch.copied.update(k for k in msg["keys"] if k in batch.keys)
        self._advance(batch)

    def worker_done(self, msg: wire.Message, sender: str | None = None) -> None:
        """The new owner's WORKER_DONE; ignored unless ``sender`` (as for ``copy_done``) is
        the batch's destination."""
        batch = self.batches.get(msg["mid"])
        if batch is None or sender not in (None, batch.dst):
            return
        batch.workers.update(k for k in msg["keys"] if k in batch.keys)
        try:
            batch.handover_wait_ms = max(batch.handover_wait_ms, float(msg.get("wait_ms") or 0.0))
        except (TypeError, ValueError):
            pass
        for name, pick in (("first_push_at", min), ("handover_at", min), ("done_at", max)):
            value = msg.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                old = batch.switch_seen.get(name)
                batch.switch_seen[name] = value if old is None else pick(old, value)
        self._advance(batch)

    def _advance(self, batch: Batch) -> None:
        job = self.state.jobs.get(batch.job)
        ready = (batch.copied & batch.workers) - batch.completed
        if not ready:
            return
        batch.completed |= ready
        if job is not None:
            for key in ready:
                job.table[key] = batch.dst
                job.moves.pop(key, None)
                if key in batch.replicas:
                    job.replicas[key] = batch.replicas[key]
        for key in ready:
            self.moving.pop((batch.job, key), None)
        self.completed += len(ready)
        self.outbox.send_agg(batch.src, wire.MIGRATE_DROP, None, job=batch.job, keys=sorted(ready))
        if batch.completed >= set(batch.keys):
            batch.phase = "done"
            batch.finished = self.clock()
            self.durations = (self.durations + [batch.finished - batch.started])[-100:]
            firsts = sorted(batch.first.values())
            self.recent = (self.recent + [{
                "mid": batch.mid, "job": batch.job, "from": batch.src, "to": batch.dst, "keys": len(batch.keys),
                "first_iterations": [firsts[0], firsts[-1]] if firsts else None,
                "precopied_keys": sum(1 for f in batch.followers.values() if f),
                "handover_wait_ms": batch.handover_wait_ms,
                # the new owner's time.monotonic: comparable with the workers' on one machine
                # (emulated hosts included), not across machines
                "switch_seen": dict(batch.switch_seen),
                "seconds": round(batch.finished - batch.started, 4)}])[-RECENT:]
            del self.batches[batch.mid]
            log.info("migration %d of job %s: %d keys %s -> %s in %.3fs", batch.mid, batch.job,
                     len(batch.keys), batch.src, batch.dst, batch.finished - batch.started)
            if batch.on_done is not None:
                batch.on_done(batch, True)

    def _fail(self, batch: Batch, why: str, drop_dst: bool) -> None:
        log.error("migration %d of job %s (%s -> %s) failed: %s", batch.mid, batch.job, batch.src, batch.dst, why)
        left = self._end(batch)
        job = self.state.jobs.get(batch.job)
        if job is not None:
            for key in left:
                job.moves.pop(key, None)
        if drop_dst and left:
            self.outbox.send_agg(batch.dst, wire.MIGRATE_DROP, None, job=batch.job, keys=left)
        self._drop_readied(batch, left)
        if batch.on_done is not None:
            batch.on_done(batch, False)

    def abandon(self, batch: Batch, lost: str) -> None:
        """Aggregator ``lost`` of ``batch`` is gone (``failover`` decides where its keys go):
        the batch ends unfinished. Its new replicas free what they readied for keys whose
        state will not reach them through this batch: all of them when the new owner was
        lost, else those the old owner had not handed over (``failover`` gives the new owner
        the others, with their new replicas)."""
        left = self._end(batch)
        kept = batch.copied if batch.dst != lost else set()
        self._drop_readied(batch, [k for k in left if k not in kept], skip=lost)
        if batch.on_done is not None:
            batch.on_done(batch, False)

    def _drop_readied(self, batch: Batch, keys: list[str], skip: str | None = None) -> None:
        """``MIGRATE_DROP`` of ``keys`` to their new replicas (never the old owner nor the
        keys' current replica: see ``_followers``), but ``skip``: they free the memory readied
        for the keys' state, and the backups the state sent ahead became there (``backups``)."""
        for agg in sorted({a for key in keys for a in batch.followers.get(key, ()) if a not in (batch.dst, skip)}):
            self.outbox.send_agg(agg, wire.MIGRATE_DROP, None, job=batch.job, keys=keys, backups=True)

    def _end(self, batch: Batch) -> list[str]:
        """Forget an unfinished batch; returns its keys that did not move."""
        self.batches.pop(batch.mid, None)
        batch.phase = "failed"
        left = [k for k in batch.keys if k not in batch.completed]
        for key in left:
            self.moving.pop((batch.job, key), None)
        self.failed += len(left)
        return left

    def forget_job(self, job: str) -> None:
        """The job was released: its batches end without callbacks."""
        for mid, batch in list(self.batches.items()):
            if batch.job == job:
                del self.batches[mid]
        for key in [k for k in self.moving if k[0] == job]:
            del self.moving[key]

    def status(self) -> dict:
        return {"active": sum(len(b.keys) - len(b.completed) for b in self.batches.values()),
                "completed": self.completed, "failed": self.failed,
                "batches_active": len(self.batches),
                "last_batch_s": round(self.durations[-1], 4) if self.durations else None,
                "recent": list(self.recent)}
