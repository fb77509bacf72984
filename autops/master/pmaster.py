"""pMaster: the pool of aggregators, the jobs, and the assignment table it owns.

Aggregators register and heartbeat (with their per-key CPU profile); jobs register
``(job, W, aggregators requested, mode, optimizer)`` with the secret their launcher gave them
and are answered once admission control let them in and their temporary aggregators are up;
ranks declare
tensors; pMaster plans keys (partitioning and batching), assigns them byte-balanced over
the job's aggregators, tells the aggregators (``ASSIGN``), and only then hands agents the
table. Replies wait, without blocking the loop, until every aggregator concerned answered.
The pool's records and queries live in ``pool`` (``PoolState``), control messages to
aggregators and their replies in ``outbox``; elasticity (profiling, packing, revert,
recycling, clusters) in ``elastic`` and live migration in ``migration`` get that state, the
outbox and their collaborators from here and never see pMaster itself; the aggregator supply
is ``providers``, whose exited processes pMaster reaps several times a second. pMaster answers
each heartbeat, so that aggregators know it is there (``orphan``), with a note of the pool's
records about that aggregator, which they give back to a restarted pMaster (``rebuild``).
pMaster publishes a utilization report and Prometheus metrics (``report``).

Security (docs/autops.md, "Security"): the first registration of a job id sets the job's
secret, every later request of the job must present it, and pMaster never sends it
(``jobauth.JobSecrets`` keeps a salted hash per live job in the state directory, so a
restarted pMaster still knows whose a job id is); aggregators prove the cluster key and
their control messages are sealed (``clusterauth``); operator commands (``MIGRATE``) need
the operator token; every refusal is logged and counted (``status()["security"]``, the
``autops_auth_refusals_total`` metric). The socket runs CURVE beyond loopback when the key
directory holds the cluster's CURVE keys (``dlrt.curve``). With CURVE, the name of the key a
job's first registration came with is its tenant (``pool.tenant_of``; the cluster's own
``member`` key is none): a registration of the job from another key is refused
(``wrong_tenant``: a job cannot change owner), the tenant survives a restart
(``poolfiles.JobTenants``), and every command that commits an aggregator's memory to the job
names it (``TenantOutbox``), so the aggregator holds the job's first keys to
``--max-tenant-bytes`` already.
"""
from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from typing import Any, Callable

import zmq

from dlrt.curve import Security, default_security, peer_name, refusal_counts, warn_if_exposed
from dlrt.keys import ensure_cluster_secret, ensure_operator_token

from ..config import MasterConfig
from ..wire import protocol as wire
from ..wire.clusterauth import ControlSession, MasterHandshake
from .assignment import rebalance, spread_by_bytes
from .elastic import Elastic, ElasticConfig
from .failover import Failover
from ..wire.jobauth import JobSecrets, SecretRefused, check_secret_shape
from .migration import Migrations
from .outbox import AggregatorOutbox, Reply
from .pool import AggInfo, JobInfo, PoolState, tenant_of, tenant_refused
from .poolfiles import JobTenants
from .providers import Provider, StandbyProvider, make_provider
from .rebuild import Restorer, note_for
from .replication import choose_replica, replica_info
from .scaling import cluster_free_cpu
from ..wire.partition import (DEFAULT_PARTITION_BYTES, DEFAULT_SMALL_BYTES, MIN_AUTO_PARTITION_BYTES, KeySpec,
                              auto_partition_bytes, plan_keys, tensor_bytes, validate_tensor)
from ..wire.optimizers import MODES, hyperparameters
from ..transport.zmq import make_context


log = logging.getLogger("autops.master.pmaster")

# what only an aggregator sends pMaster: accepted only sealed by its session (``clusterauth``)
AGGREGATOR_OPS = frozenset({wire.HEARTBEAT, wire.OK, wire.ERROR, wire.TENSOR_COPY_DONE, wire.WORKER_DONE,
                            wire.MIGRATE_CUTOVER})


