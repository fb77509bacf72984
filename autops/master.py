"""pMaster: the pool of aggregators, the jobs, and the assignment table it owns.

Aggregators register and heartbeat; jobs register ``(job, W, aggregators requested,
mode, optimizer)`` and receive a per-job secret; ranks declare tensors; pMaster plans
keys (partitioning and batching), assigns them with the standalone byte-balanced spread,
tells the aggregators (``ASSIGN``), and only then hands agents the table. Replies to a
declare wait, without blocking the loop, until every aggregator concerned acknowledged.
"""
from __future__ import annotations

import itertools
import json
import logging
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq

from . import wire
from .assignment import spread_by_bytes
from .partition import DEFAULT_PARTITION_BYTES, DEFAULT_SMALL_BYTES, KeySpec, plan_keys, validate_tensor
from .store import MODES
from .transport.zmq import make_context


def _optim():
    from . import optim   # server mode only
    return optim


log = logging.getLogger("autops.master")


@dataclass
class AggInfo:
    agg_id: str
    identity: bytes
    endpoints: dict
    host: str
    pid: int
    last_seen: float
    stats: dict = field(default_factory=dict)

    def alive(self, now: float, timeout: float) -> bool:
        return now - self.last_seen <= timeout


@dataclass
class JobInfo:
    job: str
    secret: str
    world_size: int
    num_aggregators: int
    mode: str
    average: bool
    optimizer: str | None
    hp: dict
    partition_bytes: int
    small_bytes: int
    aggregators: list
    ranks: set = field(default_factory=set)
    done_ranks: set = field(default_factory=set)
    tensors: dict = field(default_factory=dict)   # name -> (shape, dtype)
    keys: dict = field(default_factory=dict)      # key -> KeySpec
    table: dict = field(default_factory=dict)     # key -> agg id
    pending_acks: set = field(default_factory=set)
    parked: list = field(default_factory=list)    # (identity, req) waiting for acks
    failure: str | None = None
    created: float = field(default_factory=time.time)


