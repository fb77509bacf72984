"""pMaster's side of aggregator failures: a lost aggregator's keys move to live ones.

An aggregator whose heartbeats stop for ``heartbeat_timeout`` is lost. For every job with
keys there, ``Failover``:

* ends the migrations from or to it: keys whose copy had reached the new owner stay there;
  keys moving *to* it stay with their old owner (``MIGRATE_ABORT``); the rest are lost keys;
* gives each lost key a new owner: a ``server``-mode key goes to its replica, which holds
  its master copy, optimizer state and step (``FAILOVER`` with ``promote``); a ``sum``-mode
  key is placed like any task (``_place``) and its new owner rebuilds it from the workers:
  each rank reports the last iteration it pulled (``RECOVER``) and resends the pushes it
  keeps (``agent``);
* chooses new replicas where a replica was lost or promoted (``REPLICA_SET``); each first
  makes the memory for the state it will receive ready (``REPLICA_PREPARE``, at once), and
  the owner is told (``FAILOVER``, ``REPLICA_SET``) once it answered;
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

from ..wire import protocol as wire
from .assignment import pack_job
from .migration import Migrations
from .outbox import Outbox
from .pool import AggInfo, JobInfo, PoolState
from .providers import Provider
from .replication import choose_replica, replica_info

log = logging.getLogger("autops.master.failover")


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
        # new replicas making memory ready (``when_ready``): aggregator -> {ack: go on}
        self._readying: dict[str, dict[tuple, Callable[..., None]]] = {}

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
        # what waited for it to make a new replica's memory ready goes on now, before the
        # jobs give its keys and replicas to others (their messages must come after)
        for go_on in list(self._readying.pop(agg, {}).values()):
            go_on(None)
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
            self.migrations.abandon(batch, dead)
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

    def _place(self, job: JobInfo, dead: str, keys: list[str]) -> dict[str, str]:
        """New owners of lost ``sum`` keys. A key that was migrating keeps its destination.

        A packed job's keys are packed like at its arrival (Pseudocode 3, ``pack_job``) onto
        its cluster's live aggregators; where none has room, an idle aggregator of the pool
        joins the cluster, and after those a fresh one from the provider (named ``+i`` here).
        Other jobs (profiling, dedicated, or not profiled yet) spread over their own live
        aggregators, least loaded first, else over any live one; none alive gives ``+0``.
        """
        live = {a.agg_id for a in self.state.live_aggregators() if a.agg_id != dead}
        placed = {k: job.hint[k] for k in keys if job.hint.get(k) in live}
        rest = [k for k in keys if k not in placed]
        cluster = self.state.clusters.get(job.cluster) if job.cluster else None
        if rest and job.state == "packed" and cluster is not None and job.standalone:
            loads = self.state.loads([a for a in self.state.cluster_aggs(cluster) if a in live])
            for key, owner in placed.items():
                if owner in loads:
                    d, e = loads[owner].get(job.job, (job.standalone, 0.0))
                    loads[owner][job.job] = (d, e + job.cost(key))
            idle = [a.agg_id for a in self.state.idle() if a.agg_id != dead]
            table, _ = pack_job(job.job, job.standalone, [(k, job.cost(k)) for k in rest], loads,
                                lambda i: idle[i] if i < len(idle) else f"+{i - len(idle)}")
            return {**placed, **table}
        ranked = self._live_for(job, dead)
        return {**placed, **{k: ranked[0] if ranked else "+0" for k in rest}}

    def _take_over(self, job: JobInfo, dead: str, keys: list[str], owner: str | None = None) -> None:
        """New owners for ``keys`` of lost ``dead`` (all of them to ``owner`` when given)."""
        modes = {k: job.conf(job.keys[k].tensor)["mode"] for k in keys}
        summed = [k for k in keys if modes[k] != "server"]
        if summed and not job.replicate:
            self._fail(job, f"aggregator {dead} was lost with keys of this job, which runs without "
                            "fault tolerance (its workers keep no copies of their pushes)")
            return
        placed = {k: owner for k in summed} if owner else self._place(job, dead, summed)
        fresh = sorted({a for a in placed.values() if a.startswith("+")})
        if fresh:
            ranked = self._live_for(job, dead)
            started = self.provider.start(len(fresh)) if self.provider.can_start(0) >= len(fresh) else []
            if len(started) == len(fresh):
                names = dict(zip(fresh, started))
                for new in started:
                    log.info("job %s: aggregator %s started to take keys of lost %s", job.job, new, dead)
                    self.starting.setdefault(new, []).append(
                        (job.job, dead, [k for k, a in placed.items() if names.get(a) == new]))
                    job.pending_acks.add(("starting", new))
                placed = {k: a for k, a in placed.items() if a not in names}
            elif ranked:
                log.info("job %s: no aggregator can be started; keys of lost %s go to %s", job.job, dead, ranked[0])
                placed = {k: ranked[0] if a in fresh else a for k, a in placed.items()}
            else:
                self._fail(job, f"aggregator {dead} was lost and no aggregator is left to take its keys")
                return
        self._join_cluster(job, set(placed.values()))
        groups: dict[tuple, list[str]] = {}
        for key in keys:
            conf = job.conf(job.keys[key].tensor)
            sig = (conf["mode"], conf["average"], conf["optimizer"], json.dumps(conf["hp"], sort_keys=True))
            if conf["mode"] == "server":
                replica = job.replicas.pop(key, None)
                if replica is None or replica not in self.state.aggs or replica == dead:
                    self._fail(job, f"aggregator {dead} was lost with the server-side state of {key!r} "
                                    f"and no replica of it is alive"
                                    + ("" if job.replicate else " (the job runs without replication)"))
                    return
                groups.setdefault((replica, True, *sig), []).append(key)
            elif key in placed:
                groups.setdefault((placed[key], False, *sig), []).append(key)
        for (new_owner, promote, mode, average, optimizer, hp), group in groups.items():
            replicas = {}
            for key in group:
                job.table[key] = new_owner
                if mode == "server" and job.replicate:
                    new = choose_replica(self.state, new_owner, exclude={dead})
                    if new is not None:
                        job.replicas[key] = new
                        replicas[key] = replica_info(self.state, new)
                        job.touched.add(new)
            job.touched.add(new_owner)
            self.recovered_keys += len(group)
            log.info("job %s: %d key(s) of lost aggregator %s %s %s", job.job, len(group), dead,
                     "promoted on their replica" if promote else "rebuilt from the workers on", new_owner)
            settings = dict(job=job.job, secret=job.secret, world_size=job.world_size, mode=mode, average=average,
                            optimizer=optimizer, hp=json.loads(hp))
            self.when_ready(job, self.by_replica(replicas), settings,
                             lambda o=new_owner, g=group, r=replicas, f=settings, p=promote: self._send(
                                 job, o, wire.FAILOVER, **f, promote=p, keys=[job.keys[k].to_wire() for k in g],
                                 replicas=r))

    def _join_cluster(self, job: JobInfo, aggs: set[str]) -> None:
        """Idle (or freshly started) aggregators that took keys of a packed job join its cluster."""
        cluster = self.state.clusters.get(job.cluster) if job.cluster else None
        for agg in aggs:
            info = self.state.aggs.get(agg)
            if info is None or info.state not in ("idle", "starting"):
                continue
            info.state = "active"
            if cluster is not None and job.state == "packed":
                info.cluster = cluster.name
                cluster.aggs.add(agg)
            else:
                info.exclusive = info.exclusive or (job.job if job.state == "dedicated" else None)

    def aggregator_registered(self, info: AggInfo) -> bool:
        """An aggregator registered: if it was started for lost keys, give them to it."""
        waiting = self.starting.pop(info.agg_id, None)
        if not waiting:
            return False
        info.state = "starting"
        for job_id, dead, keys in waiting:
            job = self.state.jobs.get(job_id)
            if job is None:
                continue
            job.pending_acks.discard(("starting", info.agg_id))
            job.aggregators = sorted(set(job.aggregators) | {info.agg_id})
            self._take_over(job, dead, [k for k in keys if job.table.get(k) == dead], owner=info.agg_id)
            job.home = job.home if job.home in self.state.aggs else info.agg_id
            self.flush(job)
        if info.state == "starting":
            info.state = "active"
        return True

    def _rereplicate(self, job: JobInfo, keys: list[str]) -> None:
        """Keys whose replica was lost get a new one (their owner sends it the whole state,
        once the new one made the memory for it ready)."""
        by_owner: dict[tuple, list[str]] = {}
        for key in keys:
            owner = job.table[key]
            new = choose_replica(self.state, owner, exclude=set(self.lost))
            if new is None:
                job.replicas.pop(key, None)
            else:
                job.replicas[key] = new
                job.touched.add(new)
            conf = job.conf(job.keys[key].tensor)
            by_owner.setdefault((owner, new, conf["average"], conf["optimizer"],
                                 json.dumps(conf["hp"], sort_keys=True)), []).append(key)
        for (owner, new, average, optimizer, hp), group in by_owner.items():
            settings = dict(job=job.job, secret=job.secret, world_size=job.world_size, mode="server",
                            average=average, optimizer=optimizer, hp=json.loads(hp))
            self.when_ready(job, {new: group} if new else {}, settings,
                             lambda o=owner, n=new, g=group: self._send(
                                 job, o, wire.REPLICA_SET, job=job.job, keys=g,
                                 replica=replica_info(self.state, n) if n in self.state.aggs else None))

    @staticmethod
    def by_replica(replicas: dict[str, dict]) -> dict[str, list[str]]:
        """``{key: replica info}`` as ``{replica: keys}``."""
        out: dict[str, list[str]] = {}
        for key, info in replicas.items():
            out.setdefault(info["agg"], []).append(key)
        return out

    def when_ready(self, job: JobInfo, readying: dict[str, list[str]], settings: dict,
                   then: Callable[[], None]) -> None:
        """``then()`` once each new replica in ``readying`` made the memory for its keys'
        state ready (``replica_prepare`` with ``settings``, at once), so that its serving
        thread does not fault that state in when the owner sends it -- or once it answered
        with an error, was lost, or did not answer: that only costs it the page faults. The
        job's table waits meanwhile. Used after a failure here and at a job's arrival by
        pMaster."""
        if not readying:
            then()
            return
        self._acks += 1
        ack = ("readying", self._acks)
        job.pending_acks.add(ack)
        waiting = set(readying)

        def answered(agg: str, reply: wire.Message | None) -> None:
            if agg not in waiting:
                return
            waiting.discard(agg)
            pending = self._readying.get(agg, {})
            pending.pop(ack, None)
            if not pending:
                self._readying.pop(agg, None)
            if reply is None or reply.op == wire.ERROR:
                log.warning("job %s: new replica %s did not make memory ready: %s", job.job, agg,
                            reply["message"] if reply is not None else "no answer")
            if waiting or self.state.jobs.get(job.job) is not job:
                return
            then()                              # its own acknowledgement first: the table keeps waiting
            job.pending_acks.discard(ack)
            self.flush(job)

        for agg, keys in sorted(readying.items()):
            self._readying.setdefault(agg, {})[ack] = lambda reply, a=agg: answered(a, reply)
            self.outbox.send_agg(agg, wire.REPLICA_PREPARE, lambda reply, a=agg: answered(a, reply),
                                 **settings, keys=[job.keys[k].to_wire() for k in keys], at_once=True)

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
