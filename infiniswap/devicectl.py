"""The control loop of an Infiniswap device (thesis §2.4.1, §2.4.2, §2.4.4, §2.4.5).

``Controller`` owns one thread and every ZeroMQ socket of a device: one DEALER per daemon
(the daemon's ROUTER knows the device by that socket's routing id and sends EVICT and
CHECK_ACTIVITY to it whenever it needs to) and, optionally, a ROUTER status endpoint.
Every ``period`` the thread

1. updates each slab's activity, ``A(s) = alpha * measured + (1 - alpha) * A(s)``, from the
   core's page counters (page I/Os per second);
2. handles failures (§2.4.5): slabs whose remote I/O failed or whose remote is dead
   (``CoreDevice.failed_slabs``), including an access the daemon's fence refused because it
   took the slab back, and daemons that do not answer PING within ``timeout``, lose every
   slab they hold, exactly as in an eviction; such a daemon is left out of placement and
   PINGed again with a growing interval (``period`` doubling up to ``4 * timeout``) until it
   answers -- a daemon restarted at the same address is then used again like a new one;
3. maps every unmapped slab with ``A(s) >= HotSlab`` (§2.4.2): QUERY_MEM to two daemons of
   M_new, else M_old (``placement.place_with``), MAP to the freer, MR_INFO -> open that
   daemon's memory once per daemon incarnation (shared memory when it runs on this host,
   else TCP) -> ``CoreDevice.map_slab``.  With ``transport="rdma"`` that memory is an RDMA
   remote (one-sided READ/WRITE of the daemon's registered slabs, ``docs/rdma.md``): the
   first MR_INFO of a daemon incarnation is followed by RDMA_CONNECT / RDMA_ACCEPT (each
   side's queue-pair address), and each slab's address and rkey from its MR_INFO are given
   to the remote before the slab is mapped.

Between ticks it answers daemons: EVICT -> ``begin_evict`` (stop remote I/O, clear the
slab's bits, drain in-flight I/O) for each slab, DONE, and remap at once if the slab is still
hot (§2.4.4); CHECK_ACTIVITY -> ACTIVITY; PING -> PONG.  A daemon's PONG lists the slabs it
holds for this device, which reconciles both sides after timeouts and restarts.

Page I/O never passes through here: it runs in the C core from the caller's threads.

Security (``ctlauth``; docs/infiniswap.md, "Security"): every MAP answers the daemon's
challenge (from its FREE_MEM / PONG) for this device's routing id, which holds 128 random
bits, and carries a fresh nonce; the daemon's MR_INFO must answer that nonce with a proof of
the cluster key over the memory it offers, else the slab is given back unused.  So the
same-host path maps the shared memory of a daemon only after this control-channel proof
exchange, and the TCP data path proves the key again per connection (C handshake).  The
sockets run CURVE when the key directory says so (``security``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import queue
import random
import threading
import time
import uuid
from typing import Any, Callable, Iterable

import zmq

from infiniswap import placement
from infiniswap import protocol as p
from dlrt.endpoints import endpoint
from dlrt.hostid import host_id
from dlrt.periodic import Periodic
from dlrt.control import ControlThread

from dlrt.curve import Security, default_security
from dlrt.keys import ensure_cluster_secret
from infiniswap.channel import bind_router, context
from infiniswap.ctlauth import device_proof, new_nonce_hex, offer_proven
from infiniswap.core import CoreDevice, SlabState
from infiniswap.rdma import RdmaDevice
from infiniswap.timings import Timings

__all__ = ["Controller", "TRANSPORTS", "next_retry"]

log = logging.getLogger("infiniswap.device")

TRANSPORTS = ("auto", "shm", "tcp", "rdma")
_REPLIES = {p.FREE_MEM, p.MR_INFO, p.DONE, p.PONG, p.ERROR, p.REPORT, p.RDMA_ACCEPT}
_MAX_BATCH = 256


class _Daemon:
    """One daemon as this device sees it."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.endpoint = endpoint(addr)
        self.sock: zmq.Socket | None = None
        self.reachable = False
        self.warned = False                 # "unreachable" was logged and not yet taken back
        self.incompatible = False           # other slab size: never used
        self.instance: str | None = None
        self.host_id: str | None = None
        self.remote_id: int | None = None
        self.remote_instance: str | None = None
        self.transport: str | None = None
        self.ping_id: int | None = None
        self.ping_sent = 0.0
        self.ping_snapshot: frozenset[int] = frozenset()
        self.last_ping = -math.inf
        self.retry = 0.0                    # PING interval while unreachable (0: reachable)
        self.free_bytes: int | None = None
        self.challenge: str | None = None   # the daemon's, for this device's proof
        self.failures = 0


