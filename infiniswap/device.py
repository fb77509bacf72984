"""``infiniswap.Device``: a block device that pages into remote memory (thesis §2.4).

Owns the user-facing object: a ``CoreDevice`` (the C core: slab table, page bitmap, I/O
router between remote memory and the local backup file, all page I/O without the GIL) and
its ``Controller`` (``devicectl.py``: the control thread that maps hot slabs, answers
evictions and survives daemon failures).  ``read``/``write`` go straight to the core from
the caller's thread, so any number of threads can do I/O at once; the control plane only
decides where each slab lives.

    with Device(4 << 30, backup="/var/tmp/swap.img", daemons=["tcp://mem1:7300"]) as dev:
        dev.write(0, page)            # page-aligned offsets and lengths (4 KiB pages)
        data = dev.read(0, 4096)

Every page written reads back the same, whatever happens to the remote memory: a write to
a mapped slab goes to remote memory synchronously and to the backup file in the background;
everything else goes to the backup file.
"""
from __future__ import annotations

import logging
import os
import random
import socket
import uuid
from typing import Any, Iterable, Sequence

from dlrt.endpoints import endpoint
from infiniswap.core import PAGE_SIZE, CoreDevice
from infiniswap.devicectl import TRANSPORTS, Controller

__all__ = ["Device", "PAGE_SIZE"]

log = logging.getLogger("infiniswap.device")

GiB = 1 << 30


