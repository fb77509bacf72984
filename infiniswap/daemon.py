"""Infiniswap daemon: lends this machine's free memory to remote block devices (thesis §2.5).

A daemon owns

* the data plane, in C: a ``SlabStore`` (one memfd holding every slab it lends; a device on
  this host maps it, so its page I/O never involves this process -- the property RDMA gives
  Infiniswap) and a ``DataServer`` (TCP, for devices on other hosts);
* a ZeroMQ ROUTER control socket and the one control thread that uses it.  The thread
  answers devices (QUERY_MEM -> FREE_MEM, MAP -> MR_INFO, UNMAP -> DONE, PING -> PONG,
  STATUS -> REPORT) and every ``period`` runs the memory monitor (§2.5.1)::

      U    = beta * measured + (1 - beta) * U          memory used by everything else
      free = total - U - (slabs this daemon holds)

  While ``free`` stays above HeadRoom it preallocates unmapped slabs; below HeadRoom it
  releases unmapped slabs first, then batch-evicts (§2.5.2): CHECK_ACTIVITY to the devices
  of ``E + E'`` random mapped slabs, EVICT to the devices of the ``E`` least active, and it
  frees each slab when its DONE arrives.  A device whose connection is gone loses all its
  slabs at once.  A device that does not answer EVICT within ``timeout`` is taken as gone
  too, although it may only be slow and still read and write its slabs: the store's *fence*
  (``fencing.py``, ``csrc/infiniswap/isw_fence.h``) makes that harmless.  Every lease has
  a generation that the device names on each access; taking a slab back bumps it, so the
  slow device's later accesses are refused (it reads and writes its backup file instead),
  and the slab is freed or lent again as soon as no access that began before is copying.

Allocating and releasing slab memory (fallocate + mlock, hole punching: up to seconds per
GiB) runs on a second thread, the memory worker, so the control thread always answers
quickly; a MAP that finds no preallocated slab waits for the worker for at most a second
(then ERROR ``no_memory``; the device tries again later).  How many slabs and which ones is pure policy (``eviction.py``); this module
is the mechanism.
Every ``report_interval`` the control thread also hands ``stats()`` to its reporters (a
``report.ReportPublisher``, a ``report.PrometheusExporter``: objects with ``publish(stats)``,
none of which blocks), so a cluster manager sees free and lent memory per host.
A device is known by its ZeroMQ routing id (the DEALER it sent MAP from), so the daemon can
send EVICT / CHECK_ACTIVITY to it at any time.  It lends only to devices that proved the
cluster key (``ctlauth.DaemonAuth``: a MAP must answer the challenge of FREE_MEM / PONG; an
UNMAP or DONE acts only on the sender's own leases, which only a proven device has), proves
the key itself in every MR_INFO, and its data server serves only connections that proved it
(``core.DataServer``); every refusal is counted in ``stats()["auth_refusals"]``.  A malformed or unexpected message gets an
ERROR reply and a log line; nothing a peer sends stops the daemon.

What the daemon keeps per peer is bounded (``infiniswap.limits``): the control socket queues
at most ``sndhwm`` / ``rcvhwm`` messages per peer and refuses messages over ``max_message``
bytes; per routing id one ``peerrecords.PeerRecord`` (challenge, proof, name, shared-memory
counts, a rate bucket), at most ``max_peers`` of them, forgotten after ``peer_ttl`` unseen
(a proven peer holding leases never is); an identity that has not proved the key is held
to ``rate`` messages per second, the rest dropped unanswered.  The data server holds at
most ``max_connections`` connections (``DataLimits``).  Drops are counted in
``stats()["control"]`` and logged at most once per ``_LOG_EVERY`` seconds.  The memory
monitor reads ``/proc/meminfo`` through a descriptor held open (``infiniswap.meminfo``), so
it keeps measuring when a flood took every descriptor the process may open.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import psutil
import zmq

from infiniswap import eviction
from infiniswap import protocol as p
from dlrt.endpoints import endpoint
from dlrt.hostid import host_id
from dlrt.periodic import Periodic
from dlrt.control import ControlThread

from dlrt.curve import Security, default_security, refusal_counts
from dlrt.keys import ensure_cluster_secret
from infiniswap.channel import bind_router
from infiniswap.core import DataServer, SlabStore
from infiniswap.ctlauth import DaemonAuth, offer_proof
from infiniswap.limits import ControlLimits, DataLimits
from infiniswap.meminfo import MemInfo
from infiniswap.peerrecords import PeerRecord, PeerRecords
from infiniswap.fencing import RELEASE, REUSE, RegionFence
from infiniswap.rdma import RdmaDevice, RdmaUnavailable
from infiniswap.rdmalend import RdmaLending
from infiniswap.timings import Timings

__all__ = ["Daemon", "GiB", "MiB", "Reporter"]

log = logging.getLogger("infiniswap.daemon")

MiB = 1 << 20
GiB = 1 << 30
_MAX_BATCH = 256          # messages handled per wake-up before the monitor gets a turn
_LOG_EVERY = 60.0         # seconds between two log lines about dropped peers or messages


@dataclass
class _Lease:
    """One mapped slab: which device (routing id) uses which region, at which generation."""
    peer: bytes
    slab: int
    region: int
    generation: int
    since: float


@dataclass
class _Round:
    """One batch eviction in progress (§2.5.2)."""
    E: int
    phase: str                                   # "activity", then "evict"
    deadline: float
    started: float
    waiting: dict[int, bytes] = field(default_factory=dict)         # request id -> peer
    asked: dict[bytes, list[int]] = field(default_factory=dict)     # peer -> slabs
    activity: dict[tuple[bytes, int], float] = field(default_factory=dict)
    sent_at: float = 0.0


class Reporter(Protocol):
    """What the daemon hands its figures to (``infiniswap.report``); must not block."""

    def publish(self, stats: dict[str, Any]) -> Any: ...


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Daemon:
    """One Infiniswap daemon.  ``start()`` binds and starts the control thread; ``stop()``
    gives every mapped slab back (EVICT, bounded wait) and releases the memory.

    ``bind``: control endpoint (``tcp://127.0.0.1:0`` picks a free port; see ``address``).
    ``headroom``: bytes of free memory to keep for local applications (default 8 GiB).
    ``slab_size``: power of two >= 1 MiB; devices must use the same.
    ``capacity``: most bytes of slabs this daemon holds (default: ``total_memory``).
    ``total_memory``: the machine's memory (default: psutil's total).
    ``memory_reader``: ``() -> bytes used by everything else`` (default: psutil
    ``total - available - own slabs``); inject one to emulate a local application.
    ``period``/``beta``: the monitor's period (s) and EWMA factor.  ``e_prime``: ``E'`` for a
    batch of ``E`` evictions (an int, or a callable ``E -> E'``; default ``E' = E``).
    ``timeout``: how long to wait for ACTIVITY and for DONE; keep it above the devices'
    ``timeout`` (a device answers EVICT within about that), since a device that misses it
    loses its slabs while it may still be using them.  ``lock``: mlock slabs (falls
    back to unlocked slabs, with a warning, when RLIMIT_MEMLOCK is too small).
    ``data_host``: where the TCP data server listens (``None``: no TCP data path).
    ``host_name``: the host this daemon reports itself on (default ``socket.gethostname()``;
    several daemons on one machine can stand for emulated hosts).  ``reporters``: given
    ``stats()`` every ``report_interval`` seconds from the control thread, the first time at
    start; the caller closes them after ``stop()``.  ``rdma``: an opened RDMA device
    (``infiniswap.rdma.RdmaDevice``, closed by the caller after ``stop()``) to lend slabs
    over as well: each lent slab is registered as a memory region (its address and rkey go
    in MR_INFO, the region is deregistered before the slab is taken back) and devices
    connect a queue pair with RDMA_CONNECT (``infiniswap.rdmalend``).
    ``cluster_key``: the key devices and the data server's clients must prove (default: the
    key directory's, ``dlrt.keys.ensure_cluster_secret``); ``security``: CURVE keys of the
    control socket (default ``dlrt.curve.default_security()``).  ``control_limits`` /
    ``data_limits``: what the daemon keeps per control peer and how many data connections it
    holds (``infiniswap.limits``; default: from the environment, ``from_env()``).
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, headroom: int = 8 * GiB,
                 slab_size: int = GiB, capacity: int | None = None,
                 total_memory: int | None = None,
                 memory_reader: Callable[[], int] | None = None, period: float = 1.0,
                 beta: float = 0.2, e_prime: int | Callable[[int], int] | None = None,
                 timeout: float = 5.0, lock: bool = True, data_host: str | None = "127.0.0.1",
                 data_port: int = 0, rng: random.Random | None = None,
                 host_name: str | None = None, reporters: Sequence[Reporter] = (),
                 report_interval: float = 1.0, rdma: RdmaDevice | None = None,
                 cluster_key: bytes | None = None, security: Security | None = None,
                 control_limits: ControlLimits | None = None,
                 data_limits: DataLimits | None = None) -> None:
        if not isinstance(slab_size, int) or not _pow2(slab_size) or slab_size < MiB:
            raise ValueError(f"slab size {slab_size!r} must be a power of two of at least 1 MiB")
        if not isinstance(headroom, int) or headroom < 0:
            raise ValueError(f"headroom {headroom!r} must be a non-negative number of bytes")
        if not period > 0:
            raise ValueError(f"period {period!r} must be positive (seconds)")
        if not 0 < beta <= 1:
            raise ValueError(f"beta {beta!r} must be in (0, 1]")
        if not timeout > 0:
            raise ValueError(f"timeout {timeout!r} must be positive (seconds)")
        if not report_interval > 0:
            raise ValueError(f"report interval {report_interval!r} must be positive (seconds)")
        total = int(total_memory) if total_memory is not None else psutil.virtual_memory().total
        cap = int(capacity) if capacity is not None else total
        if cap < slab_size:
            raise ValueError(f"capacity {cap} is smaller than one slab ({slab_size} bytes)")
        self._bind = endpoint(bind, bind=True)
        self.headroom = headroom
        self.slab_size = slab_size
        self.capacity = cap - cap % slab_size
        self.total_memory = total
        self.period = float(period)
        self.beta = float(beta)
        self.timeout = float(timeout)
        self._reader = memory_reader
        if e_prime is None:
            self._e_prime: Callable[[int], int] = lambda e: e
        elif callable(e_prime):
            self._e_prime = e_prime
        else:
            self._e_prime = lambda e, k=int(e_prime): k
        self._lock_slabs = bool(lock)
        self._data_host = data_host
        self._data_port = data_port
        self._rng = rng or random.Random()
        self.instance = uuid.uuid4().hex[:12]
        self.host_id = host_id()
        self.host_name = host_name or socket.gethostname()
        self._reporters = list(reporters)
        self.report_interval = float(report_interval)

        self._mu = threading.RLock()            # guards everything below against stats()
        self._store: SlabStore | None = None
        self._server: DataServer | None = None
        self._sock: zmq.Socket | None = None
        self._control = ControlThread("infiniswap-daemon", self._run)
        self._waker = self._control.waker
        self._address: str | None = None
        self._U: float | None = None
        self._free_list: list[int] = []                  # preallocated, unmapped regions
        self._leases: dict[tuple[bytes, int], _Lease] = {}
        self._fence: RegionFence | None = None           # with the store
        # leases taken back from a device that did not confirm (it may only be slow):
        # (peer, slab) -> region, until its late DONE / UNMAP or its disconnection
        self._revoked: dict[tuple[bytes, int], int] = {}
        self._to_free: list[int] = []                    # regions the memory worker releases
        self._allocating = 0                             # slabs the worker is allocating now
        self._locked: set[int] = set()                   # regions that are mlocked
        self._pending_maps: list[tuple[list[bytes], p.Message, float]] = []
        self._alloc_blocked_until = 0.0                  # back-off after a failed allocation
        self._mem_wake = threading.Event()
        self._mem_stop = False
        self._mem_thread: threading.Thread | None = None
        self.control_limits = control_limits or ControlLimits.from_env()
        self.data_limits = data_limits or DataLimits.from_env()
        lim = self.control_limits
        # one record per control peer (routing id): challenge, proof, name, the shared-memory
        # traffic it reported (PING, UNMAP: the daemon's CPU never sees it), rate bucket
        self._peers = PeerRecords(lim.max_peers, lim.peer_ttl, lim.rate, lim.burst,
                                  pinned=self._holds_leases, on_drop=self._peer_dropped)
        self._shm_done = (0, 0)                          # counts of records reset or dropped
        self._replies_dropped = 0                        # a peer's send queue was full
        self._measure_failures = 0                       # memory usage reads that failed
        self._meminfo: MemInfo | None = None             # /proc/meminfo, open while started
        self._logged: dict[str, tuple[float, int]] = {}  # what -> (when logged, count then)
        self._round: _Round | None = None
        self._next_id = 0
        self._closing = False
        self._next_reap = 0.0
        self.evictions = 0
        self.evict_rounds = 0
        self.devices_lost = 0
        self.requests = 0
        self.bad_messages = 0
        self.maps = 0
        self._evict_times = Timings()
        self._failure: BaseException | None = None
        self._rdma = rdma
        self._key = cluster_key if cluster_key is not None else ensure_cluster_secret()
        self._security = security or default_security()
        self._curve_refusals_before = refusal_counts()      # this daemon counts its own from here
        self._auth = DaemonAuth(self._key, self._peers)
        self._data_refusals_logged = 0
        self._lending: RdmaLending | None = None         # with the store, when rdma is given

    # ---- lifecycle ----

    def start(self) -> "Daemon":
        """Allocate the store, start the data server, bind, run the control thread."""
        if self._control.started:
            raise RuntimeError("daemon already started")
        self._store = SlabStore(self.capacity, self.slab_size, lock=self._lock_slabs)
        self._fence = RegionFence(self._store)
        self._meminfo = self._open_meminfo()
        if self._rdma is not None:
            self._lending = RdmaLending(self._rdma, self._store, self.slab_size)
        try:
            if self._data_host is not None:
                self._server = DataServer(
                    self._store, self._data_host, self._data_port, key=self._key,
                    handshake_timeout=self.data_limits.handshake_timeout,
                    max_connections=self.data_limits.max_connections)
            # ROUTER_MANDATORY: a send to a gone device raises; HANDOVER: a device that
            # reconnects keeps its identity; the limits bound every peer's queues
            self._sock, self._address = bind_router(self._bind, "the daemon's control socket",
                                                    security=self._security,
                                                    ROUTER_MANDATORY=1, ROUTER_HANDOVER=1,
                                                    **self.control_limits.socket_options())
            self._monitor(time.monotonic())
        except BaseException:
            self._release_data_plane()
            self._close_meminfo()
            raise
        self._mem_thread = threading.Thread(target=self._memory_loop,
                                            name="infiniswap-daemon-mem", daemon=True)
        self._mem_thread.start()
        self._control.start()
        log.info("daemon %s: control %s, data %s, slab %d MiB, headroom %d MiB, capacity %d MiB",
                 self.instance, self._address, self.data_address or "none",
                 self.slab_size >> 20, self.headroom >> 20, self.capacity >> 20)
        return self

    def stop(self) -> None:
        """Evict every mapped slab (bounded by ``timeout``), stop, free the memory.  Idempotent."""
        self._control.stop()
        m = self._mem_thread
        if m is not None:
            with self._mu:
                self._mem_stop = True
                self._mem_wake.set()
            m.join()
            self._mem_thread = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._release_data_plane()
        self._control.close()
        self._close_meminfo()

    def _open_meminfo(self) -> MemInfo | None:
        """/proc/meminfo held open for ``_measure`` (it then needs no new descriptor: it keeps
        working when a flood took them all); None with a memory reader given, or where it
        cannot be read (psutil is used then)."""
        if self._reader is not None:
            return None
        try:
            return MemInfo()
        except (OSError, ValueError) as exc:
            log.info("daemon: /proc/meminfo cannot be read (%s): memory use from psutil", exc)
            return None

    def _close_meminfo(self) -> None:
        if self._meminfo is not None:
            self._meminfo.close()
            self._meminfo = None

    def _release_data_plane(self) -> None:
        if self._lending is not None:           # no NIC may touch the slabs once unmapped
            self._lending.close()
            self._lending = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> "Daemon":
        return self if self._control.started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """The bound control endpoint (``tcp://127.0.0.1:PORT``)."""
        if self._address is None:
            raise RuntimeError("daemon not started")
        return self._address

    @property
    def data_address(self) -> str | None:
        if self._server is None:
            return None
        return f"{self._advertised_host()}:{self._server.port()}"

    @property
    def running(self) -> bool:
        return self._control.alive

    def _advertised_host(self) -> str:
        h = self._data_host or ""
        return socket.gethostname() if h in ("", "0.0.0.0", "::", "*") else h

    # ---- memory accounting ----

    # All of this is Python bookkeeping (under ``_mu``): it counts slabs the memory worker is
    # still allocating or releasing, which the store's own counters publish only when done.

    def _measure(self) -> int:
        if self._reader is not None:
            return int(self._reader())
        if self._meminfo is not None:
            used = self._meminfo.used()
        else:
            vm = psutil.virtual_memory()
            used = vm.total - vm.available
        own = (self._held() + len(self._to_free)) * self.slab_size   # what is resident now
        return max(0, used - own)

    def _held(self) -> int:
        """Slabs this daemon holds once queued releases are done (allocations included)."""
        return (len(self._free_list) + len(self._leases) + self._draining() +
                self._allocating)

    def _draining(self) -> int:
        """Slabs taken back whose last accesses are still copying (neither lent nor freed)."""
        return self._fence.draining if self._fence is not None else 0

    def _free(self) -> float:
        return self.total_memory - (self._U or 0.0) - self._held() * self.slab_size

    def _giveable(self) -> int:
        """Bytes this daemon can give to new slabs now (what FREE_MEM reports)."""
        if self._closing:
            return 0
        free = self._free()
        if free < self.headroom:
            return 0
        spare = self._spare()
        slabs = len(self._free_list) + self._allocating + spare - len(self._pending_maps)
        return max(0, slabs) * self.slab_size

    def _spare(self) -> int:
        """More slabs that could be allocated while keeping HeadRoom free."""
        free = self._free()
        if free < self.headroom or time.monotonic() < self._alloc_blocked_until:
            return 0
        return eviction.slabs_to_preallocate(int(free), self.headroom, self.slab_size,
                                             allocated=self._held(),
                                             limit=self.capacity // self.slab_size)

    def _release(self, region: int) -> None:
        """Queue a region for the memory worker to give back to the OS."""
        self._to_free.append(region)
        self._mem_wake.set()

    def _take_back(self, region: int, then: str) -> None:
        """A lease of ``region`` ended: deregister its RDMA region (the rkey is the lease),
        fence it, then reuse or release it once no access of that lease is in progress (now,
        or from ``_monitor`` later)."""
        assert self._fence is not None
        if self._lending is not None:
            self._lending.take_back(region)
        if self._fence.take_back(region, then):
            self._use_taken_back(region, then)

    def _use_taken_back(self, region: int, then: str) -> None:
        if then == REUSE:
            self._free_list.append(region)      # unmapped; the monitor releases it if need be
        else:
            self._release(region)

    # ---- memory worker (its own thread: allocation can take seconds) ----

    def _memory_loop(self) -> None:
        store = self._store
        assert store is not None
        while True:
            self._mem_wake.wait()
            with self._mu:
                if self._mem_stop:
                    return
                region = self._to_free.pop() if self._to_free else None
                if region is None:
                    want = (self._pending_maps or self._spare() > 0) and not self._closing
                    if not want:
                        self._mem_wake.clear()
                        continue
                    self._allocating += 1
            if region is not None:
                try:
                    store.free_slab(region)
                except OSError as exc:
                    with self._mu:
                        if exc.errno == errno.EBUSY:    # a device access is still copying
                            assert self._fence is not None
                            self._fence.wait(region, RELEASE)
                            continue
                    log.error("daemon: cannot release a slab: %s", exc)  # pragma: no cover
                with self._mu:
                    self._locked.discard(region)
                continue
            try:
                region, locked = self._alloc(store)
            except OSError as exc:
                with self._mu:
                    self._allocating -= 1
                    self._alloc_blocked_until = time.monotonic() + self.period
                log.warning("daemon: cannot allocate a slab: %s", exc)
                self._waker.wake()                   # pending MAPs get their answer
                continue
            with self._mu:
                self._allocating -= 1
                self._free_list.append(region)
                if locked:
                    self._locked.add(region)
                waiting = bool(self._pending_maps)
            if waiting:
                self._waker.wake()

    def _alloc(self, store: SlabStore) -> tuple[int, bool]:
        lock = self._lock_slabs
        try:
            return store.alloc_slab(lock=lock), lock
        except OSError as exc:
            if not lock or exc.errno not in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
                raise
            log.warning("cannot mlock a %d MiB slab (RLIMIT_MEMLOCK %s): lending unlocked "
                        "memory from now on -- it could be swapped out; raise the limit "
                        "(ulimit -l) or pass --no-lock to silence this",
                        self.slab_size >> 20, _memlock_limit())
            self._lock_slabs = False
            return store.alloc_slab(lock=False), False

    # ---- control thread ----

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        start = time.monotonic()
        tick = Periodic(self.period, start + self.period)
        report = Periodic(self.report_interval if self._reporters else None, start)
        try:
            while not self._control.stopping.is_set():
                now = time.monotonic()
                wake_at = min(tick.deadline, report.deadline)
                if self._round is not None:
                    wake_at = min(wake_at, self._round.deadline)
                if self._pending_maps:
                    wake_at = min(wake_at, self._pending_maps[0][2])
                events = dict(poller.poll(max(0.0, wake_at - now) * 1000))
                if self._waker.fd in events:
                    self._waker.clear()
                if sock in events:
                    self._drain(sock)
                now = time.monotonic()
                with self._mu:
                    if self._pending_maps:
                        self._serve_pending_maps(now)
                    if self._round is not None and now >= self._round.deadline:
                        self._round_timeout(now)
                    if tick.due(now):
                        self._monitor(now)
                if report.due(now):
                    self._report()
            self._give_back_all(poller, sock)
        except BaseException as exc:  # pragma: no cover - a bug; keep the traceback in the log
            self._failure = exc
            log.exception("daemon control thread failed")

    def _report(self) -> None:
        """Hand ``stats()`` to every reporter; a failing one is logged, never fatal."""
        stats = self.stats()
        for reporter in self._reporters:
            try:
                reporter.publish(stats)
            except Exception as exc:
                log.warning("daemon: reporter %s failed: %s", type(reporter).__name__, exc)

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(_MAX_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            with self._mu:
                try:
                    self._handle(frames[:-1], frames[-1])
                except Exception:
                    log.exception("daemon: error handling a message from %s",
                                  self._name(frames[0]))
                    self._send(frames[:-1], p.error("internal error in the daemon; see its log",
                                                    code="internal"))

    def _name(self, peer: bytes) -> str:
        rec = self._peers.get(peer)
        return (rec.name if rec is not None else None) or peer.hex()

    def _send(self, envelope: list[bytes], data: bytes) -> str:
        """``"ok"``, ``"gone"`` (the peer is not connected) or ``"full"`` (its queue is)."""
        assert self._sock is not None
        try:
            self._sock.send_multipart([*envelope, data], zmq.NOBLOCK)
            return "ok"
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return "gone"
            if exc.errno == errno.EAGAIN:
                self._replies_dropped += 1
                self._log_rarely("full", self._replies_dropped,
                                 "daemon: %d message(s) dropped so far: the peer's send queue "
                                 "was full (it does not read its replies; last: %s)",
                                 self._name(envelope[0]))
                return "full"
            raise

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # ---- messages ----

    def _handle(self, envelope: list[bytes], payload: bytes) -> None:
        peer = envelope[0]
        if self._peers.seen(peer) is None or not self._peers.allow(peer):
            return                  # no room for it, or over its rate: dropped, counted
        try:
            msg = p.decode(payload)
        except p.ProtocolError as exc:
            self.bad_messages += 1
            log.warning("daemon: malformed message from %s: %s", self._name(peer), exc)
            self._send(envelope, p.error(f"malformed message: {exc}", code="bad_request"))
            return
        op = msg.op
        if op in (p.PING, p.UNMAP) and msg.get("shm_read") is not None:
            self._note_shm(peer, msg["shm_read"], msg["shm_written"])
        if op in (p.ACTIVITY, p.DONE):
            self._on_reply(peer, msg)
            return
        if op == p.PONG:
            return
        if op == p.ERROR:
            log.warning("daemon: %s reported an error: %s", self._name(peer), msg["reason"])
            return
        self.requests += 1
        gated = op == p.MAP or (op == p.RDMA_CONNECT and self._lending is not None)
        if gated and not self._auth.admit(peer, msg.get("proof")):
            log.warning("daemon: refused %s from %s: it did not prove the cluster key", op,
                        self._name(peer))
            reply = p.reply_to(msg, p.ERROR, code="unauthenticated",
                               reason="this daemon lends memory only to devices that prove the "
                                      "cluster key (answer the challenge of FREE_MEM or PONG)",
                               **self._challenge(peer))
        elif op == p.QUERY_MEM:
            reply = p.reply_to(msg, p.FREE_MEM, **self._free_mem(), **self._challenge(peer))
        elif op == p.MAP:
            reply = self._on_map(envelope, msg)
            if reply is None:                   # waits for the memory worker
                return
        elif op == p.UNMAP:
            reply = self._on_unmap(peer, msg)
        elif op == p.RDMA_CONNECT:
            reply = self._on_rdma_connect(peer, msg)
        elif op == p.PING:
            mine = sorted(lease.slab for lease in self._leases.values() if lease.peer == peer)
            reply = p.reply_to(msg, p.PONG, instance=self.instance, slabs=mine,
                               **self._challenge(peer))
        elif op == p.STATUS:
            reply = p.reply_to(msg, p.REPORT, report=self.stats())
        else:
            self.bad_messages += 1
            log.warning("daemon: unexpected %s from %s", op, self._name(peer))
            reply = p.reply_to(msg, p.ERROR, reason=f"a daemon does not accept {op}",
                               code="unexpected")
        self._send(envelope, reply)

    def _note_shm(self, peer: bytes, read: int, written: int) -> None:
        """A proven device's running shared-memory counts; a drop means it counts anew (it
        mapped this daemon's memory again): what it reported before stays counted."""
        rec = self._peers.get(peer)
        if rec is None or not rec.proven:       # only a device that mapped memory has any
            return
        last = rec.shm
        if read < last[0] or written < last[1]:
            self._shm_done = (self._shm_done[0] + last[0], self._shm_done[1] + last[1])
        rec.shm = (read, written)

    def _peer_dropped(self, peer: bytes, rec: PeerRecord) -> None:
        """A peer's record goes (expired, made room, device gone): keep its counts' sums."""
        self._shm_done = (self._shm_done[0] + rec.shm[0], self._shm_done[1] + rec.shm[1])

    def _holds_leases(self, peer: bytes) -> bool:
        """Whether ``peer`` holds a lease, a revoked one, or a fenced region (its record is
        kept)."""
        return (any(lease.peer == peer for lease in self._leases.values()) or
                any(key[0] == peer for key in self._revoked) or
                (self._fence is not None and peer in self._fence.holders()))

    def _shm_served(self) -> tuple[int, int]:
        """Bytes devices read from / wrote to this daemon's memory over shared memory."""
        recs = list(self._peers.records())
        return (self._shm_done[0] + sum(r.shm[0] for r in recs),
                self._shm_done[1] + sum(r.shm[1] for r in recs))

    def _served(self, tcp: Any) -> dict[str, Any] | None:
        """What this daemon served: its TCP data server's counts plus the shared-memory
        traffic devices reported (None with neither a data server nor such traffic)."""
        shm_read, shm_written = self._shm_served()
        if tcp is None and (shm_read, shm_written) == (0, 0):
            return None
        tcp_read = 0 if tcp is None else tcp.bytes_read
        tcp_written = 0 if tcp is None else tcp.bytes_written
        return {"requests": 0 if tcp is None else tcp.requests,
                "bytes_read": tcp_read + shm_read, "bytes_written": tcp_written + shm_written,
                "tcp_bytes_read": tcp_read, "tcp_bytes_written": tcp_written,
                "shm_bytes_read": shm_read, "shm_bytes_written": shm_written,
                "connections": 0 if tcp is None else tcp.connections,
                "active_connections": 0 if tcp is None else tcp.active_connections,
                "max_connections": 0 if tcp is None else tcp.max_connections,
                "capacity_closes": 0 if tcp is None else tcp.capacity_closes,
                "accept_pauses": 0 if tcp is None else tcp.accept_pauses,
                "errors": 0 if tcp is None else tcp.errors}

    def _challenge(self, peer: bytes) -> dict[str, str]:
        """The ``challenge`` field for ``peer`` while it has not proved the key."""
        challenge = self._auth.challenge(peer)
        return {} if challenge is None else {"challenge": challenge}

    def _free_mem(self) -> dict[str, Any]:
        giveable = self._giveable()
        return {"free_bytes": giveable, "slab_size": self.slab_size,
                "slabs_free": giveable // self.slab_size, "slabs_mapped": len(self._leases),
                "host_id": self.host_id, "instance": self.instance}

    def _on_map(self, envelope: list[bytes], msg: p.Message) -> bytes | None:
        """MR_INFO or ERROR now, or ``None`` when the MAP waits for an allocation."""
        peer = envelope[0]
        want = msg.get("slab_size")
        if want is not None and want != self.slab_size:
            return p.reply_to(msg, p.ERROR, code="slab_size",
                              reason=f"this daemon's slab size is {self.slab_size} bytes, the "
                                     f"device uses {want}; start both with the same --slab-size")
        self._set_name(peer, msg["device_id"])
        if (peer, msg["slab"]) in self._leases:         # a retried MAP: the same region
            return self._mr_info(peer, msg)
        if self._giveable() < self.slab_size:
            return p.reply_to(msg, p.ERROR, code="no_memory",
                              reason="no free slab: free memory is at HeadRoom")
        if not self._free_list:
            # answer within a second either way, well inside a device's timeout
            self._pending_maps.append((envelope, msg, time.monotonic() + min(self.timeout, 1.0)))
            self._mem_wake.set()
            return None
        return self._mr_info(peer, msg)

    def _mr_info(self, peer: bytes, msg: p.Message) -> bytes:
        slab = msg["slab"]
        lease = self._leases.get((peer, slab))
        assert self._store is not None and self._fence is not None
        region = lease.region if lease is not None else self._free_list[-1]
        try:
            rdma = self._lending.lend(region) if self._lending is not None else {}
        except RdmaUnavailable as exc:
            return p.reply_to(msg, p.ERROR, code="rdma",
                              reason=f"cannot lend the slab over RDMA: {exc}")
        if lease is None:
            region = self._free_list.pop()
            lease = _Lease(peer, slab, region, self._store.generation(region), time.monotonic())
            self._leases[(peer, slab)] = lease
            self._fence.lent(region, peer)
            self.maps += 1
        offer = dict(slab=slab, region=lease.region, size=self.slab_size,
                     generation=lease.generation, host_id=self.host_id,
                     host=self._advertised_host(),
                     data_port=self._server.port() if self._server is not None else None,
                     shm_path=self._store.path(), instance=self.instance, **rdma)
        vouch = offer_proof(self._key, msg.get("nonce"), offer)   # the device checks it
        return p.reply_to(msg, p.MR_INFO, **offer, **({} if vouch is None else {"proof": vouch}))

    def _on_rdma_connect(self, peer: bytes, msg: p.Message) -> bytes:
        """RDMA_CONNECT: a queue pair for this device, connected to its one (RDMA_ACCEPT)."""
        if self._lending is None:
            return p.reply_to(msg, p.ERROR, code="no_rdma",
                              reason="this daemon does not lend over RDMA: start it with "
                                     "--transport rdma")
        self._set_name(peer, msg["device_id"])
        try:
            qp = self._lending.accept(peer, msg["qp"])
        except (OSError, ValueError) as exc:
            return p.reply_to(msg, p.ERROR, code="rdma",
                              reason=f"cannot connect a queue pair: {exc}")
        return p.reply_to(msg, p.RDMA_ACCEPT, qp=qp, capacity=self.capacity, instance=self.instance)

    def _set_name(self, peer: bytes, name: str) -> None:
        rec = self._peers.get(peer)
        if rec is not None:
            rec.name = name

    def _serve_pending_maps(self, now: float) -> None:
        """Answer MAPs that waited for the memory worker: MR_INFO, or ERROR once hopeless."""
        keep = []
        for envelope, msg, deadline in self._pending_maps:
            peer = envelope[0]
            if self._free_list or (peer, msg["slab"]) in self._leases:
                self._send(envelope, self._mr_info(peer, msg))
            elif now >= deadline or self._closing or (
                    self._allocating == 0 and self._spare() == 0):
                self._send(envelope, p.reply_to(msg, p.ERROR, code="no_memory",
                                                reason="no slab could be allocated in time"))
            else:
                keep.append((envelope, msg, deadline))
        self._pending_maps = keep

    def _on_unmap(self, peer: bytes, msg: p.Message) -> bytes:
        for slab in msg["slabs"]:
            lease = self._leases.pop((peer, slab), None)
            if lease is not None:
                self._lease_ended(lease, REUSE)
            else:
                self._confirm_revoked(peer, slab)   # a slow device lets go of a revoked one
        return p.reply_to(msg, p.DONE, slabs=list(msg["slabs"]))

    def _lease_ended(self, lease: _Lease, then: str) -> None:
        """The device confirmed it let go of the lease (drained): fence, then reuse/release."""
        assert self._fence is not None
        self._fence.let_go(lease.region, lease.peer)
        self._take_back(lease.region, then)

    def _confirm_revoked(self, peer: bytes, slab: int) -> None:
        region = self._revoked.pop((peer, slab), None)
        if region is not None:
            assert self._fence is not None
            self._fence.let_go(region, peer)

    def _device_gone(self, peer: bytes, why: str, slow: bool = False) -> None:
        """Take back every slab of ``peer`` through the fence: its connection is gone, or it
        did not answer in time (``slow``: it may still access them until the revoke, and its
        later accesses are refused)."""
        assert self._fence is not None
        slabs = [key for key in self._leases if key[0] == peer]
        name = self._name(peer)
        if not slow:
            self._fence.gone(peer)
            if self._lending is not None:
                self._lending.peer_gone(peer)
            for key in [k for k in self._revoked if k[0] == peer]:
                del self._revoked[key]
        for key in slabs:
            region = self._leases.pop(key).region
            if slow:
                self._revoked[key] = region
            self._take_back(region, RELEASE if slow else REUSE)
        if not slow:
            self._auth.forget(peer)             # it proves the key again if it comes back
        if slabs:
            self.devices_lost += 1
            log.warning("daemon: device %s %s; took back its %d slab(s)%s", name, why,
                        len(slabs), " (fenced: its later accesses are refused)" if slow else "")

    # ---- memory monitor (§2.5.1) ----

    def _monitor(self, now: float) -> None:
        self._log_data_refusals()
        self._expire_peers()
        try:
            measured = self._measure()
        except Exception as exc:        # e.g. out of descriptors: said once a minute at most
            self._measure_failures += 1
            self._log_rarely("measure", self._measure_failures,
                             "daemon: cannot read memory usage (%d time(s) so far; last: %s)", exc,
                             level=logging.ERROR)
            return
        self._U = float(measured) if self._U is None else (
            self.beta * measured + (1 - self.beta) * self._U)
        free = self._free()
        if free < self.headroom:
            n_unmapped, n_mapped = eviction.slabs_to_release(
                int(free), self.headroom, self.slab_size, len(self._free_list), len(self._leases))
            for _ in range(n_unmapped):
                self._release(self._free_list.pop())
            if n_mapped and self._round is None and not self._closing:
                self._start_round(n_mapped, now)
        elif not self._closing and self._spare() > 0:
            self._mem_wake.set()                        # preallocate (§2.5.1)
        if now >= self._next_reap:                  # notice devices that went away
            self._next_reap = now + max(1.0, self.period)
            peers = {lease.peer for lease in self._leases.values()}
            peers |= {key[0] for key in self._revoked}
            if self._fence is not None:
                peers |= self._fence.holders()
            for peer in peers:
                if self._send([peer], p.encode(p.PING)) == "gone":
                    self._device_gone(peer, "disconnected")
        if self._fence is not None:
            for region, then in self._fence.settle():
                self._use_taken_back(region, then)

    # ---- batch eviction (§2.5.2) ----

    def _start_round(self, E: int, now: float) -> None:
        E_prime = max(0, int(self._e_prime(E)))
        sample = eviction.sample(list(self._leases), E, E_prime, self._rng)
        rnd = _Round(E=E, phase="activity", deadline=now + self.timeout, started=now)
        self._round = rnd
        self.evict_rounds += 1
        by_peer: dict[bytes, list[int]] = {}
        for peer, slab in sample:
            by_peer.setdefault(peer, []).append(slab)
        log.info("daemon: free memory below HeadRoom: evicting %d of %d sampled slab(s)", E,
                 len(sample))
        for peer, slabs in by_peer.items():
            rid = self._new_id()
            status = self._send([peer], p.encode(p.CHECK_ACTIVITY, id=rid, slabs=slabs))
            if status == "gone":
                self._device_gone(peer, "disconnected")
                continue
            rnd.waiting[rid] = peer
            rnd.asked[peer] = slabs
            for s in slabs:
                rnd.activity[(peer, s)] = 0.0
        if not rnd.waiting:
            self._evict_phase(now)

    def _on_reply(self, peer: bytes, msg: p.Message) -> None:
        rnd = self._round
        rid = msg.id
        if rnd is None or rid is None or rnd.waiting.get(rid) != peer:
            if msg.op == p.DONE:                    # a late DONE: it drained those slabs
                for s in msg["slabs"]:
                    self._confirm_revoked(peer, s)
            log.debug("daemon: stale %s from %s", msg.op, self._name(peer))
            return
        now = time.monotonic()
        del rnd.waiting[rid]
        slabs = rnd.asked.get(peer, [])
        if rnd.phase == "activity" and msg.op == p.ACTIVITY:
            reported = msg["activity"]
            for s in slabs:
                rnd.activity[(peer, s)] = float(reported.get(s, 0.0))
            if not rnd.waiting:
                self._evict_phase(now)
        elif rnd.phase == "evict" and msg.op == p.DONE:
            for s in slabs:
                lease = self._leases.pop((peer, s), None)
                if lease is not None:
                    self._lease_ended(lease, RELEASE)
                    self.evictions += 1
                    self._evict_times.add(now - rnd.sent_at)
            if not rnd.waiting:
                self._round = None

    def _evict_phase(self, now: float) -> None:
        rnd = self._round
        assert rnd is not None
        live = {k: a for k, a in rnd.activity.items() if k in self._leases}
        chosen = eviction.choose(live, rnd.E)
        rnd.phase, rnd.waiting, rnd.asked = "evict", {}, {}
        rnd.deadline, rnd.sent_at = now + self.timeout, now
        by_peer: dict[bytes, list[int]] = {}
        for peer, slab in chosen:
            by_peer.setdefault(peer, []).append(slab)
        for peer, slabs in by_peer.items():
            rid = self._new_id()
            status = self._send([peer], p.encode(p.EVICT, id=rid, slabs=slabs))
            if status == "gone":
                self._device_gone(peer, "disconnected")
                continue
            rnd.waiting[rid] = peer
            rnd.asked[peer] = slabs
        if not rnd.waiting:
            self._round = None

    def _round_timeout(self, now: float) -> None:
        rnd = self._round
        assert rnd is not None
        if rnd.phase == "activity":
            for peer in set(rnd.waiting.values()):
                log.warning("daemon: device %s did not answer CHECK_ACTIVITY within %.3g s; "
                            "taking its slabs as idle", self._name(peer), self.timeout)
            self._evict_phase(now)
            return
        for peer in set(rnd.waiting.values()):
            self._device_gone(peer, f"did not answer EVICT within {self.timeout:.3g} s: taking "
                                    "it as gone", slow=True)
        self._round = None

    def _give_back_all(self, poller: zmq.Poller, sock: zmq.Socket) -> None:
        """Shutdown: EVICT every mapped slab and wait (bounded) for the DONEs."""
        with self._mu:
            self._closing = True
            now = time.monotonic()
            rnd = _Round(E=len(self._leases), phase="activity", deadline=now, started=now)
            rnd.activity = {k: 0.0 for k in self._leases}
            self._round = rnd
            self._evict_phase(now)
        deadline = time.monotonic() + min(self.timeout, 2.0)
        while self._round is not None and time.monotonic() < deadline:
            if dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000)).get(sock):
                self._drain(sock)
        with self._mu:
            if self._round is not None:
                for peer in set(self._round.waiting.values()):
                    self._device_gone(peer, "did not answer EVICT at shutdown")
                self._round = None

    # ---- observation ----

    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot: memory, slabs (free, mapped, per device), data served, evictions."""
        with self._mu:
            devices: dict[str, list[int]] = {}
            for lease in self._leases.values():
                devices.setdefault(self._name(lease.peer), []).append(lease.slab)
            served = self._server.stats() if self._server is not None else None
            free = self._free()
            return {
                "time": time.time(), "host": self.host_name,
                "address": self._address, "instance": self.instance, "pid": os.getpid(),
                "host_id": self.host_id, "data_address": self.data_address,
                "slab_size": self.slab_size, "headroom": self.headroom,
                "capacity": self.capacity, "total_memory": self.total_memory,
                "used_by_others": int(self._U or 0), "free_bytes": int(free),
                "giveable_bytes": self._giveable(),
                "allocated_bytes": (self._held() - self._allocating + len(self._to_free))
                * self.slab_size,
                "locked_bytes": len(self._locked) * self.slab_size,
                "slabs_free": len(self._free_list), "slabs_mapped": len(self._leases),
                "slabs_quarantined": self._draining(),
                "devices": {k: sorted(v) for k, v in sorted(devices.items())},
                "maps": self.maps, "evictions": self.evictions, "evict_rounds": self.evict_rounds,
                "devices_lost": self.devices_lost, "requests": self.requests,
                "bad_messages": self.bad_messages,
                **self._auth_stats(served),
                "control": self._control_stats(),
                "evict_time_s": self._evict_times.summary(),
                "served": self._served(served),
                "eviction_in_progress": self._round is not None,
                "rdma": None if self._lending is None else {
                    "slabs_registered": self._lending.registered,
                    "devices_connected": self._lending.connected},
            }


    def _auth_stats(self, served: Any) -> dict[str, Any]:
        """Peers refused for not proving the cluster key: in total and per path."""
        data = 0 if served is None else served.auth_refusals
        curve = sum(refusal_counts(since=self._curve_refusals_before).values())
        return {"auth_refusals": data + self._auth.refusals + curve,
                "auth": {"data_refusals": data,
                         "data_timeouts": 0 if served is None else served.auth_timeouts,
                         "data_proven": 0 if served is None else served.auth_successes,
                         "control_refusals": self._auth.refusals, "curve_refusals": curve}}

    def _log_data_refusals(self) -> None:
        """Say in the log when the data server refused connections since the last time, and
        (at most once per ``_LOG_EVERY``) when it hit its connection cap or paused accepting."""
        if self._server is None:
            return
        st = self._server.stats()
        refused = st.auth_refusals
        if refused > self._data_refusals_logged:
            log.warning("daemon: the data server refused %d connection(s) that did not prove the "
                        "cluster key (last: %s)", refused - self._data_refusals_logged,
                        self._server.last_refusal())
            self._data_refusals_logged = refused
        self._log_rarely("data_cap", st.capacity_closes,
                         "daemon: the data server closed %d unproven connection(s) so far to make "
                         "room (at its cap of %d connections, or out of descriptors)",
                         st.max_connections)
        self._log_rarely("data_pause", st.accept_pauses,
                         "daemon: the data server paused accepting %d time(s) so far (last: %s); "
                         "raise the open-file limit (ulimit -n) or lower --data-max-connections",
                         os.strerror(st.accept_errno) if st.accept_errno else "?")

    def _log_rarely(self, what: str, count: int, fmt: str, *args: Any,
                    level: int = logging.WARNING) -> None:
        """Log ``fmt % (count, *args)`` when ``count`` grew, at most once per ``_LOG_EVERY``."""
        now = time.monotonic()
        when, logged = self._logged.get(what, (-_LOG_EVERY, 0))
        if count > logged and now - when >= _LOG_EVERY:
            log.log(level, fmt, count, *args)
            self._logged[what] = (now, count)

    def _expire_peers(self) -> None:
        """Forget control peers unseen for ``peer_ttl``; say (rarely) what was dropped."""
        self._peers.expire()
        peers = self._peers
        self._log_rarely("peers", peers.dropped + peers.refused,
                         "daemon: %d control peer record(s) dropped so far to stay within "
                         "%d identities (a flood of routing ids?)", peers.max_peers)
        self._log_rarely("rate", peers.limited,
                         "daemon: %d message(s) dropped so far from peers that have not proved "
                         "the cluster key and sent more than %g per second", peers.rate)

    def _control_stats(self) -> dict[str, Any]:
        """What the control socket keeps and dropped (``infiniswap.limits``)."""
        peers = self._peers
        return {"peers": len(peers), "max_peers": peers.max_peers,
                "peers_dropped": peers.dropped, "peers_expired": peers.expired,
                "peers_refused": peers.refused, "rate_limited": peers.limited,
                "replies_dropped": self._replies_dropped}


def _memlock_limit() -> str:
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
    except (ImportError, OSError, ValueError):  # pragma: no cover
        return "unknown"
