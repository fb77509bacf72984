"""The aggregator process: the data path of the keys pMaster assigned to it.

One aggregator per machine. It listens through its ``Transport`` (tcp, and ipc and shared
memory for agents on the same host), registers with pMaster over a DEALER, heartbeats, and
runs the data plane over the ``Store``: requests and replies are ``wire`` records; pushes
are acknowledged at once, pulls are parked until their iteration is published. Published
values live in the transport's memory, so a channel that can lend them sends references
instead of bytes, and a push whose buffer the worker lent is summed in place when its
iteration completes. Any bad request is answered with an error to that client only; the
loop never dies on input. It outlives pMaster (training goes on; a restarted pMaster is told
what is held here and the record pMaster last sent with its heartbeat answers, ``note``),
but not for ever: heard from by no pMaster for ``orphan_timeout`` seconds, it exits
(``orphan``). It measures the CPU time of every key and reports it with its heartbeat
(elasticity, thesis §4.3). A worker taking a checkpoint in server mode gets a key's master
copy, optimizer state and step with STATE_GET.

Security (docs/autops.md, "Security"): registration proves the cluster key both ways and
seals the control channel (``clusterauth``): commands (ASSIGN, RELEASE_JOB, MIGRATE_*, REPLICA_PREPARE,
FAILOVER, REPLICA_SET, CYCLE) are obeyed only when sealed by the pMaster this aggregator
authenticated, anything else on that socket is dropped and counted (``ctrl_refusals``).
Every data request -- the workers' pushes, pulls, broadcasts and recoveries, and what other
aggregators send on the same listeners -- must present its job's secret, which pMaster gave
this aggregator in ASSIGN over the sealed channel; a wrong one is answered with an error and
counted (``auth_refusals``). State from another aggregator (TENSOR_COPY, REPLICATE) arrives
on the data listeners, not on an authenticated connection, so it also carries a proof of
the cluster key bound to the job and its secret (``clusterauth.peer_ticket``): a rank of the
job cannot pose as an aggregator, and nobody without the job's secret can touch the job.

The rest is done by collaborators the aggregator constructs and calls from its dispatch and
its loop, each given what it needs through its constructor (``links``: answers to pMaster,
channels to peers; callables; other collaborators), never the aggregator itself:
``commitments.Commitments`` (what each job holds committed here: the room and quota checks,
tenants), ``assign.Assignments`` (ASSIGN), ``reserve.MemoryReadier`` (the memory reserve and
the memory of arriving keys, made ready on helper threads), ``cycle.Cycles`` (CYCLE, and when
each push is aggregated), ``moves_out.MovesOut`` and ``moves_in.MovesIn`` (live migration,
Fig. 4.5: the old owner's side -- MIGRATE_INIT, the cutover, state sent ahead, TENSOR_COPY,
MIGRATE_ABORT -- and the new owner's -- MIGRATE_PREPARE, the take-over, WORKER_DONE,
MIGRATE_DROP), ``replicas.Replication`` (REPLICA_PREPARE, REPLICA_SET, REPLICATE both ways),
``recovery.Recovery`` (FAILOVER, RECOVER) and ``broadcast.Broadcasts`` (BCAST_PUT, BCAST_GET).
Of a migration the data path keeps the per-key test (``moves_state``: a moving key's pull
replies name its new owner, what comes after its cutover is redirected, an arriving key's
pushes are held) and the calls into those two at a key's turning points.
"""
from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Iterator

import numpy as np
import psutil
import zmq

from dlrt.curve import Security, default_security, warn_if_exposed
from dlrt.hostid import host_id
from dlrt.keys import ensure_cluster_secret

from ..config import DEFAULT_ORPHAN_TIMEOUT, PREFAULT_SHARE, RESERVE_SHARED, AggregatorConfig, TransportConfig
from ..transport import Channel, Inbound, Sender, Shared, Transport, make_context, settings_from_env
from ..wire import clusterauth, protocol as wire
from . import figures, memroom
from .assign import Assignments
from .broadcast import Broadcasts
from .commitments import Commitments, NoRoom
from .cycle import Cycles
from .held import HeldMessages
from .links import Control, Peers
from .moves_in import MovesIn
from .moves_out import MovesOut
from .orphan import OrphanWatch
from .recovery import Recovery
from .replicas import Replication
from .reserve import MemoryReadier
from .spare import SpareBuffers
from .store import JobState, KeyState, SecretMismatch, Store, StoreError

log = logging.getLogger("autops.aggregator.service")


@dataclass
class PendingPull:
    reply: Sender
    req: int | None
    items: list            # [(KeyState, iteration)]
    waiting: set = field(default_factory=set)   # id(KeyState) still unpublished
    iteration: dict = field(default_factory=dict)  # id(KeyState) -> iteration asked for
    finished: bool = False