class PoolBusy(ValueError):
    """A job the pool cannot take now but may later (admission control, a restart under
    way): its error reply carries ``retry``, so its launcher can requeue it."""


REAP_PERIOD_S = 0.2     # how often pMaster collects the aggregator processes it started that exited

# the commands that commit an aggregator's memory to a job: they name the job's tenant
TENANT_OPS = frozenset({wire.ASSIGN, wire.MIGRATE_PREPARE, wire.REPLICA_PREPARE, wire.FAILOVER})


class TenantOutbox(AggregatorOutbox):
    """``AggregatorOutbox`` that adds ``tenant=`` (the job's ``JobInfo.tenant``, where it has
    one) to each of ``TENANT_OPS``, whichever part of pMaster sends it (the declaration here,
    ``migration``, ``failover``): the aggregator checks the job's keys against its tenant's
    quota from the first one, not only from the job's first data request."""

    def send_agg(self, agg: str, op: str, reply: Reply | None, **fields: Any) -> None:
        if op in TENANT_OPS and "tenant" not in fields:
            job = self.state.jobs.get(fields.get("job"))
            if job is not None and job.tenant is not None:
                fields["tenant"] = job.tenant
        super().send_agg(agg, op, reply, **fields)


def same_secret(given: object, secret: str) -> bool:
    """Whether ``given`` is ``secret`` (constant time)."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), secret.encode())


class Master:
    """pMaster's state and message loop; ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, bind: str = "tcp://127.0.0.1:5555", heartbeat_timeout: float = 5.0,
                 assign_timeout: float = 60.0, provider: Provider | None = None,
                 elastic: ElasticConfig | None = None, report_bind: str | None = None,
                 metrics_port: int | None = None, report_period: float = 1.0,
                 make_provider: Callable[[str], Provider] | None = None, security: Security | None = None,
                 state_dir: str | os.PathLike | None = None, cluster_secret: bytes | None = None,
                 operator_token: str | None = None) -> None:
        """``make_provider(address)``: builds the provider once the master's address is known
        (a local provider tells the aggregators it starts where pMaster is). ``security``:
        CURVE for the socket (default: the key directory's); ``state_dir``: where the live
        jobs' secret hashes persist (None: in memory only); ``cluster_secret`` and
        ``operator_token``: default the key directory's (made there when missing)."""
        self.assign_timeout = assign_timeout
        self.security = security if security is not None else default_security()
        self._curve_refusals_before = refusal_counts()      # this pMaster counts its own from here
        self.ctx = make_context()
        self.sock: zmq.Socket | None = None
        self.publisher = self.exporter = self.secrets = self.provider = None
        try:   # whatever fails from here (an address taken, no Ray cluster), nothing stays open
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.security.server(self.sock, bind)
            self.sock.bind(bind)
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            warn_if_exposed("pMaster", self.address, self.security)
            self.secrets = JobSecrets(state_dir)
            self.tenants = JobTenants(state_dir)                # job -> its tenant, for as long as its secret
            self.handshake = MasterHandshake(cluster_secret if cluster_secret is not None else ensure_cluster_secret())
            self.operator_token = operator_token if operator_token is not None else ensure_operator_token()
            self.sessions: dict[bytes, ControlSession] = {}     # aggregator identity -> sealed control channel
            self.refusals: Counter = Counter()                  # refused requests by reason
            self.state = PoolState(heartbeat_timeout, clock=time.monotonic)
            self.clock = self.state.clock
            self.started = self.clock()
            self.outbox = TenantOutbox(self.state, self._reply, assign_timeout)
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
            self.restorer = Restorer(self.state)     # after a restart: the pool's records from the aggregators' notes
            self._next_reap = self.clock()
            self.report_period = report_period
            self._next_report = self.clock()
            # after a restart, ids of jobs that did not come back within this long are free again
            self.claim_grace = self.state.heartbeat_timeout + self.config.job_timeout
            self._claims_pruned = False
            if report_bind:
                from .report import ReportPublisher
                self.publisher = ReportPublisher(report_bind, context=self.ctx, security=self.security)
            if metrics_port is not None:
                from .report import PrometheusExporter
                self.exporter = PrometheusExporter()
                self.metrics_port = self.exporter.start(metrics_port)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """Close what it opened (at its end, or when its construction failed half-way)."""
        if self.publisher is not None:
            self.publisher.close()
        if self.exporter is not None:
            self.exporter.stop()
        if self.provider is not None:
            self.provider.close()
        if self.secrets is not None:
            self.secrets.close()
        if self.sock is not None:
            self.sock.close(0)
        self.ctx.term()

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
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        # the frames' properties name the sender's CURVE key (``dlrt.curve``)
                        self._dispatch([f.bytes for f in frames], peer=peer_name(frames[-1]))
                now = self.clock()
                try:
                    self.failover.check(now)
                    self.outbox.expire(now)
                    for job_id in self.elastic.expired_jobs(now):
                        self.release_job(job_id)
                    self.elastic.tick(now)
                    self._prune_claims(now)
                    if now >= self._next_reap:
                        self._next_reap = now + REAP_PERIOD_S
                        self.provider.reap()    # no exited aggregator stays a zombie
                except Exception:  # keep the shared service alive
                    log.exception("internal error in a periodic pass")
                if now >= self._next_report:
                    self._next_report = now + self.report_period
                    self._publish()
        finally:
            self._release()

    def _prune_claims(self, now: float) -> None:
        """Once, ``claim_grace`` after the start: forget the recorded secrets of jobs that
        did not come back after a restart (their workers would have timed out by now)."""
        if self._claims_pruned or now < self.started + self.claim_grace:     # (not now - started: rounding)
            return
        self._claims_pruned = True
        for job_id in self.secrets.jobs():
            if job_id not in self.state.jobs:
                log.info("job %s did not come back after the restart; its id is free again", job_id)
                self.secrets.forget(job_id)
        for job_id in self.tenants.jobs():
            if job_id not in self.state.jobs:
                self.tenants.forget(job_id)

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
        session = self.sessions.get(identity)
        if session is not None:
            frames = session.seal(frames)
        self.sock.send_multipart([identity, *frames])

    def _refused(self, identity: bytes, reason: str, what: str, job: object = None, rank: object = None) -> None:
        """Log and count one refused request (never with the secret it presented)."""
        self.refusals[reason] += 1
        log.warning("refused %s%s%s from peer %s: %s", what, f" of job {job!r}" if job is not None else "",
                    f" rank {rank}" if rank is not None else "", identity.hex(), reason)

    def _open(self, identity: bytes, body: list) -> tuple[list, bool] | None:
        """The message without its seal and whether it was sealed by ``identity``'s session;
        None when a sealed-looking message from a registered aggregator fails its seal."""
        session = self.sessions.get(identity)
        if session is None or len(body) != 2:
            return body, False
        opened = session.open(body)
        return None if opened is None else (opened, True)

    def _dispatch(self, frames: list, peer: str | None = None) -> None:
        """One message; ``peer``: the name of the CURVE key it came with (None: no CURVE)."""
        identity, body = frames[0], frames[1:]
        req = None
        try:
            opened = self._open(identity, body)
            if opened is None:
                self._refused(identity, "unsealed_control", "a control message with a bad seal")
                return
            body, sealed = opened
            msg = wire.decode(body)
            req = msg.get("req")
            if msg.op in AGGREGATOR_OPS and not sealed:
                if msg.op == wire.HEARTBEAT:     # pMaster restarted (or an unknown peer): register first
                    self._reply(identity, wire.error("unknown aggregator; register again", reregister=True))
                else:
                    self._refused(identity, "unsealed_control", f"an unsealed {msg.op}")
                return
            handler = {
                wire.REGISTER_AGG: self._register_agg,
                wire.HEARTBEAT: self._heartbeat,
                wire.REGISTER_JOB: lambda i, m: self._register_job(i, m, tenant_of(peer)),
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
        except SecretRefused as exc:
            self._refused(identity, exc.reason, msg.op, msg.get("job"), msg.get("rank"))
            self._reply(identity, wire.error(str(exc), req=req, refused=exc.reason))
        except (wire.ProtocolError, ValueError) as exc:
            retry = {"retry": True} if isinstance(exc, PoolBusy) else {}
            self._reply(identity, wire.error(str(exc), req=req, **retry))
        except Exception as exc:  # keep the shared service alive
            log.exception("internal error")
            self._reply(identity, wire.error(f"internal master error: {exc.__class__.__name__}: {exc}", req=req))

    # --- aggregators ----------------------------------------------------------------
    def _register_agg(self, identity: bytes, msg: wire.Message) -> None:
        """The cluster-key handshake (``clusterauth``): a hello is answered with pMaster's
        proof and a challenge; the registration proper must answer that challenge."""
        if msg.get("answer") is None:
            self.sessions.pop(identity, None)      # registering again: the old session ends
            self._reply(identity, wire.encode(wire.OK, req=msg.get("req"),
                                              **self.handshake.challenge(identity, msg.get("nonce"))))
            return
        session = self.handshake.finish(identity, msg.get("nonce"), msg.get("answer"))
        if session is None:
            raise SecretRefused("aggregator registration refused: it did not prove the cluster key "
                                "(give it the cluster's key directory, $DLRT_KEYS)", "cluster_key")
        agg_id = msg.get("name") or f"agg-{next(self._agg_ids)}"
        known = self.state.aggs.get(agg_id)
        if known is not None and known.identity != identity and self.state.alive(known):
            raise ValueError(f"an aggregator named {agg_id!r} is already registered and alive")
        info = AggInfo(agg_id, identity, dict(msg["endpoints"]), msg["host"], msg["pid"], self.clock())
        if known is not None and known.identity != identity:
            self.sessions.pop(known.identity, None)
        self.state.add_aggregator(info)
        # one declared lost comes back empty: its keys have other owners now
        reset = self.failover.lost.pop(agg_id, None) is not None
        log.info("aggregator %s registered (pid %s, %s)%s", agg_id, msg["pid"], msg["endpoints"],
                 " after it was lost: it drops what it held" if reset else "")
        if not reset:
            self._adopt(info, msg.get("holding") or {})
            self.restorer.restore(info, msg.get("note"))
        self.sessions[identity] = session         # from here on its control messages are sealed
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
            if job is None and self.secrets.matches(str(job_id), held["secret"]) is False:
                # the recorded hash says otherwise: not the secret the job registered with
                self.refusals["wrong_secret"] += 1
                log.error("aggregator %s holds job %s with another secret than the job registered with; "
                          "ignored", info.agg_id, job_id)
                continue
            if job is None:
                try:
                    self.secrets.claim(str(job_id), held["secret"])
                except SecretRefused as exc:
                    log.error("aggregator %s holds job %s: %s; ignored", info.agg_id, job_id, exc)
                    continue
                job = JobInfo(str(job_id), str(held["secret"]), int(held["world_size"]), 0, "sum", True, None, {},
                              DEFAULT_PARTITION_BYTES, DEFAULT_SMALL_BYTES, [])
                job.state = "dedicated"          # elasticity leaves an adopted job where it is
                # its owner as recorded; without a record its workers' next registration names it
                job.tenant_known, job.tenant = self.tenants.known(job.job), self.tenants.get(job.job)
                self.state.jobs[job.job] = job
                log.info("job %s adopted from aggregator %s (pMaster restarted)", job.job, info.agg_id)
            elif not same_secret(held["secret"], job.secret):
                self.refusals["wrong_secret"] += 1
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
            job.last_heard = job.last_progress = self.clock()

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
        # answered, so that the aggregator knows a pMaster is there (``orphan``), with the
        # record a restarted pMaster gets back from it (``rebuild``)
        self._reply(identity, wire.encode(wire.OK, note=note_for(self.state, agg_id)))

    # --- jobs -----------------------------------------------------------------------
    def _register_job(self, identity: bytes, msg: wire.Message, tenant: str | None = None) -> None:
        """A rank joins its job; ``tenant``: that of the CURVE key it came with (``tenant_of``)."""
        job_id, world, rank, mode = msg["job"], msg["world_size"], msg["rank"], msg["mode"]
        if not job_id:
            raise ValueError("job id must not be empty")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"job {job_id}: rank {rank} is outside world size {world}")
        if mode not in MODES:
            raise ValueError(f"job {job_id}: mode must be one of {MODES}, got {mode!r}")
        optimizer, hp = msg.get("optimizer"), msg.get("hp") or {}
        job = self.state.jobs.get(job_id)
        if job is None and mode == "server":
            hyperparameters(optimizer or "", hp)  # raises ValueError with a clear message
        secret = check_secret_shape(job_id, msg.get("secret"))
        if (job is not None and not same_secret(secret, job.secret)) or \
                (job is None and self.secrets.matches(job_id, secret) is False):
            raise SecretRefused(f"wrong secret for job {job_id}", "wrong_secret")
        known, owner = (job.tenant_known, job.tenant) if job is not None else \
            (self.tenants.known(job_id), self.tenants.get(job_id))
        if tenant_refused(known, owner, tenant):
            raise SecretRefused(f"job {job_id} was registered with another CURVE key (tenant) than this "
                                "request's; a job cannot change owner", "wrong_tenant")
        if msg.get("rejoin") and self.clock() - self.started < self.state.heartbeat_timeout:
            # every live aggregator registers again within a heartbeat timeout: until then the
            # job's table may lack the keys of one that has not
            raise PoolBusy(f"job {job_id} is not registered yet: pMaster restarted and waits for its "
                           "aggregators to register again; retry")
        if job is None and msg.get("rejoin"):
            raise ValueError(f"job {job_id} is not registered: pMaster restarted and no aggregator holds "
                             "the job (its state is lost)")
        if job is None:
            requested = max(0, int(msg["num_aggregators"] or 0))
            if not self.state.live_aggregators() and not self.provider.can_start(0):
                raise PoolBusy("no aggregator is registered with this master; start one with "
                               "`autops aggregator --master ADDRESS`")
            refused = self.elastic.refuse_reason(requested)
            if refused:
                raise PoolBusy(f"job {job_id}: {refused}")
            self.secrets.claim(job_id, secret)
            job = JobInfo(job_id, secret, world, requested, mode,
                          bool(msg.get("average", True)), optimizer, hp,
                          int(msg.get("partition_bytes") or 0),      # 0: chosen at the first DECLARE
                          int(msg.get("small_bytes") or DEFAULT_SMALL_BYTES), [], requested=requested)
            job.replicate = bool(msg.get("replicate", True))
            job.tenant = tenant
            self.tenants.record(job_id, tenant)
            job.last_heard = job.last_progress = self.clock()   # re-registering does not move them on
            self.elastic.reserve(job)
            job.home = job.aggregators[0] if job.aggregators else None
            self.state.jobs[job_id] = job
            log.info("job %s registered: W=%d mode=%s asked for %d aggregator(s), got %s%s", job_id, world,
                     mode, requested, job.aggregators, f" (+{len(job.pending)} starting)" if job.pending else "")
        else:
            if msg.get("rejoin") and not job.tensors:
                # adopted from its aggregators after a restart: the workers bring the job's settings
                job.mode, job.average, job.optimizer, job.hp = mode, bool(msg.get("average", True)), \
                    msg.get("optimizer"), msg.get("hp") or {}
                job.partition_bytes = int(msg.get("partition_bytes") or 0)
                job.small_bytes = int(msg.get("small_bytes") or DEFAULT_SMALL_BYTES)
                job.replicate = bool(msg.get("replicate", True))
            if (world, mode) != (job.world_size, job.mode):
                raise ValueError(f"job {job_id} exists with world size {job.world_size} and mode {job.mode}; "
                                 f"rank {rank} asked for {world} and {mode}")
            if rank in job.ranks and not msg.get("rejoin"):
                raise ValueError(f"job {job_id}: rank {rank} has already joined; job ids must be unique "
                                 "per running job")
            if not job.tenant_known:      # adopted without a record of its owner: this rank names it
                job.tenant, job.tenant_known = tenant, True
                self.tenants.record(job_id, tenant)
        job.ranks.add(rank)               # no ``last_heard``: a registration (repeated) is not progress
        if job.pending:
            job.registrations.append((identity, msg.get("req")))
        else:
            self._reply(identity, self._registered_frames(job, msg.get("req")))

    def _registered_frames(self, job: JobInfo, req) -> list:
        if job.home is None and job.aggregators:
            job.home = job.aggregators[0]
        job.touched.update(job.aggregators)
        return wire.encode(      # never the secret: the ranks brought it
            wire.OK, req=req, aggregators=job.aggregators, home=job.home,
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
        if not same_secret(msg["secret"], job.secret):
            raise SecretRefused(f"wrong secret for job {msg['job']}", "wrong_secret")
        return job

    def _declare(self, identity: bytes, msg: wire.Message) -> None:
        job = self._job(msg)
        partition, chosen = job.partition_bytes, True
        if not partition:
            # the job set none: chosen once, from the first declaration with a tensor that any
            # choice would split (until then every choice plans the same keys)
            wire.check_declared(msg["tensors"], DEFAULT_PARTITION_BYTES, job.tensors, len(job.keys))
            sizes = [tensor_bytes(*validate_tensor(*item[:3])[1:]) for item in msg["tensors"]]
            # the aggregators the job asked for: pMaster's temporary ones while it profiles a job
            # that asked for none are not where it will run (packing puts it on few)
            partition = auto_partition_bytes(sum(sizes), job.requested)
            chosen = max(sizes, default=0) > MIN_AUTO_PARTITION_BYTES
        wire.check_declared(msg["tensors"], partition, job.tensors, len(job.keys))  # limits first
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
        if chosen:
            job.partition_bytes = partition
        if new:
            # keys an aggregator already holds (adopted after a restart) keep their owner
            keys = [k for k in plan_keys(new, partition, job.small_bytes) if k.key not in job.keys]
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
            hyperparameters(conf["optimizer"] or "", conf["hp"])
        return conf

    def _send_assign(self, job: JobInfo, keys: list[KeySpec]) -> None:
        groups: dict[tuple, list] = {}
        for spec in keys:
            conf = job.conf(spec.tensor)
            group = (job.table[spec.key], conf["mode"], conf["average"], conf["optimizer"],
                     json.dumps(conf["hp"], sort_keys=True))
            groups.setdefault(group, []).append(spec)
        for (agg_id, mode, average, optimizer, hp), specs in groups.items():
            job.touched.add(agg_id)
            ack = next(self._acks)
            job.pending_acks.add(ack)
            replicas = self._replicas(job, agg_id, mode, specs)
            settings = dict(job=job.job, secret=job.secret, world_size=job.world_size, mode=mode, average=average,
                            optimizer=optimizer, hp=json.loads(hp))
            self.outbox.send_agg(agg_id, wire.ASSIGN,
                                 lambda reply, a=agg_id, n=ack: self._assigned(job.job, a, n, reply),
                                 **settings, keys=[s.to_wire() for s in specs], replicas=replicas)
            # the replica makes the memory for the state ready before the owner sends it; the
            # job's table waits for that too
            self.failover.when_ready(job, Failover.by_replica(replicas), settings, lambda: None)

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
                           partition_bytes=job.partition_bytes or None,
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
        # every rank of the world, not only those registered here: after a restart the ranks of
        # a job that trains on are not registered again until they need pMaster
        if job.done_ranks >= set(range(job.world_size)):
            self.release_job(job.job)

    def release_job(self, job_id: str) -> None:
        if self.elastic.release_job(job_id):
            self.secrets.forget(job_id)
            self.tenants.forget(job_id)
            log.info("job %s finished and was released", job_id)

    def _profile(self, identity: bytes, msg: wire.Message) -> None:
        """One record per period from an agent (no reply; a wrong secret is only counted)."""
        job = self.state.jobs.get(msg["job"])
        if job is None:
            return
        if not same_secret(msg["secret"], job.secret):
            self._refused(identity, "wrong_secret", wire.PROFILE, msg["job"], msg["rank"])
            return
        try:
            self.elastic.on_profile(job, msg)
        except (KeyError, TypeError, ValueError) as exc:     # unanswered: an error reply would reach no request
            log.warning("job %s: bad profile record from rank %r: %s", msg["job"], msg.get("rank"), exc)

    def _operator(self, msg: wire.Message) -> None:
        """An operator command must present the operator token (``SecretRefused`` otherwise)."""
        if not same_secret(msg.get("token"), self.operator_token):
            raise SecretRefused(f"{msg.op}: operator token missing or wrong (the key directory's "
                                "operator.token; --token-file)", "operator_token")

    def _migrate(self, identity: bytes, msg: wire.Message) -> None:
        """Operator request: move keys of a job (all by default) to the given aggregators, or
        (``count``) spread all of them over that many aggregators with few moves -- the
        scheduler changing a job's aggregator count live."""
        self._operator(msg)
        count = msg.get("count")
        if count is not None:
            if msg.get("keys") or msg.get("to"):
                raise ValueError("count spreads all of a job's keys: give it without keys or to")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"count must be an integer >= 1, got {count!r}")
        job = self.state.jobs.get(msg["job"])
        if job is None:
            raise ValueError(f"job {msg['job']!r} is not registered")
        live = {a.agg_id for a in self.state.live_aggregators()}
        if count is not None:
            keys = list(job.keys)
            targets = self._aggregators_for(job, count, live)
        else:
            keys = list(msg.get("keys") or job.keys)
            unknown = [k for k in keys if k not in job.keys]
            if unknown:
                raise ValueError(f"job {job.job}: unknown keys {unknown[:4]}")
            targets = list(msg.get("to") or [])
            if not targets:
                current = {job.table[k] for k in keys}
                targets = sorted(a for a in live if a not in current)
        bad = [a for a in targets if a not in live]
        if bad or not targets:
            raise ValueError(f"cannot migrate to {bad or 'nowhere'}: live aggregators are {sorted(live)}")
        sizes = {k: job.keys[k].nbytes for k in keys}
        if count is not None:
            table = rebalance({k: job.table[k] for k in keys if k in job.table}, sizes, targets)
        else:
            table = spread_by_bytes(list(sizes.items()), targets)
        used = set(table.values())              # a target no key went to stays as it was (idle)
        for a in used:
            info = self.state.aggs[a]
            if info.state == "idle":
                info.state, info.exclusive = "active", job.job
        before = {job.table[k] for k in keys if k in job.table}
        job.aggregators = sorted(used | {job.table[k] for k in job.keys if k not in table})
        self.elastic.migrate(job, table, after=sorted(before - used))
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), keys=len(table),
                                          batches=len(self.migrations.active(job=job.job)),
                                          aggregators=len(used)))

    def _aggregators_for(self, job: JobInfo, count: int, live: set[str]) -> list[str]:
        """``count`` live aggregators for ``job`` (fewer when fewer are live or it has fewer
        keys): those holding most of its bytes first, then idle ones, then the least loaded."""
        count = min(count, len(job.keys)) or 1
        held: dict[str, int] = {}
        for key, agg in job.table.items():
            if agg in live:
                held[agg] = held.get(agg, 0) + job.keys[key].nbytes
        chosen = sorted(held, key=lambda a: (-held[a], a))[:count]
        if len(chosen) < count:
            load = self.state.load_bytes()
            idle = {a.agg_id for a in self.state.idle()}
            others = sorted((a for a in live if a not in chosen), key=lambda a: (a not in idle, load.get(a, 0), a))
            chosen += others[:count - len(chosen)]
        return chosen

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
            sizes = [tensor_bytes(shape, dtype) for shape, dtype, _ in j.tensors.values()]
            per_agg_keys: dict[str, int] = {}
            per_agg_bytes: dict[str, int] = {}
            for key, agg in j.table.items():
                per_agg_keys[agg] = per_agg_keys.get(agg, 0) + 1
                per_agg_bytes[agg] = per_agg_bytes.get(agg, 0) + j.keys[key].nbytes
            speed = j.standalone / j.measured if j.standalone and j.measured else None
            costs = [j.cost(k) for k in j.keys] if j.e else []
            jobs.append({
                "job": j.job, "tenant": j.tenant, "state": j.state, "world_size": j.world_size, "mode": j.mode,
                "cluster": j.cluster, "requested_aggregators": j.requested,
                "aggregators": sorted(per_agg_keys) or list(j.aggregators), "tensors": len(j.tensors),
                "keys": len(j.keys), "bytes": sum(k.nbytes for k in j.keys.values()),
                "partition_bytes": j.partition_bytes or None,
                "skew": round(skew_of(sizes), 4), "iterations": j.iterations,
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
                "security": self.security_status(),
                "capacity": self.elastic.capacity(), "elastic": self.config.enabled,
                "aggregators": aggregators, "clusters": clusters, "jobs": jobs,
                "migrations": self.migrations.status(), "failover": self.failover.status()}

    def security_status(self) -> dict:
        """Whether CURVE is on, and the requests and connections refused so far, by reason
        (CURVE handshakes as ``curve_*``, counted by ``dlrt.curve``; the aggregators' refusals
        of data requests as ``aggregator_wrong_secret``, from their heartbeats)."""
        refusals = Counter(self.refusals)
        refusals.update(refusal_counts(since=self._curve_refusals_before))
        for stat, reason in (("auth_refusals", "aggregator_wrong_secret"),
                             ("ctrl_refusals", "aggregator_unsealed_control")):
            n = sum(int(a.stats.get(stat) or 0) for a in self.state.aggs.values())
            if n:
                refusals[reason] += n
        return {"curve": self.security.curve, "refusals": dict(sorted(refusals.items()))}

    def _status(self, identity: bytes, msg: wire.Message) -> None:
        self._reply(identity, wire.encode(wire.OK, req=msg.get("req"), status=self.status()))


def provider_maker(config: MasterConfig) -> Callable[[str], Provider]:
    """What builds ``config``'s provider once pMaster's address is known. The Ray provider's
    aggregators run on other machines: bound to every interface, pMaster tells them the
    address Ray knows this machine by, not loopback."""
    if config.provider == "ray":
        from .rayprovider import ray_provider
        every = config.bind.replace("tcp://", "").rsplit(":", 1)[0] in ("0.0.0.0", "*")
        return lambda address: ray_provider(address, config.ray_address, every_interface=every,
                                            resource=config.ray_resource,
                                            max_aggregators=config.max_aggregators, log_level=config.log_level,
                                            transport=config.aggregator_transport,
                                            orphan_timeout=config.aggregator_orphan_timeout)
    return lambda address: make_provider(config.provider, address, config.max_aggregators,
                                         log_level=config.log_level, transport=config.aggregator_transport,
                                         state_dir=config.state_dir, orphan_timeout=config.aggregator_orphan_timeout)


def serve(config: MasterConfig, elastic: ElasticConfig | None = None,
          on_listening: Callable[[str], None] | None = None) -> None:
    """Run a pMaster as ``config`` says (elasticity as ``elastic`` says) until stopped;
    ``on_listening(address)`` once its socket is bound."""
    master = Master(config.bind, heartbeat_timeout=config.heartbeat_timeout, elastic=elastic,
                    report_bind=config.report_bind, metrics_port=config.metrics_port,
                    report_period=config.report_period, state_dir=config.state_dir,
                    make_provider=provider_maker(config))
    if on_listening is not None:
        on_listening(master.address)
    master.install_signal_handlers()
    master.run()
