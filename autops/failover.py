"""pMaster's side of aggregator failures: a lost aggregator's keys move to live ones.

An aggregator whose heartbeats stop for ``heartbeat_timeout`` is lost. For every job with
keys there, ``Failover``:

* ends the migrations from or to it: keys whose copy had reached the new owner stay there;
  keys moving *to* it stay with their old owner (``MIGRATE_ABORT``); the rest are lost keys;
* gives each lost key a new owner: a ``server``-mode key goes to its replica, which holds
  its master copy, optimizer state and step (``FAILOVER`` with ``promote``); a ``sum``-mode
  key goes to a live aggregator of the job (the least loaded; any live one when the job has
  none left; one the provider starts when none is alive), which rebuilds it from the
  workers: each rank reports the last iteration it pulled (``RECOVER``) and resends the
  pushes it keeps (``agent``);
* chooses new replicas where a replica was lost or promoted (``REPLICA_SET``);
* bumps the job's ``epoch`` and records the lost aggregator, so the agents that ask for the
  table (they do when a request waits too long) learn which keys to recover. The table is
  answered only once every aggregator concerned acknowledged its part.

A server-mode key without a live replica (replication switched off for the job, or both
copies lost) cannot be recovered: the job fails with a message saying so.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

from . import wire
from .migration import Migrations
from .outbox import Outbox
from .pool import AggInfo, JobInfo, PoolState
from .providers import Provider
from .replication import choose_replica, replica_info

log = logging.getLogger("autops.failover")


class Failover:
    """Detects lost aggregators (``check``) and moves their keys; ``flush(job)`` answers the
    table requests of a job once its acknowledgements are in (pMaster's)."""

    def __init__(self, state: PoolState, outbox: Outbox, migrations: Migrations,
                 flush: Callable[[JobInfo], None], provider: Provider | None = None) -> None:
        self.state = state
        self.outbox = outbox
        self.migrations = migrations
        self.flush = flush
        self.provider = provider or Provider()
        self.starting: dict[str, list[tuple[str, str, list[str]]]] = {}   # new aggregator -> (job, lost, keys)
        self.lost: dict[str, AggInfo] = {}     # aggregators declared lost (state "lost"), for reports
        self.recovered_keys = 0
        self.failed_keys = 0
        self._acks = 0
        self._last_check: float | None = None

    def check(self, now: float) -> list[str]:
        """Declare aggregators lost whose heartbeats stopped; returns their ids. After a pause
        of pMaster itself (its loop did not run for half the timeout) the heartbeats waiting in
        its socket are read first: nobody is declared lost on this pass."""
        last, self._last_check = self._last_check, now
        if last is not None and now - last > self.state.heartbeat_timeout / 2:
            return []
        gone = [a.agg_id for a in list(self.state.aggs.values())
                if not a.alive(now, self.state.heartbeat_timeout)]
        for agg in gone:
            self.aggregator_lost(agg, now)
        return gone

    def aggregator_lost(self, agg: str, now: float) -> None:
        info = self.state.aggs.get(agg)
        if info is None:
            return
        log.warning("aggregator %s (pid %s on %s) is lost: no heartbeat for %.1fs", agg, info.pid, info.host,
                    now - info.last_seen)
        info.state = "lost"
        self.lost[agg] = info
        while len(self.lost) > 256:             # reports keep the latest ones
            self.lost.pop(next(iter(self.lost)))
        for job in list(self.state.jobs.values()):
            self._recover_job(job, agg)
        for cluster in self.state.clusters.values():
            cluster.aggs.discard(agg)
        self.state.forget_aggregator(agg)

    # --- one job ----------------------------------------------------------------------------
    def _recover_job(self, job: JobInfo, dead: str) -> None:
        lost = {k for k, owner in job.table.items() if owner == dead}
        for batch in self.migrations.active(job=job.job, aggs={dead}):
            left = [k for k in batch.keys if k not in batch.completed]
            self.migrations.abandon(batch)
            if batch.dst == dead:
                self._send(job, batch.src, wire.MIGRATE_ABORT, job=job.job, keys=left)
                continue
            for key in left:
                if key in batch.copied:
                    job.table[key] = batch.dst          # its state reached the new owner
                    if key in batch.replicas:
                        job.replicas[key] = batch.replicas[key]
                    lost.discard(key)
                else:
                    lost.add(key)
                    job.hint[key] = batch.dst           # rebuilt where it was going
        for key in lost | set(job.moves):
            job.moves.pop(key, None)
        touched = bool(lost)
        if lost:
            self._take_over(job, dead, sorted(lost))
        orphans = sorted(k for k, r in job.replicas.items() if r == dead and k in job.table)
        if orphans:
            touched = True
            self._rereplicate(job, orphans)
        if dead in job.aggregators or dead == job.home or touched:
            job.aggregators = sorted(set(job.table.values()) | {a for a in job.aggregators if a != dead})
            if job.home == dead or job.home not in self.state.aggs:
                job.home = next((a for a in job.aggregators if a != dead), None)
            job.temps = [a for a in job.temps if a != dead]
            job.touched.discard(dead)
            job.epoch += 1
            job.lost_aggs.add(dead)
        job.hint.clear()

    def _live_for(self, job: JobInfo, dead: str) -> list[str]:
        """The job's live aggregators, else every live one (least loaded first)."""
        live = {a.agg_id for a in self.state.live_aggregators() if a.agg_id != dead}
        load = self.state.load_bytes()
        own = [a for a in job.aggregators if a in live]
        return sorted(own or live, key=lambda a: (load.get(a, 0), a))

    def _take_over(self, job: JobInfo, dead: str, keys: list[str]) -> None:
        groups: dict[tuple, list[str]] = {}
        for key in keys:
            conf = job.tensors[job.keys[key].tensor][2]
            sig = (conf["mode"], conf["average"], conf["optimizer"], json.dumps(conf["hp"], sort_keys=True))
            if conf["mode"] == "server":
                replica = job.replicas.pop(key, None)
                if replica is None or replica not in self.state.aggs or replica == dead:
                    self._fail(job, f"aggregator {dead} was lost with the server-side state of {key!r} "
                                    f"and no replica of it is alive"
                                    + ("" if job.replicate else " (the job runs without replication)"))
                    return
                groups.setdefault((replica, True, *sig), []).append(key)
            elif not job.replicate:
                self._fail(job, f"aggregator {dead} was lost with keys of this job, which runs without "
                                "fault tolerance (its workers keep no copies of their pushes)")
                return
            else:
                live = self._live_for(job, dead)
                if not live:
                    self._start_for(job, dead, keys)
                    return
                hint = job.hint.get(key)
                groups.setdefault((hint if hint in live else live[0], False, *sig), []).append(key)
        for (owner, promote, mode, average, optimizer, hp), group in groups.items():
            replicas = {}
            for key in group:
                job.table[key] = owner
                if mode == "server" and job.replicate:
                    new = choose_replica(self.state, owner, exclude={dead})
                    if new is not None:
                        job.replicas[key] = new
                        replicas[key] = replica_info(self.state, new)
                        job.touched.add(new)
            job.touched.add(owner)
            self.recovered_keys += len(group)
            log.info("job %s: %d key(s) of lost aggregator %s %s %s", job.job, len(group), dead,
                     "promoted on their replica" if promote else "rebuilt from the workers on", owner)
            self._send(job, owner, wire.FAILOVER, job=job.job, secret=job.secret, world_size=job.world_size,
                       mode=mode, average=average, optimizer=optimizer, hp=json.loads(hp), promote=promote,
                       keys=[job.keys[k].to_wire() for k in group], replicas=replicas)

    def _start_for(self, job: JobInfo, dead: str, keys: list[str]) -> None:
        """No live aggregator is left: a fresh one from the provider takes the keys once it
        registered (``aggregator_registered``); the job's table waits until then."""
        started = self.provider.start(1) if self.provider.can_start(0) else []
        if not started:
            self._fail(job, f"aggregator {dead} was lost and no aggregator is left to take its keys")
            return
        log.info("job %s: aggregator %s started to take the keys of lost %s", job.job, started[0], dead)
        self.starting.setdefault(started[0], []).append((job.job, dead, keys))
        job.pending_acks.add(("starting", started[0]))

    def aggregator_registered(self, info: AggInfo) -> bool:
        """An aggregator registered: if it was started for lost keys, give them to it."""
        waiting = self.starting.pop(info.agg_id, None)
        if not waiting:
            return False
        info.state = "active"
        for job_id, dead, keys in waiting:
            job = self.state.jobs.get(job_id)
            if job is None:
                continue
            job.pending_acks.discard(("starting", info.agg_id))
            job.aggregators = sorted(set(job.aggregators) | {info.agg_id})
            self._take_over(job, dead, [k for k in keys if job.table.get(k) == dead])
            job.home = job.home if job.home in self.state.aggs else info.agg_id
            self.flush(job)
        return True

    def _rereplicate(self, job: JobInfo, keys: list[str]) -> None:
        """Keys whose replica was lost get a new one (their owner sends it the whole state)."""
        by_owner: dict[tuple, list[str]] = {}
        for key in keys:
            owner = job.table[key]
            new = choose_replica(self.state, owner, exclude=set(self.lost))
            if new is None:
                job.replicas.pop(key, None)
            else:
                job.replicas[key] = new
                job.touched.add(new)
            by_owner.setdefault((owner, new), []).append(key)
        for (owner, new), group in by_owner.items():
            self._send(job, owner, wire.REPLICA_SET, job=job.job, keys=group,
                       replica=replica_info(self.state, new) if new else None)

    # --- messages -----------------------------------------------------------------------
    def _send(self, record: JobInfo, agg: str, op: str, **fields) -> None:
        """``op`` to ``agg``; the job's table waits for the answer."""
        self._acks += 1
        ack = ("failover", self._acks)
        record.pending_acks.add(ack)
        self.outbox.send_agg(agg, op, lambda reply: self._acked(record.job, agg, op, ack, reply), **fields)

    def _acked(self, job_id: str, agg: str, op: str, ack: tuple, reply: wire.Message | None) -> None:
        job = self.state.jobs.get(job_id)
        if job is None:
            return
        job.pending_acks.discard(ack)
        if reply is None or reply.op == wire.ERROR:
            why = reply["message"] if reply is not None else "no answer"
            self._fail(job, f"aggregator {agg} could not take over after a failure ({op}): {why}")
        self.flush(job)

    def _fail(self, job: JobInfo, why: str) -> None:
        log.error("job %s: %s", job.job, why)
        self.failed_keys += 1
        job.failure = job.failure or why
        self.flush(job)

    def status(self) -> dict:
        return {"lost_aggregators": sorted(self.lost), "recovered_keys": self.recovered_keys,
                "failures": self.failed_keys}