def default_advertise_host(bind_host: str) -> str:
    if bind_host not in ("0.0.0.0", "*", ""):
        return bind_host
    try:
        return pysocket.gethostbyname(pysocket.gethostname())
    except OSError:
        return "127.0.0.1"


class Aggregator:
    """A keyed aggregation server; ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, master: str, bind_host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, ipc: bool = True,
                 heartbeat_interval: float = 1.0, register_timeout: float = 30.0,
                 name: str | None = None, transport: str = "auto", security: Security | None = None,
                 cluster_secret: bytes | None = None, prefault_share: float = PREFAULT_SHARE,
                 reserve: int = 0, reserve_shared: float = RESERVE_SHARED,
                 orphan_timeout: float = DEFAULT_ORPHAN_TIMEOUT, max_job_bytes: int | None = None,
                 headroom: int = memroom.DEFAULT_HEADROOM, max_tenant_bytes: int | None = None,
                 transport_config: TransportConfig | None = None) -> None:
        """``security``: CURVE for every tcp socket (default: the key directory's);
        ``cluster_secret``: what it proves to pMaster (default: the key directory's);
        ``prefault_share``: at most this share of a core populates memory for keys migrating
        in (their buffers, and the heap their pushes will arrive in) where the host stays busy;
        CPU the host has to spare it uses first (``prefault.Pace``); ``reserve``: bytes of
        memory populated at that pace when the aggregator starts, for what arrives
        later (``MemoryReadier.keep_reserve``), ``reserve_shared`` of it as shared segments where the
        transport lends memory; ``orphan_timeout``: seconds without hearing from any pMaster
        after which it exits (``orphan``; 0: never); ``max_job_bytes``: the most one job's
        declared keys may take here (default: half of what this machine can give when the
        aggregator starts, ``memroom``); ``headroom``: bytes never committed to jobs;
        ``max_tenant_bytes``: the most all jobs of one tenant (its CURVE key's name) may take
        here together (default: ``quota.default_tenant_bytes``); ``transport_config``: the
        transport's settings (default ``transport.settings_from_env()``)."""
        self.master = master
        if 0 < orphan_timeout < 2 * heartbeat_interval:
            raise ValueError(f"orphan timeout {orphan_timeout:g}s: give 0 (never) or at least two heartbeat "
                             f"intervals ({2 * heartbeat_interval:g}s), or it exits while pMaster is there")
        self.orphan = OrphanWatch(orphan_timeout)
        self.orphaned = False                # it exited for want of a pMaster
        self.note: dict | None = None        # pMaster's record of this aggregator, for a restarted one
        MemoryReadier.check(prefault_share, reserve, reserve_shared)     # before anything is opened
        limits = Commitments.resolve(headroom, max_job_bytes, max_tenant_bytes)    # likewise
        rss_base = psutil.Process().memory_info().rss
        self.security = security if security is not None else default_security()
        self.cluster_secret = cluster_secret if cluster_secret is not None else ensure_cluster_secret()
        self.session: clusterauth.ControlSession | None = None   # the control channel, once registered
        self.heartbeat_interval = heartbeat_interval
        self.register_timeout = register_timeout
        self.name = name
        self.agg_id: str | None = None
        self.agg_name: str | None = None     # the id pMaster gave, kept to register again
        links = transport_config if transport_config is not None else settings_from_env()
        self.ctx = make_context(server=True, malloc_tuning=links.malloc_tuning)
        # the data path: listeners for agents and peers (tcp; ipc and shm for this host),
        # channels to peer aggregators, and the memory published values live in
        self.transport = Transport(self.ctx, transport, local=ipc, security=self.security, config=links)
        self.memory = self.transport.memory
        self.store = Store(self._allocate)
        self.waiters: dict[int, list[PendingPull]] = {}     # id(KeyState) -> [PendingPull]
        self._stop = threading.Event()
        self.endpoints = self.transport.listen(bind_host, port, advertise_host or default_advertise_host(bind_host))
        warn_if_exposed("aggregator", bind_host, self.security)
        self._sources: dict = {listener.pollable: listener for listener in self.transport.listeners}
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.security.client(self.ctrl, master)
        self.ctrl.connect(master)
        self.proc = psutil.Process()
        self.stats = figures.initial(reserve)     # reported with every heartbeat
        spare = SpareBuffers()      # buffers of keys that moved away, for keys moving back (``moves_in``)
        # what each job holds committed here, and the room and quota checks more bytes pass
        self.commitments = Commitments(self.store, spare, self.memory, self.stats, limits, headroom, rss_base,
                                       self._release)
        # the data path's checks of every request, bound once (not looked up through ``commitments``)
        self.refused_jobs = self.commitments.refused_jobs
        self._check_tenant = self.commitments.check_request
        self._copy_reqs = iter(range(1, 1 << 62))
        self.store.on_step = self._step_taken
        # cyclic execution: the schedule, each job's latest admitted iteration, postponed pushes
        self.cycles = Cycles(self.stats, self._apply_push)
        self._admit = self.cycles.admit       # (asked on every push: bound once)
        self.held = HeldMessages()      # pMaster's messages after an ASSIGN still allocating
        # memory made ready on helper threads: the reserve, and keys' memory at the prefault pace
        self.readier = MemoryReadier(self.transport, self.store, self.stats, self._stop, prefault_share, reserve,
                                     reserve_shared)
        # what the collaborators below are given instead of the aggregator (``_to_master`` is
        # looked up at each answer)
        control = Control(lambda frames: self._to_master(frames), lambda: self.agg_id)
        # replication (server mode), and taking over the keys of a lost aggregator
        peers = Peers(self._peer, self._ticket, self._copy_reqs.__next__)
        self.replication = Replication(self.store, self.stats, self.readier, control, self.commitments, peers,
                                       self._published)
        self.recovery = Recovery(self.store, self.stats, control, self.commitments, self.replication.set_replica,
                                 self._forget_waiters, self._published)
        self.bcast = Broadcasts(self.store)     # a job's broadcasts, and the gets parked until their put
        # the keys pMaster assigns, large ones made ready off the loop while its later messages wait
        self.assignments = Assignments(self.store, self.readier, control, self.commitments,
                                       self.replication.set_replica, self.held, self._on_master)
        # live migration: the old owner's side (hand-overs, state sent ahead, their reports)
        # and the new owner's (keys arriving, their take-over, its reports)
        self.moves_out = MovesOut(self.store, self.stats, control, peers, self.transport, self.replication)
        self.moves_in = MovesIn(self.store, self.stats, self.readier, control, self.commitments, spare,
                                self.replication, self._published, self._refuse_waiters)
        # who waits for the answers of other aggregators: each request id is in the table of
        # the collaborator that sent it (one sequence of ids, ``Peers.next_req``)
        self._answers = ((self.replication.waits, self.replication.acked),
                         (self.moves_out.follow_waits, self.moves_out.follower_acked),
                         (self.moves_out.copy_waits, self.moves_out.copy_answered))
        self._data_ops = {wire.PUSH: self._push, wire.PUSH_PULL: self._push, wire.PULL: self._pull,
                          wire.INIT: self._init, wire.BCAST_PUT: self.bcast.put, wire.BCAST_GET: self.bcast.get,
                          wire.TENSOR_COPY: self.moves_in.copy, wire.STATE_GET: self._state_get,
                          wire.RECOVER: self.recovery.recover, wire.REPLICATE: self._replicate,
                          wire.WARM: self._warm}

    def _allocate(self, job: str, sizes: list) -> list[tuple[np.ndarray, Shared]]:
        """Published buffers from the transport's memory: where the transport can lend them,
        same-host agents read them in place (one memcpy). ``StoreError`` when this machine
        cannot hold them: a job's keys never exhaust its memory."""
        need = sum(numel * np.dtype(dtype).itemsize for numel, dtype in sizes)
        self.commitments.check_allocation(job, need)
        try:
            return [(buf.array, buf) for buf in self.memory.allocate(sizes, job)]
        except (OSError, MemoryError) as exc:
            raise StoreError(f"job {job!r}: cannot allocate {need} bytes for its keys: {exc}") from None

    # --- lifecycle ------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def register(self) -> str:
        """Register with pMaster (``clusterauth``: each side proves the cluster key); raises
        TimeoutError naming the address if it never answers, RuntimeError when it refuses or
        does not prove the cluster key."""
        deadline = time.monotonic() + self.register_timeout
        self.session = None
        while time.monotonic() < deadline and not self._stop.is_set():
            nonce = clusterauth.new_nonce()
            hello = self._ask_master(wire.encode(wire.REGISTER_AGG, req=next(self._copy_reqs), nonce=nonce,
                                                 endpoints=self.endpoints, host=host_id(), pid=os.getpid()))
            if hello is None:
                continue
            if not clusterauth.verify_master(self.cluster_secret, nonce, hello.get("challenge"), hello.get("proof")):
                self.stats["ctrl_refusals"] += 1
                raise RuntimeError(f"the peer at {self.master} did not prove the cluster key: it is not this "
                                   "cluster's pMaster (or the key directories differ, $DLRT_KEYS)")
            challenge = hello["challenge"]
            session = clusterauth.ControlSession.for_aggregator(
                clusterauth.session_key(self.cluster_secret, nonce, challenge))
            reply = self._ask_master(wire.encode(
                wire.REGISTER_AGG, req=next(self._copy_reqs), nonce=nonce,
                answer=clusterauth.answer(self.cluster_secret, challenge, nonce), endpoints=self.endpoints,
                host=host_id(), pid=os.getpid(), name=self.name or self.agg_name, cpus=self.stats["cpus"],
                holding=self.store.holding(), note=self.note), session)
            if reply is None:
                continue
            self.session = session
            self.agg_id = reply["agg"]
            if reply.get("reset"):
                for job in list(self.store.jobs):
                    self._release(job)
                log.warning("pMaster had declared this aggregator lost: its jobs' keys live elsewhere now")
            log.info("registered as %s at %s (endpoints %s)", self.agg_id, self.master, self.endpoints)
            return self.agg_id
        raise TimeoutError(f"AutoPS master at {self.master} did not answer within {self.register_timeout:.0f}s")

    def _ask_master(self, msg: list, session: clusterauth.ControlSession | None = None) -> wire.Message | None:
        """One registration step: ``msg`` to pMaster and its answer (opened with ``session``
        when given), None when none came within a second. Control messages arriving
        meanwhile are handled; an error answer raises RuntimeError."""
        req = wire.decode(msg)["req"]
        self.ctrl.send_multipart(msg)
        wait_until = time.monotonic() + 1.0
        while (left := wait_until - time.monotonic()) > 0 and self.ctrl.poll(int(left * 1000) + 1):
            frames = self.ctrl.recv_multipart()
            self.orphan.seen()
            opened = session.open(frames) if session is not None else frames[:1]
            try:
                reply = wire.decode(opened or frames[:1])
            except wire.ProtocolError as exc:
                log.warning("bad message from master: %s", exc)
                continue
            if reply.get("req") != req:
                if reply.op not in (wire.OK, wire.ERROR):
                    self._on_master(frames)       # a control message, not our answer
                continue
            if reply.op == wire.ERROR:
                raise RuntimeError(f"master {self.master} refused registration: {reply['message']}")
            if opened is None:                    # an answer without pMaster's seal: not pMaster's
                self.stats["ctrl_refusals"] += 1
                continue
            return reply
        return None

    def _to_master(self, frames: list) -> None:
        """A control message to pMaster, sealed with this registration's session."""
        self.ctrl.send_multipart(self.session.seal(frames) if self.session is not None else frames)

    def run(self) -> None:
        try:
            if self.agg_id is None:
                self.register()
            self.readier.keep_reserve()
            self._loop()
        finally:
            self.close()

    def close(self) -> None:
        self.transport.close()
        self.readier.close()
        self.ctrl.close(0)
        self.ctx.term()

    def _loop(self) -> None:
        poller = zmq.Poller()
        for pollable in self._sources:
            poller.register(pollable, zmq.POLLIN)
        poller.register(self.ctrl, zmq.POLLIN)
        poller.register(self.readier.fd, zmq.POLLIN)
        self.poller = poller
        next_beat = time.monotonic()
        # the listeners' connection limits (handshake deadline, idle timeout, accepting again
        # after running out of descriptors: ``sockpoll.LinkListener.housekeep``)
        housekeepers = [hk for hk in (getattr(lst, "housekeep", None) for lst in self.transport.listeners) if hk]
        next_housekeep = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_housekeep:
                for housekeep in housekeepers:
                    housekeep(now)
                next_housekeep = now + 0.25
            if self.orphan.expired():
                log.warning("no pMaster heard from at %s for %.0fs (--orphan-timeout): exiting", self.master,
                            self.orphan.silent_for())
                self.orphaned = True
                return
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + self.heartbeat_interval
            self.cycles.run_due(now)
            due = self.cycles.next_due()
            wake = min(next_beat, due) if due is not None else next_beat
            for reports in (self.moves_in.worker_reports, self.moves_out.copy_reports):
                wake = min(wake, reports.deadline() or wake)
            timeout = max(0.0, min(wake - now, 0.2))
            for pollable, _ in poller.poll(int(timeout * 1000) + 1):
                if pollable == self.readier.fd:
                    self.readier.run_ready()
                elif pollable is self.ctrl:
                    self._drain_master()
                else:
                    self._drain(self._sources[pollable])
            self._flush_migration()

    def _drain_master(self) -> None:
        """What is queued from pMaster (at most 64 messages before polling again)."""
        for _ in range(64):
            try:
                frames = self.ctrl.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.orphan.seen()          # (pMaster answers every heartbeat)
            self._on_master(frames)

    def _drain(self, source) -> None:
        """What is queued at a listener (requests) or a peer channel (replies to our copies)."""
        if isinstance(source, Channel):
            on_message = self._on_peer
        elif self.security.curve and source.kind == "tcp":
            on_message = self._on_keyed_data
            self.readier.data_taken()
        else:
            on_message = self._on_data
            self.readier.data_taken()
        for _ in range(64):
            inbound = source.recv()
            if inbound is None:
                return
            on_message(inbound)

    def _on_keyed_data(self, inbound: Inbound) -> None:
        self._on_data(inbound, keyed=True)

    def _heartbeat(self) -> None:
        try:
            cpu = self.proc.cpu_percent(None)
        except psutil.Error:
            cpu = 0.0
        self._to_master(wire.encode(
            wire.HEARTBEAT, agg=self.agg_id or "", cpu_percent=cpu,
            bytes_held=self.store.bytes_held(), jobs=sorted(self.store.jobs),
            # commitments: all jobs', each tenant's, and the limits they are checked against
            **self.commitments.figures(),
            profile=self.store.take_profile(),
            cycle_s=self.cycles.schedule.cycle if self.cycles.schedule else None,
            **{**self.stats, **self.cycles.outliers()}))

    # --- control from pMaster -------------------------------------------------------
    def _on_master(self, frames: list) -> None:
        if self.held.offer(frames):          # an ASSIGN is being allocated: in order, after it
            return
        opened = self.session.open(frames) if self.session is not None else None
        try:
            msg = wire.decode(opened or frames[:1])
        except wire.ProtocolError as exc:
            log.warning("bad message from master: %s", exc)
            return
        if opened is None and not (msg.op == wire.ERROR and msg.get("reregister")):
            # not sealed by the pMaster this aggregator authenticated: not obeyed (only a
            # request to register again is, which runs the whole handshake again)
            self.stats["ctrl_refusals"] += 1
            log.warning("refused an unsealed %s on the control channel", msg.op)
            return
        if msg.op == wire.ASSIGN:
            self.assignments.assign(msg)
        elif msg.op == wire.RELEASE_JOB:
            self._release(msg["job"])
        elif msg.op == wire.CYCLE:
            self.cycles.set(msg["jobs"], time.monotonic())
        elif msg.op == wire.MIGRATE_PREPARE:
            self.moves_in.prepare(msg)
        elif msg.op == wire.REPLICA_PREPARE:
            self.replication.prepare(msg)
        elif msg.op == wire.MIGRATE_INIT:
            self.moves_out.init(msg)
        elif msg.op == wire.FAILOVER:
            self.recovery.failover(msg)
        elif msg.op == wire.MIGRATE_ABORT:
            self.moves_out.abort(msg)
        elif msg.op == wire.REPLICA_SET:
            self.replication.set_keys(msg)
        elif msg.op == wire.MIGRATE_DROP:
            self.moves_in.drop(msg)
        elif msg.op in (wire.OK, wire.ERROR):
            if msg.op == wire.OK and isinstance(msg.get("note"), dict):
                self.note = msg["note"]      # given back when registering with a restarted pMaster
            if msg.op == wire.ERROR:
                log.warning("master: %s", msg["message"])
                if msg.get("reregister"):
                    # pMaster restarted: register again under the same name and tell it what is
                    # held here, so it rebuilds its jobs' tables
                    self.agg_name, self.agg_id = self.agg_id or self.agg_name, None
                    try:
                        self.register()
                    except TimeoutError as exc:
                        log.warning("%s; trying again at the next heartbeat", exc)
        else:
            log.warning("unexpected %s from master", msg.op)

    def _release(self, job: str) -> None:
        self.commitments.release(job)
        state = self.store.jobs.get(job)
        if state is None:
            return
        for ks in state.keys.values():
            for pending in self.waiters.pop(id(ks), []):
                self._send_error(pending.reply, pending.req, f"job {job!r} was released")
        self.store.release(job)
        self.moves_out.release(job)
        self.moves_in.release(job)
        self.cycles.release(job)
        self.memory.release(job)
        log.info("released job %s", job)

    # --- data plane -----------------------------------------------------------------
    def _send_error(self, reply: Sender, req: int | None, text: str, no_room: bool = False) -> None:
        self.stats["errors"] += 1
        reply.send(wire.header(wire.ERROR, message=text, req=req, **({"no_room": True} if no_room else {})))

    def _on_data(self, inbound: Inbound, keyed: bool = False) -> None:
        """A request at a listener; ``keyed``: it came over CURVE (a ZeroMQ tcp listener with
        CURVE on), so its message names the key the client authenticated with."""
        reply = inbound.reply
        req = None
        try:
            msg = wire.parse(inbound.header, inbound.payloads, inbound.lent)
            req = msg.get("req")
            serve = self._data_ops.get(msg.op)
            if serve is None:
                raise wire.ProtocolError(f"operation {msg.op!r} is not served by an aggregator")
            if msg.op in clusterauth.PEER_OPS and not clusterauth.check_peer_ticket(
                    self.cluster_secret, msg["job"], msg["secret"], msg.get("peer")):
                raise SecretMismatch(f"{msg.op} of job {msg['job']} without an aggregator's proof of the "
                                     "cluster key: only aggregators send it")
            if msg.op != wire.WARM and msg.op not in clusterauth.PEER_OPS and (keyed or self.refused_jobs):
                self._check_tenant(msg, inbound.header, keyed)
            serve(reply, msg)
            if msg.op != wire.WARM:         # (the one request without a secret)
                vouch = getattr(reply, "vouch", None)
                if vouch is not None:
                    vouch()                 # a job's channel: no idle timeout, never closed for room
        except SecretMismatch as exc:
            self.stats["auth_refusals"] += 1
            log.warning("refused a data request: %s", exc)
            self._send_error(reply, req, str(exc))
        except (wire.ProtocolError, StoreError) as exc:
            self._send_error(reply, req, str(exc), no_room=isinstance(exc, NoRoom))
        except Exception as exc:  # a bug must not take the shared service down
            log.exception("internal error on a data request")
            self._send_error(reply, req, f"internal aggregator error: {exc.__class__.__name__}: {exc}")

    def _push(self, reply: Sender, msg: wire.Message) -> None:
        """PUSH (acknowledged at once) or PUSH_PULL (answered with the value of the pushed
        iteration once it is published: one message each way per key instead of four)."""
        state = self.store.job(msg["job"], msg["secret"])
        rank = msg["rank"]
        replay = bool(msg.get("replay"))      # resent after a failure: what the key has is skipped
        checked: list[tuple] = []
        redirects: list = []
        seen: set[str] = set()
        for item in msg.items(wire.PushItem):
            key, iteration = item.key, item.iteration
            if key in seen:
                raise wire.ProtocolError(f"push: repeated key {key!r}")
            seen.add(key)
            ks = self.store.key(state, key)
            mv = ks.move
            if mv is not None and mv.past(iteration):
                redirects.append(mv.notice(key).to_wire())
                continue
            data = msg.array(item.data, ks.spec.dtype)
            arrival = ks.arrival
            holding = arrival is not None and arrival.copy_missing or ks.recovering is not None
            if replay and not holding and self.store.already_has(ks, rank, iteration):
                continue
            if holding:
                # migrating here, or recovering: the iteration counter is not known yet; check the rest now
                self.store._check_rank(state, rank)
                if data.dtype != np.dtype(ks.spec.dtype) or data.size != ks.spec.numel:
                    raise StoreError(f"job {state.job!r}: push of {key!r} carries {data.size} x "
                                     f"{data.dtype}, expected {ks.spec.numel} x {ks.spec.dtype}")
            else:
                self.store.check_push(state, rank, key, iteration, data)
            # a lent buffer stays the worker's until it pulled this iteration: summed in place later
            checked.append((ks, data, item.hp, item.data.payload in msg.lent, iteration))
        if redirects:
            # nothing applied: the agent learns the new owners and resends every part
            reply.send(wire.header(wire.REDIRECT, req=msg.get("req"), items=redirects))
            return
        for ks, _, hp, _, _ in checked:
            if hp:
                arrival = ks.arrival
                if arrival is not None and arrival.copy_missing:
                    arrival.hp = hp             # applied with the copy
                    continue
                if ks.recovering is not None:
                    continue
                try:
                    self.store.set_hp(ks, hp)
                except ValueError as exc:
                    raise StoreError(f"key {ks.spec.key!r}: bad hyper-parameters: {exc}") from None
        answer_with_value = msg.op == wire.PUSH_PULL
        if not answer_with_value:
            reply.send(wire.header(wire.PUSH_ACK, req=msg.get("req"), items=[wire.Ack(k).to_wire() for k in seen]))
        now = time.monotonic()
        for ks, data, _, deferred, iteration in checked:
            self.stats["pushes"] += 1
            self.stats["bytes_in"] += data.nbytes
            arrival = ks.arrival
            if arrival is not None:
                self.moves_in.pushed(arrival.mid, state.job, now)
            if arrival is not None and arrival.copy_missing or ks.recovering is not None:
                ks.held.append((rank, iteration, data, deferred, replay))
                if arrival is not None and arrival.copy_missing and arrival.whole_at is None and \
                        sum(1 for h in ks.held if h[1] == iteration) >= ks.world_size:
                    arrival.whole_at = now      # without the move, aggregation would start now
            elif self._admit(state.job, iteration, now):
                self._apply_push(ks, rank, data, deferred)
            else:
                self.cycles.postpone(state.job, (ks, rank, data, deferred))
        if answer_with_value:
            self._answer_pull(reply, msg.get("req"), [(ks, iteration) for ks, _, _, _, iteration in checked])

    def _apply_push(self, ks: KeyState, rank: int, data: np.ndarray, deferred: bool) -> None:
        t0 = time.thread_time()
        done = self.store.push(ks, rank, data, deferred=deferred)
        ks.cpu += time.thread_time() - t0
        if done:
            self._published(ks)

    def _requested(self, state: JobState, msg: wire.Message) -> Iterator[tuple[KeyState, int]]:
        """The ``PullItem`` items of a PULL or STATE_GET, validated."""
        for item in msg.items(wire.PullItem):
            yield self.store.key(state, item.key), item.iteration

    def _pull(self, reply: Sender, msg: wire.Message) -> None:
        state = self.store.job(msg["job"], msg["secret"])
        rank = msg["rank"]
        if not 0 <= rank < state.world_size:
            raise StoreError(f"job {state.job!r}: rank {rank} outside world size {state.world_size}")
        items, redirects = [], []
        for ks, iteration in self._requested(state, msg):
            mv = ks.move
            if mv is not None and mv.past(iteration):
                redirects.append(mv.notice(ks.spec.key).to_wire())
            items.append((ks, iteration))
        if redirects:
            reply.send(wire.header(wire.REDIRECT, req=msg.get("req"), items=redirects))
            return
        self._answer_pull(reply, msg.get("req"), items)

    def _answer_pull(self, reply: Sender, req: int | None, items: list) -> None:
        """Answer a pull of ``items`` ``[(KeyState, iteration)]`` now, or park it until every
        one of them is published."""
        pending = PendingPull(reply, req, items, iteration={id(ks): it for ks, it in items})
        for ks, iteration in items:
            if not self.store.pull_ready(ks, iteration):
                pending.waiting.add(id(ks))
        if pending.waiting:
            for ks, _ in items:
                if id(ks) in pending.waiting:
                    self.waiters.setdefault(id(ks), []).append(pending)
        else:
            self._reply_pull(pending)

    def _published(self, ks: KeyState) -> None:
        """Answer the parked pulls that waited for ``ks`` and are now complete; then the
        migration steps that wait for this iteration."""
        waiting = self.waiters.pop(id(ks), None)
        keep = []
        for pending in waiting or ():
            if pending.finished:
                continue
            try:
                if not self.store.pull_ready(ks, pending.iteration[id(ks)]):
                    keep.append(pending)
                    continue
            except StoreError as exc:
                pending.finished = True
                self._send_error(pending.reply, pending.req, str(exc))
                continue
            pending.waiting.discard(id(ks))
            if not pending.waiting:
                pending.finished = True
                self._reply_pull(pending)
        if keep:
            self.waiters[id(ks)] = keep
        mv = ks.move
        if mv is not None and not mv.sent and ks.completed >= mv.cutover:
            self.moves_out.hand_over(ks)
        arrival = ks.arrival
        if arrival is not None and not arrival.copy_missing and ks.completed >= arrival.first:
            self.moves_in.served(ks)

    def _flush_migration(self) -> None:
        """The hand-overs that came due in this turn of the loop, and the reports due."""
        self.moves_out.send_due()
        self.moves_in.report()
        self.moves_out.report()

    def _reply_pull(self, pending: PendingPull) -> None:
        items, payloads, small = [], [], []
        for ks, iteration in pending.items:
            value = ks.value(iteration)
            # every reply up to the cutover names the new owner: the agents prepare ahead
            mv = ks.move
            moved = mv.notice(ks.spec.key) if mv is not None and not mv.past(iteration) else None
            self.stats["bytes_out"] += value.nbytes
            if ks.spec.small:
                small.append((ks.spec.key, iteration, moved, value))
                continue
            items.append(wire.PullReplyItem(ks.spec.key, iteration, len(payloads), moved).to_wire())  # Fig. 4.5 step 2
            payloads.append(ks.value_ref(iteration) or value)     # lent where the channel can
        if len(small) > 1:
            # a batch of small keys: one payload for all of them, not one frame each
            blob, spans = wire.pack([value for *_, value in small])
            items += [wire.PullReplyItem(key, iteration, len(payloads), moved, offset, nbytes).to_wire()
                      for (key, iteration, moved, _), (offset, nbytes) in zip(small, spans)]
            payloads.append(blob)
        elif small:
            key, iteration, moved, value = small[0]
            items.append(wire.PullReplyItem(key, iteration, len(payloads), moved).to_wire())
            payloads.append(value)
        self.stats["pulls"] += len(items)
        pending.reply.send(wire.header(wire.PULL_REPLY, req=pending.req, items=items), payloads)

    def _step_taken(self, ks: KeyState, grad: np.ndarray) -> None:
        """Store hook, right after the optimizer step of iteration ``completed + 1``: send the
        replica (``Replication.step``) and the followers of a key whose state is copied ahead
        (``MovesOut.followers_step``) that step's averaged gradient (they apply the same
        deterministic update)."""
        items, copy = self.replication.step(ks, grad)
        if ks.followers:
            self.moves_out.followers_step(ks, grad, items, copy)

    def _ticket(self, state: JobState) -> bytes:
        """What proves to another aggregator that this one holds the cluster key (``clusterauth``)."""
        return clusterauth.peer_ticket(self.cluster_secret, state.job, state.secret)

    def _peer(self, info: dict) -> Channel:
        channel = self.transport.connect(info)
        for pollable in channel.pollables:
            if pollable not in self._sources:
                self._sources[pollable] = channel
                self.poller.register(pollable, zmq.POLLIN)
        return channel

    def _on_peer(self, inbound: Inbound) -> None:
        """Another aggregator's answer: to the collaborator whose request it answers (``_answers``)."""
        try:
            msg = wire.parse(inbound.header, inbound.payloads, inbound.lent)
        except wire.ProtocolError as exc:
            log.warning("bad reply from a peer aggregator: %s", exc)
            return
        req = msg.get("req")
        for waits, answered in self._answers:
            if req in waits:
                answered(msg)
                return

    def _state_get(self, reply: Sender, msg: wire.Message) -> None:
        """Server-side state of keys right after an iteration (a worker's checkpoint): master
        copy, optimizer state and step, serialised as TENSOR_COPY serialises them."""
        state = self.store.job(msg["job"], msg["secret"])
        items, arrays, redirects = [], [], []
        for ks, iteration in self._requested(state, msg):
            mv = ks.move
            if mv is not None and mv.past(iteration):
                redirects.append(mv.notice(ks.spec.key).to_wire())
                continue
            meta, key_arrays = self.store.export_state(ks, iteration)
            items.append(wire.KeyCopy(ks.spec.key, meta, len(key_arrays)).to_wire())
            arrays.extend(key_arrays)
        if redirects:
            reply.send(wire.header(wire.REDIRECT, req=msg.get("req"), items=redirects))
            return
        # copies: the next iteration may update the live arrays before they are sent
        reply.send(wire.header(wire.STATE_REPLY, req=msg.get("req"), items=items), [a.copy() for a in arrays])

    # --- failures: take-over (``recovery``), replication (``replicas``) ----------------------------
    def _forget_waiters(self, ks: KeyState) -> None:
        """Parked pulls of a key taken over: their workers resend them (no answer)."""
        for pending in self.waiters.pop(id(ks), []):
            pending.finished = True

    def _refuse_waiters(self, ks: KeyState, why: str) -> None:
        """Parked pulls of a key that moved on, not answered yet: answered with the error ``why``."""
        for pending in self.waiters.pop(id(ks), []):
            if not pending.finished:
                pending.finished = True
                self._send_error(pending.reply, pending.req, why)

    def _replicate(self, reply: Sender, msg: wire.Message) -> None:
        """REPLICATE: to a key migrating here (``incoming``: its state sent ahead) or to a backup."""
        if msg.get("incoming"):
            self.moves_in.precopy(reply, msg)
        else:
            self.replication.receive(reply, msg)

    def _init(self, reply: Sender, msg: wire.Message) -> None:
        state = self.store.job(msg["job"], msg["secret"])
        prepared = []
        for item in msg.items(wire.InitItem):
            ks = self.store.key(state, item.key)
            data = msg.array(item.data, ks.spec.dtype)
            opt_state = {name: msg.array(sl, ks.spec.dtype) for name, sl in item.state.items()}
            prepared.append((item.key, data, opt_state, item.step))
        for key, data, opt_state, step in prepared:
            try:
                self.store.init(state, key, data, hp=msg.get("hp"), opt_state=opt_state or None, step=step)
            except ValueError as exc:
                raise StoreError(f"INIT of {key!r}: {exc}") from None
            if state.keys[key].followers:
                self.moves_out.refollow(state.keys[key])     # a migration copying its state ahead
        backed = [state.keys[key] for key, *_ in prepared if state.keys[key].replica is not None]
        if backed:
            # acknowledged once every replica holds the master copy: a worker that saw the
            # ack can rely on it surviving the loss of this aggregator
            waiter = [reply, msg.get("req"), {id(ks) for ks in backed}]
            for ks in backed:
                ks.replica_sent = -1
                ks.init_waiters.append(waiter)
                self.replication.replicate_state(ks)
        else:
            reply.send(wire.header(wire.OK, req=msg.get("req")))
        for key, *_ in prepared:
            # a pull of iteration 0, or one whose update only waited for the master copy
            self._published(state.keys[key])

    def _warm(self, reply: Sender, msg: wire.Message) -> None:
        """WARM: an agent's connection to this aggregator, opened for a move's switch, carries
        the payload here and back before the switch does (the worker's
        ``IOLoop.prepare_ahead``). Echoed, so an answer never costs more than its request; by
        value only, at most ``wire.MAX_WARM_BYTES``."""
        if msg.lent:
            raise wire.ProtocolError("warm: the payload must come by value, not lent")
        nbytes = sum(memoryview(p).nbytes for p in msg.payloads)
        if nbytes > wire.MAX_WARM_BYTES:
            raise wire.ProtocolError(f"warm: {nbytes} bytes, more than {wire.MAX_WARM_BYTES}")
        self.stats["warm_bytes"] += nbytes
        reply.send(wire.header(wire.WARM, req=msg.get("req")), list(msg.payloads))


def serve(master: str, config: AggregatorConfig) -> None:
    """Run one aggregator of pMaster ``master`` in this process until SIGTERM/SIGINT."""
    agg = Aggregator(master, **{f.name: getattr(config, f.name) for f in fields(config)})
    agg.install_signal_handlers()
    agg.run()
