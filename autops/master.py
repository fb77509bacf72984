"""pMaster: the pool of aggregators, the jobs, and the assignment table it owns.

Aggregators register and heartbeat (with their per-key CPU profile); jobs register
``(job, W, aggregators requested, mode, optimizer)`` and receive a per-job secret once
admission control let them in and their temporary aggregators are up; ranks declare
tensors; pMaster plans keys (partitioning and batching), assigns them byte-balanced over
the job's aggregators, tells the aggregators (``ASSIGN``), and only then hands agents the
table. Replies wait, without blocking the loop, until every aggregator concerned answered.
The pool's records and queries live in ``pool`` (``PoolState``), control messages to
aggregators and their replies in ``outbox``; elasticity (profiling, packing, revert,
recycling, clusters) in ``elastic`` and live migration in ``migration`` get that state, the
outbox and their collaborators from here and never see pMaster itself; the aggregator supply
is ``providers``. pMaster publishes a utilization report and Prometheus metrics (``report``).
"""
from __future__ import annotations

import itertools
import json
import logging
import secrets
import signal
import threading
import time
from typing import Callable

import numpy as np
import zmq

from . import wire
from .assignment import spread_by_bytes
from .elastic import Elastic, ElasticConfig
from .failover import Failover
from .migration import Migrations
from .outbox import AggregatorOutbox
from .pool import AggInfo, JobInfo, PoolState
from .providers import Provider, StandbyProvider
from .replication import choose_replica, replica_info
from .scaling import cluster_free_cpu
from .partition import DEFAULT_PARTITION_BYTES, DEFAULT_SMALL_BYTES, KeySpec, plan_keys, validate_tensor
from .store import MODES
from .transport.zmq import make_context


def _optim():
    from . import optim   # server mode only
    return optim


log = logging.getLogger("autops.master")