class Master:
    """pMaster's state and message loop; ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, bind: str = "tcp://127.0.0.1:5555", heartbeat_timeout: float = 5.0,
                 assign_timeout: float = 10.0) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.assign_timeout = assign_timeout
        self.ctx = make_context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.aggs: dict[str, AggInfo] = {}
        self.by_identity: dict[bytes, str] = {}
        self.jobs: dict[str, JobInfo] = {}
        self._agg_ids = itertools.count()
        self._reqs = itertools.count(1)
        self._assign_waits: dict[int, tuple[str, float]] = {}   # req -> (job, deadline)
        self._stop = threading.Event()

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
                self._expire_assigns()
        finally:
            self.sock.close(0)
            self.ctx.term()

    # --- helpers --------------------------------------------------------------------
    def _reply(self, identity: bytes, frames: list) -> None:
        self.sock.send_multipart([identity, *frames])

    def live_aggregators(self) -> list[AggInfo]:
        now = time.monotonic()
        return [a for a in self.aggs.values() if a.alive(now, self.heartbeat_timeout)]

    def _load_bytes(self) -> dict[str, int]:
        load = {agg: 0 for agg in self.aggs}
        for job in self.jobs.values():
            for key, agg in job.table.items():
                load[agg] = load.get(agg, 0) + job.keys[key].nbytes
        return load

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
                wire.OK: self._assign_reply,
                wire.ERROR: self._assign_reply,
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
        if agg_id in self.aggs and self.aggs[agg_id].identity != identity \
                and self.aggs[agg_id].alive(time.monotonic(), self.heartbeat_timeout):
            raise ValueError(f"an aggregator named {agg_id!r} is already registered and alive")
        self.aggs[agg_id] = AggInfo(agg_id, identity, dict(msg["endpoints"]), msg["host"], msg["pid"],
                                    time.monotonic())
        self.by_identity[identity] = agg_id
        log.info("aggregator %s registered (pid %s, %s)", agg_id, msg["pid"], msg["endpoints"])
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), agg=agg_id))

    def _heartbeat(self, identity: bytes, msg: wire.Message) -> None:
        agg_id = self.by_identity.get(identity)
        if agg_id is None or agg_id not in self.aggs:
            # pMaster restarted: ask the aggregator to register again
            self._reply(identity, wire.error("unknown aggregator; register again", reregister=True))
            return
        info = self.aggs[agg_id]
        info.last_seen = time.monotonic()
        info.stats = {k: v for k, v in msg.fields.items() if k != "agg"}

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
        job = self.jobs.get(job_id)
        if job is None:
            if mode == "server":
                _optim().make_optimizer(optimizer or "", hp)  # raises ValueError with a clear message
            live = sorted(self.live_aggregators(), key=lambda a: (self._load_bytes().get(a.agg_id, 0), a.agg_id))
            if not live:
                raise ValueError("no aggregator is registered with this master; start one with "
                                 "`autops aggregator --master ADDRESS`")
            wanted = max(1, msg["num_aggregators"] or len(live))
            chosen = [a.agg_id for a in live[:wanted]]
            if len(chosen) < wanted:
                log.warning("job %s asked for %d aggregators, only %d alive", job_id, wanted, len(chosen))
            job = JobInfo(job_id, msg.get("secret") or secrets.token_hex(16), world, wanted, mode,
                          bool(msg.get("average", True)), optimizer, hp,
                          int(msg.get("partition_bytes") or DEFAULT_PARTITION_BYTES),
                          int(msg.get("small_bytes") or DEFAULT_SMALL_BYTES), chosen)
            self.jobs[job_id] = job
            log.info("job %s registered: W=%d mode=%s aggregators=%s", job_id, world, mode, chosen)
        else:
            if msg.get("secret") and msg["secret"] != job.secret:
                raise ValueError(f"job {job_id}: wrong secret")
            if (world, mode) != (job.world_size, job.mode):
                raise ValueError(f"job {job_id} exists with world size {job.world_size} and mode {job.mode}; "
                                 f"rank {rank} asked for {world} and {mode}")
            if rank in job.ranks:
                raise ValueError(f"job {job_id}: rank {rank} has already joined; job ids must be unique "
                                 "per running job")
        job.ranks.add(rank)
        self._reply(identity, wire.encode(
            wire.OK, req=msg.get("req"), secret=job.secret, aggregators=job.aggregators,
            endpoints={a: {"endpoints": self.aggs[a].endpoints, "host": self.aggs[a].host}
                       for a in job.aggregators if a in self.aggs}))

    def _job(self, msg: wire.Message) -> JobInfo:
        job = self.jobs.get(msg["job"])
        if job is None:
            raise ValueError(f"job {msg['job']!r} is not registered")
        if msg["secret"] != job.secret:
            raise ValueError(f"job {msg['job']!r}: wrong secret")
        return job

    def _declare(self, identity: bytes, msg: wire.Message) -> None:
        job = self._job(msg)
        new = []
        for item in msg["tensors"]:
            if not isinstance(item, (list, tuple)) or len(item) not in (3, 4):
                raise ValueError(f"declare: malformed tensor entry {item!r}")
            name, shape, dtype = validate_tensor(*item[:3])
            conf = self._tensor_conf(job, name, item[3] if len(item) == 4 else {})
            known = job.tensors.get(name)
            if known is not None:
                if known[:2] != (shape, dtype) or known[2]["mode"] != conf["mode"]:
                    raise ValueError(f"job {job.job}: tensor {name!r} was declared as {list(known[0])} "
                                     f"{known[1]} ({known[2]['mode']}), now as {list(shape)} {dtype} "
                                     f"({conf['mode']})")
                continue
            job.tensors[name] = (shape, dtype, conf)
            new.append((name, shape, dtype))
        if new:
            keys = plan_keys(new, job.partition_bytes, job.small_bytes)
            load = {}
            for key, agg in job.table.items():
                load[agg] = load.get(agg, 0) + job.keys[key].nbytes
            # balanced within the job; ties go to the aggregator with less load from other jobs
            pool_load = self._load_bytes()
            order = sorted(job.aggregators, key=lambda a: (pool_load.get(a, 0), job.aggregators.index(a)))
            table = spread_by_bytes([(k.key, k.nbytes) for k in keys], order, load)
            for spec in keys:
                job.keys[spec.key] = spec
            job.table.update(table)
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
            groups.setdefault(group, []).append(spec.to_wire())
        for (agg_id, mode, average, optimizer, hp), items in groups.items():
            req = next(self._reqs)
            job.pending_acks.add(req)
            self._assign_waits[req] = (job.job, time.monotonic() + self.assign_timeout)
            self.sock.send_multipart([self.aggs[agg_id].identity, *wire.encode(
                wire.ASSIGN, req=req, job=job.job, secret=job.secret, world_size=job.world_size,
                mode=mode, average=average, optimizer=optimizer, hp=json.loads(hp), keys=items)])

    def _assign_reply(self, identity: bytes, msg: wire.Message) -> None:
        req = msg.get("req")
        waited = self._assign_waits.pop(req, None)
        if waited is None:
            return
        job = self.jobs.get(waited[0])
        if job is None:
            return
        job.pending_acks.discard(req)
        if msg.op == wire.ERROR:
            job.failure = f"aggregator {self.by_identity.get(identity)} refused the assignment: {msg['message']}"
        self._flush_parked(job)

    def _expire_assigns(self) -> None:
        now = time.monotonic()
        for req, (job_id, deadline) in list(self._assign_waits.items()):
            if now > deadline:
                del self._assign_waits[req]
                job = self.jobs.get(job_id)
                if job is not None:
                    job.pending_acks.discard(req)
                    job.failure = f"an aggregator of job {job_id} did not acknowledge its assignment " \
                                  f"within {self.assign_timeout:.0f}s"
                    self._flush_parked(job)

    def _table_frames(self, job: JobInfo, req) -> list:
        if job.failure:
            return wire.error(job.failure, req=req)
        keys = [[*spec.to_wire(), job.table[key]] for key, spec in job.keys.items()]
        aggs = {a: {"endpoints": self.aggs[a].endpoints, "host": self.aggs[a].host}
                for a in job.aggregators if a in self.aggs}
        return wire.encode(wire.OK, req=req, keys=keys, aggregators=aggs,
                           tensors=[[n, list(s), d] for n, (s, d, _) in job.tensors.items()])

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
        self._answer_table(self._job(msg), identity, msg.get("req"))

    def _job_done(self, identity: bytes, msg: wire.Message) -> None:
        job = self._job(msg)
        job.done_ranks.add(msg["rank"])
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req")))
        if job.done_ranks >= job.ranks:
            self.release_job(job.job)

    def release_job(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        for agg_id in job.aggregators:
            if agg_id in self.aggs:
                self.sock.send_multipart([self.aggs[agg_id].identity, *wire.encode(wire.RELEASE_JOB, job=job_id)])
        log.info("job %s finished and was released", job_id)

    # --- reporting ------------------------------------------------------------------
    def status(self) -> dict:
        now = time.monotonic()
        load = self._load_bytes()
        return {
            "aggregators": [{
                "id": a.agg_id, "endpoints": a.endpoints, "pid": a.pid, "alive": a.alive(now, self.heartbeat_timeout),
                "assigned_bytes": load.get(a.agg_id, 0), **a.stats} for a in self.aggs.values()],
            "jobs": [{
                "job": j.job, "world_size": j.world_size, "mode": j.mode, "aggregators": j.aggregators,
                "ranks_joined": sorted(j.ranks), "tensors": len(j.tensors), "keys": len(j.keys),
                "bytes": sum(k.nbytes for k in j.keys.values()),
                "bytes_per_aggregator": {a: sum(j.keys[k].nbytes for k, x in j.table.items() if x == a)
                                         for a in j.aggregators}} for j in self.jobs.values()],
        }

    def _status(self, identity: bytes, msg: wire.Message) -> None:
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), status=self.status()))


def serve(bind: str, **kwargs) -> None:
    master = Master(bind, **kwargs)
    master.install_signal_handlers()
    master.run()