def next_retry(previous: float, period: float, cap: float) -> float:
    """The PING interval after another unanswered PING: ``period`` first, then doubling up to
    ``cap`` (never below ``period``)."""
    return max(period, min(cap, 2 * previous)) if previous > 0 else period


class Controller:
    """The control thread of one device.  Created and started by ``infiniswap.Device``.
    ``rdma``: the RDMA device whose queue pairs reach the daemons with ``transport="rdma"``
    (``None``: the first one, opened here -- ``RdmaUnavailable`` at once without one -- and
    closed by ``stop()``)."""

    def __init__(self, core: CoreDevice, daemons: Iterable[str], *, device_id: str,
                 hot_slab: float, alpha: float, period: float, timeout: float, transport: str,
                 rng: random.Random, status_bind: str | None, tcp_connections: int,
                 rdma: RdmaDevice | None = None, cluster_key: bytes | None = None,
                 security: Security | None = None) -> None:
        self._core = core
        self._key = cluster_key if cluster_key is not None else ensure_cluster_secret()
        self._security = security or default_security()
        self.auth_refusals = 0              # daemons that could not prove the cluster key
        self._n = core.num_slabs
        self._slab_size = core.slab_size
        self.device_id = device_id
        # 128 random bits: the daemon's proof of this device is bound to this routing id
        self._identity = f"{device_id}#{uuid.uuid4().hex}".encode()[-255:]
        self.hot_slab = float(hot_slab)
        self.alpha = float(alpha)
        self.period = float(period)
        self.timeout = float(timeout)
        self.transport = transport
        self._rng = rng
        self._tcp_connections = tcp_connections
        self._host_id = host_id()
        addrs: list[str] = []
        for a in daemons:
            if a not in addrs:
                addrs.append(a)
        self._daemons = [_Daemon(a) for a in addrs]
        self._by_addr = {d.addr: d for d in self._daemons}
        self._status_bind = endpoint(status_bind, bind=True) if status_bind else None
        self.status_address: str | None = None
        self._status: zmq.Socket | None = None

        self._mu = threading.RLock()          # Python state below, against report()
        self._where: dict[int, _Daemon] = {}  # mapped slab -> daemon
        self._activity = [0.0] * self._n
        self._last_sample = time.monotonic()
        self._mapping: tuple[_Daemon, int] | None = None
        self._remap = False
        self._no_space_logged = False
        self._next_id = 0
        self.maps = 0
        self.map_failures = 0
        self.evictions = 0                  # slabs taken back by daemons (EVICT)
        self.unmaps = 0                     # slabs given back by this device (evict_now)
        self.daemon_failures = 0
        self._map_times = Timings()
        self._evict_times = Timings()

        self._cmds: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._control = ControlThread("infiniswap-device", self._run)
        self._waker = self._control.waker
        self._ready = threading.Event()
        self._own_rdma = rdma is None and transport == "rdma"
        self._rdma = RdmaDevice() if self._own_rdma else rdma      # last: nothing fails after it

    # ---- lifecycle ----

    def start(self) -> None:
        """Open the sockets, start the thread, wait for the first PING round (<= timeout)."""
        try:
            if self._status_bind is not None:
                self._status, self.status_address = bind_router(self._status_bind, "the device's status endpoint",
                                                                security=self._security)
            for d in self._daemons:
                self._open_socket(d)
        except BaseException:
            self._close_sockets()
            self._close_rdma()
            raise
        self._control.start()
        self._ready.wait()

    def stop(self) -> None:
        """Give every mapped slab back (UNMAP, bounded wait) and end the thread.  Idempotent."""
        self._control.stop()
        self._close_sockets()
        self._control.close()
        self._close_rdma()

    def _close_rdma(self) -> None:
        if self._own_rdma and self._rdma is not None:
            self._rdma.close()                  # remotes still in the core keep their part
            self._rdma = None

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the control thread (which owns the sockets) and return its result."""
        if not self._control.alive:
            raise ValueError("device is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        self._waker.wake()
        return fut.result(timeout)

    def _open_socket(self, d: _Daemon) -> None:
        sock = context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        self._security.client(sock, d.endpoint)
        sock.connect(d.endpoint)
        d.sock = sock

    def _reset_socket(self, d: _Daemon) -> None:
        """New socket, same identity: drops whatever was queued for a daemon that is gone."""
        if d.sock is not None:
            d.sock.close(0)
            d.sock = None
        self._open_socket(d)

    def _close_sockets(self) -> None:
        for d in self._daemons:
            if d.sock is not None:
                d.sock.close(0)
                d.sock = None
        if self._status is not None:
            self._status.close(0)
            self._status = None

    # ---- the thread ----

    def _run(self) -> None:
        try:
            self._probe()
        except Exception:  # pragma: no cover - a bug; keep the device usable (disk only)
            log.exception("device: first contact with the daemons failed")
        finally:
            self._ready.set()
        tick = Periodic(self.period, time.monotonic() + self.period)
        while not self._control.stopping.is_set():
            try:
                self._poll(0.0 if self._remap else tick.wait(time.monotonic()), main=True)
                if self._remap:
                    self._remap = False
                    self._place_hot()
                if tick.due(time.monotonic()):
                    self._tick()
            except Exception:
                log.exception("device: control loop error (continuing)")
                time.sleep(min(self.period, 0.5))
        try:
            self._shutdown()
        except Exception:  # pragma: no cover
            log.exception("device: error while giving slabs back")
        self._fail_pending_commands()

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(ValueError("device is closed"))

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _send(self, d: _Daemon, data: bytes) -> bool:
        if d.sock is None:
            return False
        try:
            d.sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _poll(self, timeout: float, waiting: dict[int, _Daemon] | None = None,
              main: bool = False) -> list[tuple[int, _Daemon, p.Message]]:
        """Wait up to ``timeout`` s, handle what arrived; return replies listed in ``waiting``.
        Commands from other threads run only from the main loop (``main``), never nested
        inside a request."""
        poller = zmq.Poller()
        for d in self._daemons:
            if d.sock is not None:
                poller.register(d.sock, zmq.POLLIN)
        if self._status is not None:
            poller.register(self._status, zmq.POLLIN)
        if main:
            poller.register(self._waker.fd, zmq.POLLIN)
        events = dict(poller.poll(timeout * 1000))
        got: list[tuple[int, _Daemon, p.Message]] = []
        for d in self._daemons:
            sock = d.sock
            if sock is None or sock not in events:
                continue
            for _ in range(_MAX_BATCH):
                if d.sock is not sock:          # reset while handling a message
                    break
                try:
                    payload = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                hit = self._on_daemon_message(d, payload, waiting)
                if hit is not None:
                    got.append(hit)
        if self._status is not None and self._status in events:
            self._serve_status()
        if main and self._waker.fd in events:
            self._waker.clear()
            self._run_commands()
        return got

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def _request_many(self, reqs: list[tuple[_Daemon, str, dict[str, Any]]],
                      timeout: float) -> dict[_Daemon, p.Message | None]:
        """Send every request, wait up to ``timeout`` for all replies (None: no answer)."""
        results: dict[_Daemon, p.Message | None] = {d: None for d, _, _ in reqs}
        waiting: dict[int, _Daemon] = {}
        for d, op, fields in reqs:
            rid = self._new_id()
            if self._send(d, p.encode(op, id=rid, **fields)):
                waiting[rid] = d
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for rid, d, msg in self._poll(left, waiting):
                results[d] = msg
                waiting.pop(rid, None)
        return results

    def _request(self, d: _Daemon, op: str, **fields: Any) -> p.Message | None:
        return self._request_many([(d, op, fields)], self.timeout)[d]

    # ---- messages from daemons ----

    def _on_daemon_message(self, d: _Daemon, payload: bytes,
                           waiting: dict[int, _Daemon] | None) -> tuple[int, _Daemon, p.Message] | None:
        try:
            msg = p.decode(payload)
        except p.ProtocolError as exc:
            log.warning("device: malformed message from daemon %s: %s", d.addr, exc)
            return None
        op = msg.op
        if msg.get("challenge"):                # FREE_MEM, PONG, ERROR unauthenticated
            d.challenge = msg["challenge"]
        if op in _REPLIES:
            rid = msg.id
            if waiting is not None and rid is not None and waiting.get(rid) is d:
                return rid, d, msg
            if op == p.PONG and rid is not None and rid == d.ping_id:
                self._on_pong(d, msg)
            elif op == p.MR_INFO:
                self._on_stale_mr_info(d, msg)
            elif op == p.ERROR:
                log.debug("device: late error from daemon %s: %s", d.addr, msg["reason"])
            return None
        if op == p.EVICT:
            self._on_evict(d, msg)
        elif op == p.CHECK_ACTIVITY:
            with self._mu:
                act = {s: float(self._activity[s]) for s in msg["slabs"] if s < self._n}
            self._send(d, p.reply_to(msg, p.ACTIVITY, activity=act))
        elif op == p.PING:
            self._send(d, p.reply_to(msg, p.PONG))
        elif op == p.STATUS:
            self._send(d, p.reply_to(msg, p.REPORT, report=self.report()))
        else:
            log.warning("device: unexpected %s from daemon %s", op, d.addr)
            self._send(d, p.reply_to(msg, p.ERROR, reason=f"a device does not accept {op}",
                                     code="unexpected"))
        return None

    def _serve_status(self) -> None:
        sock = self._status
        assert sock is not None
        for _ in range(_MAX_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            envelope = frames[:-1]
            try:
                msg = p.decode(frames[-1])
                if msg.op == p.STATUS:
                    reply = p.reply_to(msg, p.REPORT, report=self.report())
                elif msg.op == p.PING:
                    reply = p.reply_to(msg, p.PONG)
                else:
                    reply = p.reply_to(msg, p.ERROR, reason=f"the status endpoint answers "
                                       f"STATUS and PING, not {msg.op}", code="unexpected")
            except p.ProtocolError as exc:
                reply = p.error(f"malformed message: {exc}", code="bad_request")
            try:
                sock.send_multipart([*envelope, reply], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _on_evict(self, d: _Daemon, msg: p.Message) -> None:
        """§2.4.4: unmap (drained) every listed slab held on ``d``, reply DONE, remap if hot."""
        evicted = []
        for s in msg["slabs"]:
            if self._where.get(s) is d:
                t0 = time.perf_counter()
                self._core.begin_evict(s)
                with self._mu:
                    del self._where[s]
                    self._evict_times.add(time.perf_counter() - t0)
                    self.evictions += 1
                evicted.append(s)
        self._send(d, p.reply_to(msg, p.DONE, slabs=list(msg["slabs"])))
        if evicted:
            log.info("device: daemon %s evicted slab(s) %s", d.addr, evicted)
            if any(self._activity[s] >= self.hot_slab for s in evicted):
                self._remap = True

    def _on_pong(self, d: _Daemon, msg: p.Message) -> None:
        d.ping_id = None
        inst = msg.get("instance")
        if inst is not None:
            self._check_instance(d, inst)
        self._mark_reachable(d)
        theirs = msg.get("slabs")
        if theirs is None:
            return
        held = set(theirs)
        mine = {s for s, w in self._where.items() if w is d}
        lost = sorted((d.ping_snapshot & mine) - held)
        for s in lost:
            log.warning("device: daemon %s no longer holds slab %d; unmapped it (its pages "
                        "are read from the backup file)", d.addr, s)
            self._unmap_local(s)
        if lost:                          # tells the daemon this device has let go of them
            self._send(d, p.encode(p.UNMAP, device_id=self.device_id, slabs=lost))
        busy = self._mapping[1] if self._mapping is not None and self._mapping[0] is d else None
        extra = sorted(s for s in held - mine if s != busy)
        if extra:
            self._send(d, p.encode(p.UNMAP, device_id=self.device_id, slabs=extra))

    def _on_stale_mr_info(self, d: _Daemon, msg: p.Message) -> None:
        s = msg["slab"]
        if self._where.get(s) is d or self._mapping == (d, s):
            return
        self._send(d, p.encode(p.UNMAP, device_id=self.device_id, slabs=[s]))

    # ---- daemon health ----

    def _check_instance(self, d: _Daemon, inst: str) -> None:
        if d.remote_instance is not None and inst != d.remote_instance:
            self._daemon_failed(d, "it restarted", reset=False)
        d.instance = inst

    def _mark_reachable(self, d: _Daemon) -> None:
        d.retry = 0.0
        if not d.reachable:
            d.reachable = True
            if d.warned:
                log.info("device: daemon %s answers again; placing slabs there again", d.addr)
                d.warned = False

    def _mark_unreachable(self, d: _Daemon, why: str) -> None:
        if any(w is d for w in self._where.values()) or d.remote_id is not None:
            self._daemon_failed(d, why)
            return
        if not d.warned:
            log.warning("device: infiniswap daemon %s is unreachable (%s); slabs stay on the "
                        "backup file %s until it answers", d.addr, why, self._core.backup_path)
            d.warned = True
        d.reachable = False
        d.ping_id = None
        d.retry = next_retry(d.retry, self.period, 4 * self.timeout)
        self._reset_socket(d)

    def _daemon_failed(self, d: _Daemon, why: str, reset: bool = True) -> None:
        """§2.4.5: like an eviction of every slab on ``d``; its memory is never used again."""
        slabs = sorted(s for s, w in self._where.items() if w is d)
        rid = d.remote_id
        if rid is not None:
            try:
                self._core.mark_remote_dead(rid)
                self._core.remove_remote(rid)       # unmaps its slabs, drains in-flight I/O
            except (OSError, ValueError) as exc:
                log.error("device: cannot drop the memory of daemon %s: %s", d.addr, exc)
            for s in slabs:                         # in case removal failed half-way
                if self._core.slab_info(s).state != SlabState.UNMAPPED:
                    self._core.begin_evict(s)
        with self._mu:
            for s in slabs:
                self._where.pop(s, None)
            d.remote_id = d.remote_instance = d.transport = None
            d.failures += 1
            self.daemon_failures += 1
        d.instance = None
        d.reachable = False
        d.ping_id = None
        d.retry = self.period               # it may be back at once (restarted)
        log.warning("device: daemon %s failed (%s): %d slab(s) unmapped, their pages are read "
                    "from the backup file", d.addr, why, len(slabs))
        d.warned = True
        if reset:
            self._reset_socket(d)
        self._remap = True

    def _shm_counts(self, d: _Daemon) -> dict[str, int]:
        """``shm_read``/``shm_written`` for a message to ``d`` while this device reaches its
        memory over shared memory (traffic the daemon cannot count itself), else nothing."""
        if d.transport != "shm" or d.remote_id is None:
            return {}
        try:
            read, written = self._core.remote_bytes(d.remote_id)
        except (OSError, ValueError):
            return {}
        return {"shm_read": read, "shm_written": written}

    def _unmap_local(self, s: int) -> None:
        self._core.begin_evict(s)
        with self._mu:
            self._where.pop(s, None)

    def _probe(self) -> None:
        """First contact: PING every daemon at once; warn about each that does not answer."""
        if not self._daemons:
            return
        replies = self._request_many([(d, p.PING, {}) for d in self._daemons], self.timeout)
        for d, msg in replies.items():
            if msg is None or msg.op != p.PONG:
                self._mark_unreachable(d, f"no answer within {self.timeout:g} s")
            else:
                d.ping_snapshot = frozenset()
                self._on_pong(d, msg)
            d.last_ping = time.monotonic()

    def _check_daemons(self, now: float) -> None:
        for d in self._daemons:
            if d.ping_id is not None:
                if now - d.ping_sent > self.timeout:
                    d.ping_id = None
                    self._mark_unreachable(d, f"no answer to PING within {self.timeout:g} s")
            elif now - d.last_ping >= max(self.period, d.retry):
                d.last_ping = now
                rid = self._new_id()
                if self._send(d, p.encode(p.PING, id=rid, **self._shm_counts(d))):
                    d.ping_id, d.ping_sent = rid, now
                    d.ping_snapshot = frozenset(s for s, w in self._where.items() if w is d)
                else:
                    self._mark_unreachable(d, "its send queue is full")

    def _check_failed_slabs(self) -> None:
        failed = self._core.failed_slabs()
        done: set[int] = set()
        for s in failed:
            d = self._where.get(s)
            if d is None:
                self._core.begin_evict(s)
                continue
            if id(d) in done:
                continue
            rid = d.remote_id
            if rid is not None and self._core.remote_dead(rid):
                done.add(id(d))
                self._daemon_failed(d, f"data path failed: {self._core.remote_error(rid)}")
            else:
                log.warning("device: remote I/O of slab %d on daemon %s failed; unmapped it",
                            s, d.addr)
                self._unmap_local(s)
                self._send(d, p.encode(p.UNMAP, device_id=self.device_id, slabs=[s]))

    # ---- the periodic tick ----

    def _tick(self) -> None:
        now = time.monotonic()
        counts = self._core.sample_activity()
        dt = max(1e-6, now - self._last_sample)
        self._last_sample = now
        a = self.alpha
        with self._mu:
            self._activity = [a * (c / dt) + (1 - a) * old
                              for c, old in zip(counts, self._activity)]
        self._check_failed_slabs()
        self._check_daemons(now)
        self._place_hot()

    # ---- placement (§2.4.2) ----

    def _place_hot(self) -> None:
        if not self._daemons:
            return
        act = self._activity
        hot = sorted((s for s in range(self._n) if act[s] >= self.hot_slab and s not in self._where),
                     key=lambda s: -act[s])
        for s in hot:
            if self._control.stopping.is_set():
                return
            if self._core.slab_info(s).state != SlabState.UNMAPPED:
                continue
            if self._place(s) is None:
                return                              # nowhere to go now: retry next tick

    def _query_free(self, addrs: list[Any]) -> dict[str, int]:
        ds = [self._by_addr[a] for a in addrs]
        replies = self._request_many([(d, p.QUERY_MEM, {}) for d in ds], self.timeout)
        out: dict[str, int] = {}
        for d, msg in replies.items():
            if msg is None:
                self._mark_unreachable(d, f"no answer to QUERY_MEM within {self.timeout:g} s")
                continue
            if msg.op != p.FREE_MEM:
                continue
            if msg["slab_size"] != self._slab_size:
                log.warning("device: daemon %s lends %d-byte slabs but this device uses %d-byte "
                            "slabs; not using it (start both with the same slab size)",
                            d.addr, msg["slab_size"], self._slab_size)
                d.incompatible = True
                continue
            inst = msg.get("instance")
            if inst is not None:
                self._check_instance(d, inst)
            self._mark_reachable(d)
            d.host_id = msg["host_id"]
            d.free_bytes = msg["free_bytes"]
            out[d.addr] = msg["free_bytes"]
        return out

    def _place(self, s: int) -> bool | None:
        """Map slab ``s``: True if mapped, False if this attempt failed, None if no daemon has room."""
        used = {w.addr for w in self._where.values()}
        views = [placement.DaemonView(d.addr, has_my_slab=d.addr in used,
                                      reachable=d.reachable and not d.incompatible)
                 for d in self._daemons]
        m_new, m_old = placement.split(views)
        if not m_new and not m_old:
            return None
        t0 = time.perf_counter()
        best = placement.place_with(m_new, m_old, self._query_free, self._slab_size, self._rng)
        if best is None:
            if not self._no_space_logged:
                log.info("device: no daemon has a free slab now; hot slabs stay on the backup "
                         "file for the moment")
                self._no_space_logged = True
            return None
        return self._map_on(self._by_addr[best], s, t0)

    def _map_on(self, d: _Daemon, s: int, t0: float) -> bool:
        self._core.begin_map(s)
        self._mapping = (d, s)
        try:
            nonce = new_nonce_hex()
            proof = {} if d.challenge is None else {
                "proof": device_proof(self._key, d.challenge, self._identity)}
            msg = self._request(d, p.MAP, device_id=self.device_id, slab=s,
                                slab_size=self._slab_size, nonce=nonce, **proof)
            if msg is None:
                self._core.abort_map(s)
                self._mark_unreachable(d, f"no answer to MAP within {self.timeout:g} s")
                return self._map_failed()
            if msg.op == p.ERROR:
                self._core.abort_map(s)
                log.info("device: daemon %s refused slab %d: %s", d.addr, s, msg["reason"])
                d.free_bytes = 0
                return self._map_failed()
            if msg.op != p.MR_INFO or msg["slab"] != s or msg["size"] != self._slab_size:
                self._core.abort_map(s)
                log.warning("device: daemon %s answered MAP of slab %d with a wrong %s", d.addr,
                            s, msg.op)
                self._send(d, p.encode(p.UNMAP, device_id=self.device_id, slabs=[s]))
                return self._map_failed()
            try:
                self._check_offer(d, nonce, msg)
                rid = self._remote_for(d, msg)
                if d.transport == "rdma":
                    self._core.set_rdma_slab(rid, msg["region"], msg["generation"],
                                             *self._rdma_lease(d, msg))
                self._core.map_slab(s, rid, msg["region"], msg["generation"])
            except (OSError, ValueError) as exc:
                if self._core.slab_info(s).state == SlabState.MAPPING:
                    self._core.abort_map(s)
                log.warning("device: cannot use slab %d on daemon %s: %s", s, d.addr, exc)
                self._send(d, p.encode(p.UNMAP, device_id=self.device_id, slabs=[s]))
                return self._map_failed()
            with self._mu:
                self._where[s] = d
                self.maps += 1
                self._map_times.add(time.perf_counter() - t0)
            self._no_space_logged = False
            return True
        finally:
            self._mapping = None

    def _check_offer(self, d: _Daemon, nonce: str, info: p.Message) -> None:
        """OSError unless ``info`` (MR_INFO) proves the cluster key for our ``nonce``: its
        memory (shared memory, data server, RDMA region) is never opened otherwise."""
        if offer_proven(self._key, nonce, info.fields):
            return
        with self._mu:
            self.auth_refusals += 1
        raise OSError(f"daemon {d.addr} could not prove the cluster key: not using its memory "
                      "(another cluster's daemon, or one with another key)")

    def _map_failed(self) -> bool:
        with self._mu:
            self.map_failures += 1
        return False

    def _remote_for(self, d: _Daemon, info: p.Message) -> int:
        """The core remote for ``d``'s current incarnation, opened on first use."""
        inst = info.get("instance")
        if d.remote_id is not None and inst is not None and d.remote_instance is not None \
                and inst != d.remote_instance:
            self._daemon_failed(d, "it restarted", reset=False)
            self._mark_reachable(d)
        if d.remote_id is not None:
            return d.remote_id
        if self.transport == "rdma":
            return self._use_remote(d, self._open_rdma_remote(d, info), inst, "rdma")
        shm_path = info.get("shm_path")
        same_host = bool(shm_path) and info["host_id"] == self._host_id
        if self.transport == "shm" and not same_host:
            raise OSError(f"daemon {d.addr} runs on another host (or offers no shared memory); "
                          "transport='shm' needs a daemon on this host")
        rid, kind = None, "tcp"
        if same_host and self.transport != "tcp":
            try:
                rid, kind = self._core.add_remote_shm(shm_path), "shm"
            except OSError as exc:
                if self.transport == "shm":
                    raise
                log.warning("device: cannot map the memory of daemon %s (%s); using TCP",
                            d.addr, exc)
        if rid is None:
            if info.get("data_port") is None:
                raise OSError(f"daemon {d.addr} runs no TCP data server and its memory cannot be "
                              "mapped here")
            rid = self._core.add_remote_tcp(info["host"], info["data_port"],
                                            connections=self._tcp_connections,
                                            timeout=self.timeout, key=self._key)
        return self._use_remote(d, rid, inst, kind)

    def _use_remote(self, d: _Daemon, rid: int, inst: str | None, kind: str) -> int:
        with self._mu:
            d.remote_id, d.remote_instance, d.transport = rid, inst, kind
        log.info("device: using daemon %s's memory over %s", d.addr, kind)
        return rid

    @staticmethod
    def _rdma_lease(d: _Daemon, info: p.Message) -> tuple[int, int]:
        """``(addr, rkey)`` of the slab in ``info`` (MR_INFO); OSError when it has none."""
        addr, rkey = info.get("rdma_addr"), info.get("rdma_rkey")
        if addr is None or rkey is None:
            raise OSError(f"daemon {d.addr} does not lend its memory over RDMA (start it with "
                          "--transport rdma)")
        return addr, rkey

    def _open_rdma_remote(self, d: _Daemon, info: p.Message) -> int:
        """A queue pair connected to ``d``'s (RDMA_CONNECT / RDMA_ACCEPT), made the core's
        RDMA remote of the daemon's slab memory; the remote id.  OSError on failure."""
        self._rdma_lease(d, info)
        assert self._rdma is not None
        qp = self._rdma.queue_pair()
        try:
            reply = self._request(d, p.RDMA_CONNECT, device_id=self.device_id, qp=qp.info)
            if reply is None:
                raise OSError(f"no answer to RDMA_CONNECT within {self.timeout:g} s")
            if reply.op != p.RDMA_ACCEPT:
                why = reply["reason"] if reply.op == p.ERROR else f"a {reply.op}"
                raise OSError(f"daemon {d.addr} refused a queue pair: {why}")
            qp.connect(reply["qp"])
            return self._core.add_remote_rdma(qp, reply["capacity"] // self._slab_size)
        finally:
            qp.close()                          # nothing when the remote took it over

    # ---- commands (run on the control thread through ``call``) ----

    def map_slabs(self, slabs: list[int] | None) -> int:
        todo = range(self._n) if slabs is None else slabs
        n = 0
        for s in todo:
            if s in self._where or self._core.slab_info(s).state != SlabState.UNMAPPED:
                continue
            r = self._place(s)
            if r is None:
                break
            n += bool(r)
        return n

    def unmap_slabs(self, slabs: list[int] | None) -> int:
        """Give slabs back on the device's own initiative (as an eviction, then UNMAP)."""
        todo = sorted(self._where) if slabs is None else [s for s in slabs if s in self._where]
        groups: dict[_Daemon, list[int]] = {}
        for s in todo:
            d = self._where[s]
            t0 = time.perf_counter()
            self._unmap_local(s)
            with self._mu:
                self._evict_times.add(time.perf_counter() - t0)
                self.unmaps += 1
            groups.setdefault(d, []).append(s)
        for d, ss in groups.items():
            self._send(d, p.encode(p.UNMAP, device_id=self.device_id, slabs=ss, **self._shm_counts(d)))
        return len(todo)

    def _shutdown(self) -> None:
        groups: dict[_Daemon, list[int]] = {}
        for s, d in sorted(self._where.items()):
            self._unmap_local(s)
            groups.setdefault(d, []).append(s)
        reqs = [(d, p.UNMAP, {"device_id": self.device_id, "slabs": ss, **self._shm_counts(d)})
                for d, ss in groups.items()]
        if reqs:
            self._request_many(reqs, min(self.timeout, 1.0))
        for d in self._daemons:
            if d.remote_id is not None:
                try:
                    self._core.remove_remote(d.remote_id)
                except (OSError, ValueError):
                    pass
                d.remote_id = None

    # ---- observation ----

    def report(self) -> dict[str, Any]:
        """A JSON-able snapshot of the control plane and the core's counters."""
        with self._mu:
            where = {s: d.addr for s, d in self._where.items()}
            activity = list(self._activity)
            daemons = {d.addr: {"reachable": d.reachable, "transport": d.transport,
                                "instance": d.instance, "free_bytes": d.free_bytes,
                                "slabs": sum(1 for w in where.values() if w == d.addr),
                                "failures": d.failures}
                       for d in self._daemons}
            counters = {"maps": self.maps, "map_failures": self.map_failures,
                        "evictions": self.evictions, "unmaps": self.unmaps,
                        "daemon_failures": self.daemon_failures,
                        "auth_refusals": self.auth_refusals,
                        "map_time_s": self._map_times.summary(),
                        "evict_time_s": self._evict_times.summary()}
        core = self._core
        slabs = []
        for s in range(self._n):
            info = core.slab_info(s)
            slabs.append({"slab": s, "state": info.state.name.lower(), "daemon": where.get(s),
                          "activity": round(activity[s], 3), "remote_pages": info.bits_set,
                          "pending_disk_writes": info.pending_disk_writes})
        mapped: dict[str, list[int]] = {}
        for s, a in sorted(where.items()):
            mapped.setdefault(a, []).append(s)
        io = core.stats()
        return {"device_id": self.device_id, "size": core.size, "slab_size": core.slab_size,
                "num_slabs": self._n, "backup": core.backup_path, "hot_slab": self.hot_slab,
                "transport": self.transport, "status_address": self.status_address,
                "slabs_mapped": len(where), "mapped": mapped, "daemons": daemons,
                "slabs": slabs, "io": {k: getattr(io, k) for k in io.__dataclass_fields__},
                **counters}

    def map_times(self) -> list[float]:
        with self._mu:
            return self._map_times.values()

    def evict_times(self) -> list[float]:
        with self._mu:
            return self._evict_times.values()