def _default_device_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Device:
    """A device of ``size`` bytes backed by the file ``backup`` (created, ``size`` bytes) and
    the memory of ``daemons`` (control endpoints, e.g. ``tcp://host:7300``).

    ``slab_size``: power of two >= 1 MiB, the same as the daemons'.  ``hot_slab``: page I/Os
    per second above which a slab is mapped (thesis: 20).  ``alpha``/``period``: EWMA factor
    and control period (s).  ``transport``: ``"auto"`` (shared memory with daemons on this
    host, TCP otherwise), ``"shm"``, ``"tcp"`` or ``"rdma"`` (one-sided READ/WRITE of the
    daemons' slabs through ``rdma``, an ``infiniswap.rdma.RdmaDevice``; by default the first
    RDMA device, opened here: none fails at once; docs/rdma.md).  ``timeout``: how long to
    wait for a daemon's answer before taking it as failed.  ``status_bind``: an endpoint where ``infiniswap
    status`` can ask this device for its state.  The constructor waits for the first contact
    with the daemons (at most ``timeout``); unreachable ones are logged and retried.
    ``cluster_key``: the key this device proves to daemons and requires them to prove
    (default: the key directory's, ``dlrt.keys.ensure_cluster_secret``); ``security``: the
    ``dlrt.curve.Security`` of its control sockets (default ``default_security()``).
    """

    def __init__(self, size: int, backup: str | os.PathLike[str], daemons: Iterable[str] = (),
                 *, slab_size: int = GiB, hot_slab: float = 20.0, alpha: float = 0.2,
                 period: float = 1.0, transport: str = "auto", timeout: float = 2.0,
                 rng: random.Random | None = None, writer_threads: int = 4,
                 device_id: str | None = None, status_bind: str | None = None,
                 tcp_connections: int = 4, pending_cap: int = 0, rdma: Any = None,
                 cluster_key: bytes | None = None, security: Any = None) -> None:
        if isinstance(daemons, (str, bytes)):
            raise TypeError("daemons must be a list of addresses, e.g. ['tcp://127.0.0.1:7300']")
        daemons = list(daemons)
        for a in daemons:
            if not isinstance(a, str):
                raise TypeError(f"daemon address {a!r} must be a string")
            endpoint(a)                         # ValueError naming a bad address
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r} must be one of {', '.join(TRANSPORTS)}")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"device size {size!r} must be a positive number of bytes")
        if not isinstance(slab_size, int) or slab_size < (1 << 20) or slab_size & (slab_size - 1):
            raise ValueError(f"slab size {slab_size!r} must be a power of two of at least 1 MiB")
        if size % slab_size:
            raise ValueError(f"device size {size} must be a multiple of the slab size {slab_size}")
        for name, v in (("period", period), ("timeout", timeout)):
            if not v > 0:
                raise ValueError(f"{name} {v!r} must be positive (seconds)")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha {alpha!r} must be in (0, 1]")
        if not hot_slab >= 0:
            raise ValueError(f"hot_slab {hot_slab!r} must be >= 0 page I/Os per second")
        self._core = CoreDevice(size, slab_size, backup, writer_threads, pending_cap)
        try:
            self._ctl = Controller(self._core, daemons, device_id=device_id or _default_device_id(),
                                   hot_slab=hot_slab, alpha=alpha, period=period, timeout=timeout,
                                   transport=transport, rng=rng or random.Random(),
                                   status_bind=status_bind, tcp_connections=tcp_connections,
                                   rdma=rdma, cluster_key=cluster_key, security=security)
            self._ctl.start()
        except BaseException:
            self._core.close()
            raise
        self._closed = False

    # ---- page I/O (from any thread) ----

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (both multiples of 4096, inside the device)."""
        return self._core.read(offset, length)

    def read_into(self, offset: int, buf: Any) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into a writable buffer (no allocation)."""
        self._core.read_into(offset, buf)

    def write(self, offset: int, data: Any) -> None:
        """Write ``data`` (bytes-like, a multiple of 4096 bytes) at ``offset``."""
        self._core.write(offset, data)

    def flush(self) -> None:
        """Wait until every write is in the backup file, and fdatasync it."""
        self._core.flush()

    # ---- facts ----

    @property
    def size(self) -> int:
        return self._core.size

    @property
    def slab_size(self) -> int:
        return self._core.slab_size

    @property
    def num_slabs(self) -> int:
        return self._core.num_slabs

    @property
    def device_id(self) -> str:
        return self._ctl.device_id

    @property
    def status_address(self) -> str | None:
        """Where ``infiniswap status --devices`` reaches this device (None: no endpoint)."""
        return self._ctl.status_address

    @property
    def core(self) -> CoreDevice:
        """Advanced: the C core (slab_info, set_debug_writer_delay, ...).  Do not map or evict
        through it while the device runs: the control thread owns the mapping."""
        return self._core

    def stats(self) -> dict[str, Any]:
        """Slabs (state, daemon, activity), daemons (reachable, transport, slabs), the core's
        I/O counters (bytes remote / disk), and map / eviction counts and timings."""
        if self._closed:
            raise ValueError("device is closed")
        return self._ctl.report()

    def map_times(self) -> list[float]:
        """Recent times (s) from starting placement of a slab to its mapping."""
        return self._ctl.map_times()

    def evict_times(self) -> list[float]:
        """Recent times (s) to unmap one slab (mark, clear bits, drain in-flight I/O)."""
        return self._ctl.evict_times()

    # ---- advanced: deterministic control (benchmarks, tests) ----

    def map_now(self, slabs: Sequence[int] | None = None, timeout: float | None = None) -> int:
        """Map the given slabs (default: all unmapped ones) now, hot or not, with the usual
        placement; returns how many were mapped.  Stops early when no daemon has room."""
        todo = None if slabs is None else [self._slab(s) for s in slabs]
        return self._ctl.call(lambda: self._ctl.map_slabs(todo), timeout)

    def evict_now(self, slabs: Sequence[int] | None = None, timeout: float | None = None) -> int:
        """Unmap the given mapped slabs (default: all) as an eviction would, and give them back
        to their daemons (UNMAP); returns how many were unmapped.  Hot ones are remapped later."""
        todo = None if slabs is None else [self._slab(s) for s in slabs]
        return self._ctl.call(lambda: self._ctl.unmap_slabs(todo), timeout)

    def _slab(self, s: int) -> int:
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < self.num_slabs:
            raise ValueError(f"slab {s!r} is out of range: the device has {self.num_slabs} slabs")
        return s

    # ---- lifecycle ----

    def close(self) -> None:
        """Give the slabs back to their daemons, flush, close.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ctl.stop()
        finally:
            self._core.close()

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._ctl._where)} slabs mapped"
        return f"<infiniswap.Device {self.device_id} {self.size >> 20} MiB, {state}>"