class Master:
    """pMaster's state and message loop; ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, bind: str = "tcp://127.0.0.1:5555", heartbeat_timeout: float = 5.0,
                 assign_timeout: float = 60.0, provider: Provider | None = None,
                 elastic: ElasticConfig | None = None, report_bind: str | None = None,
                 metrics_port: int | None = None, report_period: float = 1.0,
                 make_provider: Callable[[str], Provider] | None = None) -> None:
        """``make_provider(address)``: builds the provider once the master's address is known
        (a local provider tells the aggregators it starts where pMaster is)."""
        self.assign_timeout = assign_timeout
        self.ctx = make_context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.state = PoolState(heartbeat_timeout, clock=time.monotonic)
        self.clock = self.state.clock
        self.started = self.clock()
        self.outbox = AggregatorOutbox(self.state, self._reply, assign_timeout)
        self._agg_ids = itertools.count()
        self._acks = itertools.count(1)        # ASSIGN messages awaiting an answer (JobInfo.pending_acks)
        self._stop = threading.Event()
        if provider is None and make_provider is not None:
            provider = make_provider(self.address.replace("0.0.0.0", "127.0.0.1"))
        self.provider = provider or StandbyProvider()
        self.config = elastic or ElasticConfig()
        self.migrations = Migrations(self.state, self.outbox)
        self.elastic = Elastic(self.state, self.outbox, self.config, self.provider, self.migrations)
        self.failover = Failover(self.state, self.outbox, self.migrations, self._flush_parked, self.provider)
        self.report_period = report_period
        self._next_report = self.clock()
        self.publisher = None
        self.exporter = None
        if report_bind:
            from .report import ReportPublisher
            self.publisher = ReportPublisher(report_bind, context=self.ctx)
        if metrics_port is not None:
            from .report import PrometheusExporter
            self.exporter = PrometheusExporter()
            self.metrics_port = self.exporter.start(metrics_port)

    # --- lifecycle ------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def run(self) -> None:
        log.info("pMaster listening on %s", self.address)
        try:
            while not self._stop.is_set():
                if self.sock.poll(200):
                    for _ in range(256):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
                now = self.clock()
                try:
                    self.failover.check(now)
                    self.outbox.expire(now)
                    for job_id in self.elastic.expired_jobs(now):
                        self.release_job(job_id)
                    self.elastic.tick(now)
                except Exception:  # keep the shared service alive
                    log.exception("internal error in a periodic pass")
                if now >= self._next_report:
                    self._next_report = now + self.report_period
                    self._publish()
        finally:
            if self.publisher is not None:
                self.publisher.close()
            if self.exporter is not None:
                self.exporter.stop()
            self.provider.close()
            self.sock.close(0)
            self.ctx.term()

    def _publish(self) -> None:
        if self.publisher is None and self.exporter is None:
            return
        status = self.status()
        if self.publisher is not None:
            self.publisher.publish(status)
        if self.exporter is not None:
            self.exporter.update(status)

    # --- helpers --------------------------------------------------------------------
    def _reply(self, identity: bytes, frames: list) -> None:
        self.sock.send_multipart([identity, *frames])

    def _dispatch(self, frames: list) -> None:
        identity, body = frames[0], frames[1:]
        req = None
        try:
            msg = wire.decode(body)
            req = msg.get("req")
            handler = {
                wire.REGISTER_AGG: self._register_agg,
                wire.HEARTBEAT: self._heartbeat,
                wire.REGISTER_JOB: self._register_job,
                wire.DECLARE: self._declare,
                wire.GET_TABLE: self._get_table,
                wire.JOB_DONE: self._job_done,
                wire.STATUS: self._status,
                wire.OK: self._aggregator_reply,
                wire.ERROR: self._aggregator_reply,
                wire.PROFILE: self._profile,
                wire.TENSOR_COPY_DONE: lambda i, m: self.migrations.copy_done(m, self.state.by_identity.get(i, "")),
                wire.WORKER_DONE: lambda i, m: self.migrations.worker_done(m, self.state.by_identity.get(i, "")),
                wire.MIGRATE_CUTOVER: lambda i, m: self.migrations.cutover(m, self.state.by_identity.get(i, "")),
                wire.MIGRATE: self._migrate,
            }.get(msg.op)
            if handler is None:
                raise wire.ProtocolError(f"operation {msg.op!r} is not served by pMaster")
            handler(identity, msg)
        except (wire.ProtocolError, ValueError) as exc:
            self._reply(identity, wire.error(str(exc), req=req))
        except Exception as exc:  # keep the shared service alive
            log.exception("internal error")
            self._reply(identity, wire.error(f"internal master error: {exc.__class__.__name__}: {exc}", req=req))

    # --- aggregators ----------------------------------------------------------------
    def _register_agg(self, identity: bytes, msg: wire.Message) -> None:
        agg_id = msg.get("name") or f"agg-{next(self._agg_ids)}"
        known = self.state.aggs.get(agg_id)
        if known is not None and known.identity != identity and self.state.alive(known):
            raise ValueError(f"an aggregator named {agg_id!r} is already registered and alive")
        info = AggInfo(agg_id, identity, dict(msg["endpoints"]), msg["host"], msg["pid"], self.clock())
        self.state.add_aggregator(info)
        # one declared lost comes back empty: its keys have other owners now
        reset = self.failover.lost.pop(agg_id, None) is not None
        log.info("aggregator %s registered (pid %s, %s)%s", agg_id, msg["pid"], msg["endpoints"],
                 " after it was lost: it drops what it held" if reset else "")
        if not reset:
            self._adopt(info, msg.get("holding") or {})
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), agg=agg_id, reset=reset))
        if self.failover.aggregator_registered(info):
            return
        if not self.elastic.registered_for_revert(info):
            ready = self.elastic.aggregator_registered(info)
            if ready is not None:
                self._flush_registrations(ready)

    def _adopt(self, info: AggInfo, holding: dict) -> None:
        """An aggregator that registers holding keys (this pMaster restarted): rebuild the
        jobs' records from what it holds; the workers declare their tensors again."""
        if not isinstance(holding, dict):
            raise ValueError("register_agg: 'holding' must be a map")
        for job_id, held in holding.items():
            job = self.state.jobs.get(job_id)
            if job is None:
                job = JobInfo(str(job_id), str(held["secret"]), int(held["world_size"]), 0, "sum", True, None, {},
                              DEFAULT_PARTITION_BYTES, DEFAULT_SMALL_BYTES, [])
                job.state = "dedicated"          # elasticity leaves an adopted job where it is
                self.state.jobs[job.job] = job
                log.info("job %s adopted from aggregator %s (pMaster restarted)", job.job, info.agg_id)
            elif job.secret != held["secret"]:
                log.error("aggregator %s holds job %s with another secret; ignored", info.agg_id, job_id)
                continue
            for entry in held["keys"]:
                spec = KeySpec.from_wire(entry)
                mode, average, optimizer, hp, role = entry[6:11]
                job.adopted[spec.tensor] = {"mode": mode, "average": bool(average), "optimizer": optimizer,
                                            "hp": hp or {}}
                if role == "replica":
                    job.replicas[spec.key] = info.agg_id
                elif role == "owner" or spec.key not in job.table:
                    job.keys[spec.key] = spec
                    job.table[spec.key] = info.agg_id
            job.touched.add(info.agg_id)
            job.aggregators = sorted(set(job.table.values()))
            job.home = job.home or (job.aggregators[0] if job.aggregators else None)
            job.last_heard = self.clock()

    def _heartbeat(self, identity: bytes, msg: wire.Message) -> None:
        agg_id = self.state.by_identity.get(identity)
        if agg_id is None or agg_id not in self.state.aggs:
            # pMaster restarted: ask the aggregator to register again
            self._reply(identity, wire.error("unknown aggregator; register again", reregister=True))
            return
        info = self.state.aggs[agg_id]
        info.last_seen = self.clock()
        info.stats = {k: v for k, v in msg.fields.items() if k not in ("agg", "profile")}
        self.elastic.on_aggregator_profile(msg.get("profile") or {})

    # --- jobs -----------------------------------------------------------------------
    def _register_job(self, identity: bytes, msg: wire.Message) -> None:
        job_id, world, rank, mode = msg["job"], msg["world_size"], msg["rank"], msg["mode"]
        if not job_id:
            raise ValueError("job id must not be empty")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"job {job_id}: rank {rank} is outside world size {world}")
        if mode not in MODES:
            raise ValueError(f"job {job_id}: mode must be one of {MODES}, got {mode!r}")
        optimizer, hp = msg.get("optimizer"), msg.get("hp") or {}
        job = self.state.jobs.get(job_id)
        if msg.get("rejoin") and self.clock() - self.started < self.state.heartbeat_timeout:
            # every live aggregator registers again within a heartbeat timeout: until then the
            # job's table may lack the keys of one that has not
            raise ValueError(f"job {job_id} is not registered yet: pMaster restarted and waits for its "
                             "aggregators to register again; retry")
        if job is None and msg.get("rejoin"):
            raise ValueError(f"job {job_id} is not registered: pMaster restarted and no aggregator holds "
                             "the job (its state is lost)")
        if job is None:
            if mode == "server":
                _optim().make_optimizer(optimizer or "", hp)  # raises ValueError with a clear message
            requested = max(0, int(msg["num_aggregators"] or 0))
            if not self.state.live_aggregators() and not self.provider.can_start(0):
                raise ValueError("no aggregator is registered with this master; start one with "
                                 "`autops aggregator --master ADDRESS`")
            refused = self.elastic.refuse_reason(requested)
            if refused:
                raise ValueError(f"job {job_id}: {refused}")
            job = JobInfo(job_id, msg.get("secret") or secrets.token_hex(16), world, requested, mode,
                          bool(msg.get("average", True)), optimizer, hp,
                          int(msg.get("partition_bytes") or DEFAULT_PARTITION_BYTES),
                          int(msg.get("small_bytes") or DEFAULT_SMALL_BYTES), [], requested=requested)
            job.replicate = bool(msg.get("replicate", True))
            self.elastic.reserve(job)
            job.home = job.aggregators[0] if job.aggregators else None
            self.state.jobs[job_id] = job
            log.info("job %s registered: W=%d mode=%s asked for %d aggregator(s), got %s%s", job_id, world,
                     mode, requested, job.aggregators, f" (+{len(job.pending)} starting)" if job.pending else "")
        else:
            if (msg.get("secret") or msg.get("rejoin")) and msg.get("secret") != job.secret:
                raise ValueError(f"job {job_id}: wrong secret")
            if msg.get("rejoin") and not job.tensors:
                # adopted from its aggregators after a restart: the workers bring the job's settings
                job.mode, job.average, job.optimizer, job.hp = mode, bool(msg.get("average", True)), \
                    msg.get("optimizer"), msg.get("hp") or {}
                job.partition_bytes = int(msg.get("partition_bytes") or DEFAULT_PARTITION_BYTES)
                job.small_bytes = int(msg.get("small_bytes") or DEFAULT_SMALL_BYTES)
                job.replicate = bool(msg.get("replicate", True))
            if (world, mode) != (job.world_size, job.mode):
                raise ValueError(f"job {job_id} exists with world size {job.world_size} and mode {job.mode}; "
                                 f"rank {rank} asked for {world} and {mode}")
            if rank in job.ranks and not msg.get("rejoin"):
                raise ValueError(f"job {job_id}: rank {rank} has already joined; job ids must be unique "
                                 "per running job")
        job.ranks.add(rank)
        job.last_heard = self.clock()
        if job.pending:
            job.registrations.append((identity, msg.get("req")))
        else:
            self._reply(identity, self._registered_frames(job, msg.get("req")))

    def _registered_frames(self, job: JobInfo, req) -> list:
        if job.home is None and job.aggregators:
            job.home = job.aggregators[0]
        job.touched.update(job.aggregators)
        return wire.encode(
            wire.OK, req=req, secret=job.secret, aggregators=job.aggregators, home=job.home,
            endpoints={a: {"endpoints": self.state.aggs[a].endpoints, "host": self.state.aggs[a].host}
                       for a in job.aggregators if a in self.state.aggs})

    def _flush_registrations(self, job: JobInfo) -> None:
        """The job's temporary aggregators are up: answer the ranks that registered meanwhile."""
        if job.home is None and job.aggregators:
            job.home = job.aggregators[0]
        waiting, job.registrations = job.registrations, []
        for identity, req in waiting:
            self._reply(identity, self._registered_frames(job, req))

    def _job(self, msg: wire.Message) -> JobInfo:
        job = self.state.jobs.get(msg["job"])
        if job is None:
            raise ValueError(f"job {msg['job']!r} is not registered")
        if msg["secret"] != job.secret:
            raise ValueError(f"job {msg['job']!r}: wrong secret")
        return job

    def _declare(self, identity: bytes, msg: wire.Message) -> None:
        job = self._job(msg)
        wire.check_declared(msg["tensors"], job.partition_bytes, job.tensors, len(job.keys))  # limits first
        new, declared = [], {}          # recorded once every entry passed: a refused DECLARE changes nothing
        for item in msg["tensors"]:
            if not isinstance(item, (list, tuple)) or len(item) not in (3, 4):
                raise ValueError(f"declare: malformed tensor entry {item!r}")
            name, shape, dtype = validate_tensor(*item[:3])
            conf = job.adopted.get(name) or self._tensor_conf(job, name, item[3] if len(item) == 4 else {})
            known = job.tensors.get(name) or declared.get(name)
            if known is not None:
                if known[:2] != (shape, dtype) or known[2]["mode"] != conf["mode"]:
                    raise ValueError(f"job {job.job}: tensor {name!r} was declared as {list(known[0])} "
                                     f"{known[1]} ({known[2]['mode']}), now as {list(shape)} {dtype} "
                                     f"({conf['mode']})")
                continue
            declared[name] = (shape, dtype, conf)
            new.append((name, shape, dtype))
        job.tensors.update(declared)
        if new:
            # keys an aggregator already holds (adopted after a restart) keep their owner
            keys = [k for k in plan_keys(new, job.partition_bytes, job.small_bytes) if k.key not in job.keys]
            load = {}
            for key, agg in job.table.items():
                load[agg] = load.get(agg, 0) + job.keys[key].nbytes
            # balanced within the job; ties go to the aggregator with less load from other jobs
            pool_load = self.state.load_bytes()
            order = sorted(job.aggregators, key=lambda a: (pool_load.get(a, 0), job.aggregators.index(a)))
            table = spread_by_bytes([(k.key, k.nbytes) for k in keys], order, load)
            for spec in keys:
                job.keys[spec.key] = spec
            job.table.update(table)
            if keys:
                self._send_assign(job, [k for k in keys])
        self._answer_table(job, identity, msg.get("req"))

    @staticmethod
    def _tensor_conf(job: JobInfo, name: str, opts: object) -> dict:
        """Per-tensor aggregation settings; the job's registration gives the defaults."""
        if not isinstance(opts, dict):
            raise ValueError(f"declare: options of tensor {name!r} must be a map")
        conf = {"mode": opts.get("mode", job.mode), "average": bool(opts.get("average", job.average)),
                "optimizer": opts.get("optimizer", job.optimizer), "hp": opts.get("hp", job.hp) or {}}
        if conf["mode"] not in MODES:
            raise ValueError(f"tensor {name!r}: mode must be one of {MODES}, got {conf['mode']!r}")
        if conf["mode"] == "server":
            _optim().make_optimizer(conf["optimizer"] or "", conf["hp"])
        return conf

    def _send_assign(self, job: JobInfo, keys: list[KeySpec]) -> None:
        groups: dict[tuple, list] = {}
        for spec in keys:
            conf = job.tensors[spec.tensor][2]
            group = (job.table[spec.key], conf["mode"], conf["average"], conf["optimizer"],
                     json.dumps(conf["hp"], sort_keys=True))
            groups.setdefault(group, []).append(spec)
        for (agg_id, mode, average, optimizer, hp), specs in groups.items():
            job.touched.add(agg_id)
            ack = next(self._acks)
            job.pending_acks.add(ack)
            self.outbox.send_agg(agg_id, wire.ASSIGN,
                                 lambda reply, a=agg_id, n=ack: self._assigned(job.job, a, n, reply),
                                 job=job.job, secret=job.secret, world_size=job.world_size, mode=mode,
                                 average=average, optimizer=optimizer, hp=json.loads(hp),
                                 keys=[s.to_wire() for s in specs], replicas=self._replicas(job, agg_id, mode, specs))

    def _replicas(self, job: JobInfo, owner: str, mode: str, specs: list[KeySpec]) -> dict:
        """Replicas for new server-mode keys of ``owner`` (``replication``), recorded in the job."""
        if mode != "server" or not job.replicate:
            return {}
        replica = choose_replica(self.state, owner)
        if replica is None:
            log.warning("job %s: no second aggregator to replicate server-mode keys of %s to; they are "
                        "lost if it fails", job.job, owner)
            return {}
        job.touched.add(replica)
        for spec in specs:
            job.replicas[spec.key] = replica
        info = replica_info(self.state, replica)
        return {spec.key: info for spec in specs}

    def _assigned(self, job_id: str, agg_id: str, ack: int, reply: wire.Message | None) -> None:
        """An aggregator's answer to ``ASSIGN`` (None: none within ``assign_timeout``)."""
        job = self.state.jobs.get(job_id)
        if job is None:
            return
        job.pending_acks.discard(ack)
        if reply is None:
            job.failure = f"an aggregator of job {job_id} did not acknowledge its assignment " \
                          f"within {self.assign_timeout:.0f}s"
        elif reply.op == wire.ERROR:
            job.failure = f"aggregator {agg_id} refused the assignment: {reply['message']}"
        self._flush_parked(job)

    def _aggregator_reply(self, identity: bytes, msg: wire.Message) -> None:
        self.outbox.deliver(msg, identity)      # only the aggregator asked may answer

    def _table_frames(self, job: JobInfo, req) -> list:
        if job.failure:
            return wire.error(job.failure, req=req)
        keys, used = [], set(job.aggregators)
        for key, spec in job.keys.items():
            move = job.moves.get(key)
            keys.append([*spec.to_wire(), job.table[key], list(move) if move else None])
            used.add(job.table[key])
            if move:
                used.add(move[0])
        if job.home:
            used.add(job.home)
        aggs = {a: {"endpoints": self.state.aggs[a].endpoints, "host": self.state.aggs[a].host}
                for a in used if a in self.state.aggs}
        return wire.encode(wire.OK, req=req, keys=keys, aggregators=aggs, home=job.home,
                           tensors=[[n, list(s), d] for n, (s, d, _) in job.tensors.items()],
                           epoch=job.epoch, lost=sorted(job.lost_aggs))

    def _answer_table(self, job: JobInfo, identity: bytes, req) -> None:
        if job.pending_acks:
            job.parked.append((identity, req))
        else:
            self._reply(identity, self._table_frames(job, req))

    def _flush_parked(self, job: JobInfo) -> None:
        if job.pending_acks and not job.failure:
            return
        parked, job.parked = job.parked, []
        for identity, req in parked:
            self._reply(identity, self._table_frames(job, req))

    def _get_table(self, identity: bytes, msg: wire.Message) -> None:
        job = self._job(msg)
        if msg.get("rank") is not None and msg["rank"] not in job.ranks:
            # pMaster restarted and rebuilt the job from its aggregators: the rank joins again
            raise ValueError(f"job {job.job!r}: rank {msg['rank']} is not registered with this pMaster "
                             "(it restarted); register again")
        since = msg.get("since")
        if since is not None and since == job.epoch and not job.failure:
            # an agent's periodic check: nothing moved since the table it has
            self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), epoch=job.epoch))
            return
        self._answer_table(job, identity, msg.get("req"))

    def _job_done(self, identity: bytes, msg: wire.Message) -> None:
        job = self._job(msg)
        job.done_ranks.add(msg["rank"])
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req")))
        if job.done_ranks >= job.ranks:
            self.release_job(job.job)

    def release_job(self, job_id: str) -> None:
        if self.elastic.release_job(job_id):
            log.info("job %s finished and was released", job_id)

    def _profile(self, identity: bytes, msg: wire.Message) -> None:
        """One record per period from an agent (no reply)."""
        job = self.state.jobs.get(msg["job"])
        if job is not None and msg["secret"] == job.secret:
            self.elastic.on_profile(job, msg)

    def _migrate(self, identity: bytes, msg: wire.Message) -> None:
        """Operator request: move keys of a job (all by default) to the given aggregators."""
        job = self.state.jobs.get(msg["job"])
        if job is None:
            raise ValueError(f"job {msg['job']!r} is not registered")
        keys = list(msg.get("keys") or job.keys)
        unknown = [k for k in keys if k not in job.keys]
        if unknown:
            raise ValueError(f"job {job.job}: unknown keys {unknown[:4]}")
        targets = list(msg.get("to") or [])
        live = {a.agg_id for a in self.state.live_aggregators()}
        if not targets:
            current = {job.table[k] for k in keys}
            targets = sorted(a for a in live if a not in current)
        bad = [a for a in targets if a not in live]
        if bad or not targets:
            raise ValueError(f"cannot migrate to {bad or 'nowhere'}: live aggregators are {sorted(live)}")
        for a in targets:
            info = self.state.aggs[a]
            if info.state == "idle":
                info.state, info.exclusive = "active", job.job
        table = spread_by_bytes([(k, job.keys[k].nbytes) for k in keys], targets)
        before = {job.table[k] for k in keys}
        job.aggregators = sorted(set(targets) | {job.table[k] for k in job.keys if k not in table})
        self.elastic.migrate(job, table, after=sorted(before - set(targets)))
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), keys=len(table),
                                          batches=len(self.migrations.active(job=job.job))))

    # --- reporting ------------------------------------------------------------------
    def status(self) -> dict:
        """The pool as plain data: the source of ``autops status``, reports and metrics."""
        from .report import skew_of
        now = self.clock()
        load = self.state.load_bytes()
        tasks: dict[str, int] = {}
        jobs_on: dict[str, set] = {}
        for job in self.state.jobs.values():
            for key, agg in job.table.items():
                tasks[agg] = tasks.get(agg, 0) + 1
                jobs_on.setdefault(agg, set()).add(job.job)
        aggregators = []
        for a in [*self.state.aggs.values(), *self.failover.lost.values()]:
            extra = {k: v for k, v in a.stats.items() if k not in ("cycle_s", "jobs")}
            aggregators.append({
                **extra, "id": a.agg_id, "cluster": a.cluster, "state": a.state,
                "alive": a.alive(now, self.state.heartbeat_timeout), "host": a.host, "pid": a.pid,
                "endpoints": a.endpoints, "cpu_percent": a.stats.get("cpu_percent"), "busy_fraction": a.busy,
                "holds_jobs": a.stats.get("jobs", []),
                "cycle_s": a.stats.get("cycle_s"), "tasks": tasks.get(a.agg_id, 0),
                "jobs": sorted(jobs_on.get(a.agg_id, ())), "assigned_bytes": load.get(a.agg_id, 0),
                "exclusive": a.exclusive})
        jobs = []
        for j in self.state.jobs.values():
            tensor_bytes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                            for shape, dtype, _ in j.tensors.values()]
            per_agg_keys: dict[str, int] = {}
            per_agg_bytes: dict[str, int] = {}
            for key, agg in j.table.items():
                per_agg_keys[agg] = per_agg_keys.get(agg, 0) + 1
                per_agg_bytes[agg] = per_agg_bytes.get(agg, 0) + j.keys[key].nbytes
            speed = j.standalone / j.measured if j.standalone and j.measured else None
            costs = [j.cost(k) for k in j.keys] if j.e else []
            jobs.append({
                "job": j.job, "state": j.state, "world_size": j.world_size, "mode": j.mode,
                "cluster": j.cluster, "requested_aggregators": j.requested,
                "aggregators": sorted(per_agg_keys) or list(j.aggregators), "tensors": len(j.tensors),
                "keys": len(j.keys), "bytes": sum(k.nbytes for k in j.keys.values()),
                "skew": round(skew_of(tensor_bytes), 4), "iterations": j.iterations,
                "iteration_time_s": j.measured, "standalone_iteration_time_s": j.standalone,
                "speed_vs_standalone": round(speed, 4) if speed else None,
                "cpu_demand": round(sum(costs) / j.standalone, 4) if costs and j.standalone else None,
                "reverts": j.reverts, "ranks_joined": sorted(j.ranks), "migrating_keys": len(j.moves),
                "keys_per_aggregator": per_agg_keys, "bytes_per_aggregator": per_agg_bytes})
        clusters = []
        for c in self.state.clusters.values():
            aggs = sorted(c.aggs)
            clusters.append({"name": c.name, "aggregators": aggs, "jobs": sorted(c.jobs),
                             "free_cpu": round(cluster_free_cpu(self.state.loads(aggs),
                                                                self.config.cluster_size), 4)})
        return {"time": time.time(), "master": self.address, "provider": self.provider.kind,
                "capacity": self.elastic.capacity(), "elastic": self.config.enabled,
                "aggregators": aggregators, "clusters": clusters, "jobs": jobs,
                "migrations": self.migrations.status(), "failover": self.failover.status()}

    def _status(self, identity: bytes, msg: wire.Message) -> None:
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), status=self.status()))


def serve(bind: str, provider: str = "standby", max_aggregators: int | None = None,
          log_level: str = "WARNING", **kwargs) -> None:
    from .providers import make_provider
    master = Master(bind, make_provider=lambda address: make_provider(provider, address, max_aggregators,
                                                                      log_level=log_level), **kwargs)
    master.install_signal_handlers()
    master.run()
