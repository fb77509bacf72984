"""Typed Python wrappers over the Infiniswap C core (``infiniswap._core``, sources in
``csrc/infiniswap``).

Three objects, no policy and no threads of their own:

* :class:`CoreDevice` — the block device: slab table, page bitmap, I/O router between remote
  memory and the local backup file, mapping control for the control loop (thesis §2.4).
* :class:`SlabStore` — a daemon's slab memory (one memfd; slabs allocated lazily, optionally
  mlocked, freed by hole punching) and its fence: a generation per slab that every device
  access must name, so a slab taken back from a device is never touched by it again
  (thesis §2.5; docs/infiniswap.md, "Fencing").
* :class:`DataServer` — the daemon's TCP data server for devices on other hosts; it serves
  only connections that prove the cluster key (``csrc/infiniswap/isw_auth.h``), and a device
  opening a TCP remote proves it and checks the server's proof the same way.  Both take the
  key through their constructor / call (default: ``dlrt.keys.ensure_cluster_secret()``).
* :class:`FuseServer` — the device as the file ``disk`` of a FUSE mount (libfuse3, C
  threads; no Python on its I/O path), for ``losetup`` / ``mkswap`` / ``swapon``.

Every C call releases the GIL, so several Python threads can do I/O at once.  C errors come
back as ``ValueError`` (a bad argument: unaligned, out of range, wrong size) or ``OSError``
with the errno and the core's message; calls on a closed object raise ``ValueError``.
"""
from __future__ import annotations

import enum
import errno as _errno
import os
from dataclasses import dataclass
from typing import Any

from dlrt import tcpopts
from dlrt.keys import ensure_cluster_secret
from infiniswap._core import ffi, lib

__all__ = [
    "PAGE_SIZE",
    "SlabState",
    "SlabInfo",
    "DeviceStats",
    "ServerStats",
    "CoreDevice",
    "SlabStore",
    "DataServer",
    "FuseServer",
    "FuseStats",
    "auth_proof",
    "RTO_MIN_ENV",
    "rto_min_us_from_env",
]

PAGE_SIZE: int = int(lib.ISW_PAGE_SIZE)
DEFAULT_PENDING_CAP: int = int(lib.ISW_DEFAULT_PENDING_CAP)
_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
# Errors a caller causes with a bad argument (EINVAL, ERANGE) or by using a closed object
# (EBADF, e.g. another thread closed the device): reported as ValueError.
_VALUE_ERRNOS = (_errno.EINVAL, _errno.ERANGE, _errno.EBADF)
# the retransmission-timeout floor of the device's and the data servers' TCP connections
# (dlrt/tcpopts.py): microseconds, 0 the kernel's 200 ms
RTO_MIN_ENV = "INFINISWAP_TCP_RTO_MIN_US"


def rto_min_us_from_env(strict: bool = True) -> int:
    """``$INFINISWAP_TCP_RTO_MIN_US`` (0..200000), else ``dlrt.tcpopts.RTO_MIN_US`` (10 ms)."""
    return tcpopts.rto_min_us_from_env(RTO_MIN_ENV, strict)


def _rto_min(us: int | None) -> int:
    """The floor a TCP connection asks for: ``us``, else the environment's."""
    return rto_min_us_from_env() if us is None else _uint(us, "rto_min_us", tcpopts.KERNEL_RTO_MIN_US)


class SlabState(enum.IntEnum):
    """A slab's state in the device's slab table (the C core's ISW_SLAB_* values)."""
    UNMAPPED = int(lib.ISW_SLAB_UNMAPPED)
    MAPPING = int(lib.ISW_SLAB_MAPPING)
    MAPPED = int(lib.ISW_SLAB_MAPPED)
    EVICTING = int(lib.ISW_SLAB_EVICTING)


@dataclass(frozen=True)
class SlabInfo:
    state: SlabState
    remote_id: int | None          # None when unmapped
    region_offset: int
    generation: int                # of the daemon's lease (0 when unmapped)
    bits_set: int                  # pages valid in remote memory
    in_flight: int
    failed: bool                   # a remote I/O of this slab failed since it was mapped
    pending_disk_writes: int
    bytes_read_remote: int
    bytes_written_remote: int
    bytes_read_disk: int
    bytes_written_disk: int


@dataclass(frozen=True)
class DeviceStats:
    pages_read_remote: int
    bytes_read_remote: int
    pages_read_disk: int
    bytes_read_disk: int
    pages_written_remote: int
    bytes_written_remote: int
    pages_written_disk_async: int
    bytes_written_disk_async: int
    pages_written_disk_sync: int
    bytes_written_disk_sync: int
    remote_errors: int
    disk_errors: int
    pending_disk_bytes: int
    pending_disk_writes: int
    slabs_mapped: int


@dataclass(frozen=True)
class ServerStats:
    connections: int
    active_connections: int
    requests: int
    read_requests: int
    write_requests: int
    bytes_read: int
    bytes_written: int
    errors: int
    auth_successes: int         # connections that proved the cluster key
    auth_refusals: int          # connections closed before proving it (every reason)
    auth_timeouts: int          # of which: silent past the handshake deadline
    rto_min_us: int             # retransmission-timeout floor of the last connection accepted; 0: the kernel's
    capacity_closes: int        # unproven connections closed to make room / refused at the cap
    accept_pauses: int          # times accepting paused for want of descriptors or memory
    accept_errno: int           # errno of the last such accept failure (0: none)
    max_connections: int        # the connection cap in effect


@dataclass(frozen=True)
class FuseStats:
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int
    unaligned: int              # requests not on 4 KiB pages (widened / read-modify-write)
    flushes: int
    errors: int
    conn_id: int                # the kernel's FUSE connection (name under fusectl)


def _message() -> str:
    return ffi.string(lib.isw_last_error()).decode("utf-8", "replace")


def _check(rc: int, what: str) -> int:
    """Return rc if >= 0, else raise the error the C core reported (same thread)."""
    if rc >= 0:
        return rc
    err = -rc
    msg = _message() or os.strerror(err)
    if not msg.startswith(what + ":"):
        msg = f"{what}: {msg}"
    if err in _VALUE_ERRNOS:
        raise ValueError(msg)
    raise OSError(err, msg)


def _uint(value: Any, name: str, limit: int = _U64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0 or value > limit:
        raise ValueError(f"{name} must be in 0..{limit}, got {value}")
    return value


def _cluster_key(key: bytes | None) -> bytes:
    """``key``, else the cluster key of the key directory; checked for its length."""
    key = ensure_cluster_secret() if key is None else key
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"the cluster key must be bytes, got {type(key).__name__}")
    if not int(lib.ISW_AUTH_KEY_MIN) <= len(key) <= int(lib.ISW_AUTH_KEY_MAX):
        raise ValueError(f"the cluster key must be {int(lib.ISW_AUTH_KEY_MIN)}.."
                         f"{int(lib.ISW_AUTH_KEY_MAX)} bytes, got {len(key)}")
    return bytes(key)


def auth_proof(key: bytes, nonce: bytes, role: str, context: bytes | None = None) -> bytes:
    """The C core's proof (``isw_auth_proof``): ``dlrt.proof.proof(key, nonce, role[,
    context])`` computed by OpenSSL; tests compare the two."""
    out = ffi.new("unsigned char[]", int(lib.ISW_AUTH_PROOF_SIZE))
    ctx = ffi.NULL if context is None else ffi.from_buffer(context)
    _check(lib.isw_auth_proof(key, len(key), nonce, len(nonce), role.encode(), ctx,
                              0 if context is None else len(context), out), "auth_proof")
    return bytes(ffi.buffer(out))


def _fields(cdata: Any, names: tuple[str, ...]) -> dict[str, int]:
    return {n: int(getattr(cdata, n)) for n in names}


class _Handle:
    """Owns one C object: ``_ptr`` is freed by its destructor once unreachable; ``close()``
    is explicit and idempotent."""

    _kind = "object"
    _ptr: Any

    def _p(self) -> Any:
        p = self._ptr
        if p is None:
            raise ValueError(f"{self._kind} is closed")
        return p

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class CoreDevice(_Handle):
    """An Infiniswap block device of ``size`` bytes in slabs of ``slab_size`` bytes.

    ``size`` must be a multiple of ``slab_size``, a power of two >= 1 MiB.  The backup file
    at ``backup_path`` is created (truncated) to ``size`` bytes.  ``writer_threads`` disk
    writer threads (slab s uses thread s % writer_threads, so one slab's disk writes are
    FIFO); ``pending_cap`` bounds the bytes of queued asynchronous disk writes (0: 64 MiB).
    """

    _kind = "device"

    def __init__(self, size: int, slab_size: int, backup_path: str | os.PathLike[str],
                 writer_threads: int = 4, pending_cap: int = 0) -> None:
        self._ptr = None
        _uint(size, "size")
        _uint(slab_size, "slab_size")
        _uint(writer_threads, "writer_threads", 1 << 16)
        _uint(pending_cap, "pending_cap")
        out = ffi.new("struct isw_device **")
        path = os.fsencode(backup_path)
        _check(lib.isw_device_open(size, slab_size, path, writer_threads, pending_cap, out),
               "CoreDevice")
        self._ptr = ffi.gc(out[0], lib.isw_device_free)
        self.size: int = int(lib.isw_device_size(self._ptr))
        self.slab_size: int = int(lib.isw_device_slab_size(self._ptr))
        self.num_slabs: int = int(lib.isw_device_num_slabs(self._ptr))
        self.backup_path: str = os.fsdecode(path)

    # ---- page I/O (offset and length multiples of PAGE_SIZE) ----

    def write(self, offset: int, data: Any) -> None:
        """Write ``data`` (any bytes-like object) at ``offset``; returns when every piece is
        in remote memory or on disk (a remote write's disk copy completes in background)."""
        p = self._p()
        _uint(offset, "offset")
        buf = ffi.from_buffer(data)
        _check(lib.isw_device_write(p, offset, buf, len(buf)), "write")

    def read_into(self, offset: int, buf: Any) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into a writable bytes-like object."""
        p = self._p()
        _uint(offset, "offset")
        cbuf = ffi.from_buffer(buf, require_writable=True)
        _check(lib.isw_device_read(p, offset, cbuf, len(cbuf)), "read")

    def read(self, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``."""
        _uint(length, "length")
        buf = bytearray(length)
        self.read_into(offset, buf)
        return bytes(buf)

    def flush(self) -> None:
        """Wait for every queued disk write, then fdatasync the backup file.  Raises OSError if
        any background disk write failed."""
        _check(lib.isw_device_flush(self._p()), "flush")

    # ---- remotes ----

    def add_remote_shm(self, path: str | os.PathLike[str], size: int = 0) -> int:
        """Map a daemon's slab memory (its memfd, e.g. ``/proc/<pid>/fd/<fd>``) of ``size``
        bytes (0: the whole file); returns the remote id."""
        _uint(size, "size")
        return _check(lib.isw_device_add_remote_shm(self._p(), os.fsencode(path), size),
                      "add_remote_shm")

    def add_remote_tcp(self, host: str, port: int, connections: int = 4,
                       timeout: float = 2.0, key: bytes | None = None,
                       rto_min_us: int | None = None) -> int:
        """Connect ``connections`` TCP connections to a daemon's data server; ``timeout``
        (seconds) bounds every connect/send/receive.  Each connection proves the cluster
        ``key`` (default: the key directory's) and checks the server's proof of it:
        OSError(EACCES) when either side does not hold it.  ``rto_min_us``: the connections'
        retransmission-timeout floor (default ``$INFINISWAP_TCP_RTO_MIN_US``, else 10 ms; 0:
        the kernel's 200 ms; :meth:`remote_rto_min_us` says what they took).  Returns the
        remote id."""
        key = _cluster_key(key)
        rto_min_us = _rto_min(rto_min_us)
        _uint(port, "port", 65535)
        _uint(connections, "connections", 256)
        timeout_ms = int(round(timeout * 1000))
        if timeout_ms < 1 or timeout_ms > 3_600_000:
            raise ValueError(f"timeout must be in 0.001..3600 s, got {timeout}")
        return _check(lib.isw_device_add_remote_tcp(self._p(), host.encode(), port, connections,
                                                    timeout_ms, rto_min_us, key, len(key)),
                      "add_remote_tcp")

    def add_remote_rdma(self, queue_pair: Any, nslots: int) -> int:
        """An RDMA remote of ``nslots`` slabs over a connected ``infiniswap.rdma.QueuePair``,
        which it takes over (destroyed with the remote, or at once on failure).  Each slab
        is reached once :meth:`set_rdma_slab` said where.  Returns the remote id."""
        _uint(nslots, "nslots")
        return _check(lib.isw_device_add_remote_rdma(self._p(), queue_pair.release(), nslots),
                      "add_remote_rdma")

    def set_rdma_slab(self, remote_id: int, region_offset: int, generation: int, addr: int,
                      rkey: int) -> None:
        """Before :meth:`map_slab` on an RDMA remote: the daemon's MR_INFO for the slab at
        ``region_offset`` (lease ``generation``, registered at ``addr`` with ``rkey``)."""
        _check(lib.isw_device_set_rdma_slab(self._p(), remote_id,
                                            _uint(region_offset, "region_offset"),
                                            _uint(generation, "generation"), _uint(addr, "addr"),
                                            _uint(rkey, "rkey", _U32_MAX)), "set_rdma_slab")

    def remove_remote(self, remote_id: int) -> None:
        """Unmap every slab on the remote (draining in-flight I/O) and drop it."""
        _check(lib.isw_device_remove_remote(self._p(), remote_id), "remove_remote")

    def mark_remote_dead(self, remote_id: int) -> None:
        """Stop using the remote at once (e.g. the control plane lost its daemon)."""
        _check(lib.isw_device_mark_remote_dead(self._p(), remote_id), "mark_remote_dead")

    def remote_dead(self, remote_id: int) -> bool:
        return bool(_check(lib.isw_device_remote_dead(self._p(), remote_id), "remote_dead"))

    def remote_rto_min_us(self, remote_id: int) -> int:
        """The retransmission-timeout floor (us) a TCP remote's connections took: the one
        asked for rounded up to the kernel's clock ticks; 0 where it is the kernel's (asked
        for 0, a kernel before 6.15, or not a TCP remote)."""
        return _check(lib.isw_device_remote_rto_min_us(self._p(), remote_id), "remote_rto_min_us")

    def remote_bytes(self, remote_id: int) -> tuple[int, int]:
        """``(bytes read, bytes written)`` by page I/O that succeeded through the remote."""
        out = ffi.new("uint64_t[2]")
        _check(lib.isw_device_remote_bytes(self._p(), remote_id, out, out + 1), "remote_bytes")
        return int(out[0]), int(out[1])

    def remote_error(self, remote_id: int) -> str:
        """The last error message of the remote ('' if none)."""
        out = ffi.new("char[]", 256)
        _check(lib.isw_device_remote_error(self._p(), remote_id, out, 256), "remote_error")
        return ffi.string(out).decode("utf-8", "replace")

    # ---- mapping control ----

    def begin_map(self, slab: int) -> None:
        """UNMAPPED → MAPPING (placement in progress; I/O still goes to disk)."""
        _check(lib.isw_device_begin_map(self._p(), _uint(slab, "slab", _U32_MAX)), "begin_map")

    def abort_map(self, slab: int) -> None:
        """MAPPING → UNMAPPED."""
        _check(lib.isw_device_abort_map(self._p(), _uint(slab, "slab", _U32_MAX)), "abort_map")

    def map_slab(self, slab: int, remote_id: int, region_offset: int, generation: int) -> None:
        """Map the slab (UNMAPPED or MAPPING) to ``region_offset`` of the remote, leased at
        ``generation`` (the daemon's :meth:`SlabStore.generation` of that region): MAPPED with
        every page bit clear.  Every remote access names the generation; one the daemon's
        fence refuses (the slab was taken back) fails the slab over to the backup file.
        OSError(EBUSY) if the slab is mapped or evicting."""
        _check(lib.isw_device_map_slab(self._p(), _uint(slab, "slab", _U32_MAX), remote_id,
                                       _uint(region_offset, "region_offset"),
                                       _uint(generation, "generation")),
               "map_slab")

    def begin_evict(self, slab: int) -> bool:
        """EVICTING (new I/O goes to disk), wait for in-flight remote I/O, clear the bits,
        UNMAPPED.  When it returns the daemon may release the region (DONE).  Returns whether
        the slab was mapped."""
        return bool(_check(lib.isw_device_begin_evict(self._p(), _uint(slab, "slab", _U32_MAX)),
                           "begin_evict"))

    def unmap_remote(self, remote_id: int) -> int:
        """begin_evict every slab on the remote (its daemon died); returns how many."""
        return _check(lib.isw_device_unmap_remote(self._p(), remote_id), "unmap_remote")

    # ---- observation ----

    def sample_activity(self) -> list[int]:
        """Page I/Os per slab since the last sample (the counters restart at zero)."""
        out = ffi.new("uint64_t[]", self.num_slabs)
        n = _check(lib.isw_device_sample_activity(self._p(), out, self.num_slabs),
                   "sample_activity")
        return [int(out[i]) for i in range(n)]

    def failed_slabs(self) -> list[int]:
        """Slabs not yet unmapped whose remote I/O failed or whose remote is dead."""
        out = ffi.new("uint32_t[]", self.num_slabs)
        n = _check(lib.isw_device_failed_slabs(self._p(), out, self.num_slabs), "failed_slabs")
        return [int(out[i]) for i in range(n)]

    def slab_info(self, slab: int) -> SlabInfo:
        info = ffi.new("struct isw_slab_info *")
        _check(lib.isw_device_slab_info(self._p(), _uint(slab, "slab", _U32_MAX), info),
               "slab_info")
        return SlabInfo(
            state=SlabState(info.state),
            remote_id=None if info.remote_id < 0 else int(info.remote_id),
            region_offset=int(info.region_offset),
            generation=int(info.generation),
            bits_set=int(info.bits_set),
            in_flight=int(info.in_flight),
            failed=bool(info.failed),
            pending_disk_writes=int(info.pending_disk_writes),
            bytes_read_remote=int(info.bytes_read_remote),
            bytes_written_remote=int(info.bytes_written_remote),
            bytes_read_disk=int(info.bytes_read_disk),
            bytes_written_disk=int(info.bytes_written_disk),
        )

    def stats(self) -> DeviceStats:
        st = ffi.new("struct isw_device_stats *")
        _check(lib.isw_device_stats(self._p(), st), "stats")
        return DeviceStats(**_fields(st, tuple(DeviceStats.__dataclass_fields__)))

    def set_debug_writer_delay(self, microseconds: int) -> None:
        """Test hook: delay every background disk write by ``microseconds``."""
        _check(lib.isw_device_set_debug_writer_delay(
            self._p(), _uint(microseconds, "microseconds", _U32_MAX)), "set_debug_writer_delay")

    def close(self) -> None:
        """Flush, stop the writer threads, drop the remotes.  Waits for calls in progress in
        other threads; later calls raise ValueError.  Raises OSError if the final flush
        failed."""
        p = self._ptr
        if p is None:
            return
        rc = lib.isw_device_close(p)
        self._ptr = None
        _check(rc, "close")


class SlabStore(_Handle):
    """A daemon's slab memory: one memfd of ``capacity_bytes`` (sparse until slabs are
    allocated) in slabs of ``slab_size`` (power of two >= 1 MiB).  ``lock``: default for
    :meth:`alloc_slab` — mlock each slab so it can never be swapped (into a device)."""

    _kind = "slab store"

    def __init__(self, capacity_bytes: int, slab_size: int, lock: bool = True) -> None:
        self._ptr = None
        _uint(capacity_bytes, "capacity_bytes")
        _uint(slab_size, "slab_size")
        out = ffi.new("struct isw_store **")
        _check(lib.isw_store_open(capacity_bytes, slab_size, out), "SlabStore")
        self._ptr = ffi.gc(out[0], lib.isw_store_free)
        self.capacity: int = capacity_bytes
        self.slab_size: int = slab_size
        self.lock: bool = bool(lock)

    def fd(self) -> int:
        return _check(lib.isw_store_fd(self._p()), "fd")

    def path(self) -> str:
        """Where a device on this host opens the memory: ``/proc/<pid>/fd/<fd>``."""
        return f"/proc/{os.getpid()}/fd/{self.fd()}"

    def alloc_slab(self, lock: bool | None = None) -> int:
        """Allocate one slab; returns its region offset.  With ``lock`` (default: the store's)
        the slab is mlocked; if that fails (RLIMIT_MEMLOCK) the slab is released again and
        OSError (ENOMEM/EPERM) is raised — retry with ``lock=False`` to go on unlocked.
        OSError(ENOSPC) when every slab is allocated."""
        lock = self.lock if lock is None else bool(lock)
        out = ffi.new("uint64_t *")
        _check(lib.isw_store_alloc_slab(self._p(), int(lock), out), "alloc_slab")
        return int(out[0])

    def free_slab(self, region_offset: int) -> None:
        """Revoke the slab, then munlock it and punch it out of the memfd: the memory returns to
        the OS.  OSError(EBUSY) if a device access did not finish within a moment (the slab
        stays allocated and revoked; try again once :meth:`drained`)."""
        _check(lib.isw_store_free_slab(self._p(), _uint(region_offset, "region_offset")),
               "free_slab")

    def slab_address(self, region_offset: int) -> int:
        """Where this allocated slab lies in this process (what the daemon registers with
        an RDMA device when it lends the slab)."""
        out = ffi.new("uint64_t *")
        _check(lib.isw_store_slab_address(self._p(), _uint(region_offset, "region_offset"),
                                          out), "slab_address")
        return int(out[0])

    def generation(self, region_offset: int) -> int:
        """The generation a lease of this allocated slab gets (the device's ``map_slab``)."""
        out = ffi.new("uint64_t *")
        _check(lib.isw_store_slab_generation(self._p(), _uint(region_offset, "region_offset"),
                                             out), "generation")
        return int(out[0])

    def revoke(self, region_offset: int) -> bool:
        """Take the slab back from whoever holds a lease of it: no access with an older
        generation starts any more.  True when none is in progress either, so the slab may be
        lent again or freed; False while one is still copying (poll :meth:`drained`)."""
        return bool(_check(lib.isw_store_revoke_slab(self._p(),
                                                     _uint(region_offset, "region_offset")),
                           "revoke"))

    def drained(self, region_offset: int) -> bool:
        """True when no device access to the slab is in progress."""
        return bool(_check(lib.isw_store_slab_drained(self._p(),
                                                      _uint(region_offset, "region_offset")),
                           "drained"))

    def reset_users(self, region_offset: int) -> None:
        """Forget the slab's count of accesses in progress.  Only for a count left by processes
        that died inside an access: the caller knows no live process can access the slab."""
        _check(lib.isw_store_reset_slab_users(self._p(), _uint(region_offset, "region_offset")),
               "reset_users")

    def allocated_bytes(self) -> int:
        return int(lib.isw_store_allocated_bytes(self._p()))

    def locked_bytes(self) -> int:
        return int(lib.isw_store_locked_bytes(self._p()))

    def resident_bytes(self) -> int:
        """Memory the memfd really holds (st_blocks)."""
        out = ffi.new("uint64_t *")
        _check(lib.isw_store_resident_bytes(self._p(), out), "resident_bytes")
        return int(out[0])

    def read(self, region_offset: int, length: int) -> bytes:
        """Copy out of one allocated slab (diagnostics, tests)."""
        _uint(length, "length")
        buf = bytearray(length)
        _check(lib.isw_store_read(self._p(), _uint(region_offset, "region_offset"),
                                  ffi.from_buffer(buf), length), "read")
        return bytes(buf)

    def write(self, region_offset: int, data: Any) -> None:
        """Copy into one allocated slab (diagnostics, tests)."""
        cbuf = ffi.from_buffer(data)
        _check(lib.isw_store_write(self._p(), _uint(region_offset, "region_offset"), cbuf,
                                   len(cbuf)), "write")

    def debug_hold_allocations(self, n: int) -> None:
        """Test hook: the next ``n`` :meth:`alloc_slab` calls wait after reserving their slot
        and before allocating memory, with the store's mutex released; ``n = 0`` lets every
        waiting one go on."""
        _check(lib.isw_store_debug_hold_allocations(self._p(), _uint(n, "n", 1 << 30)),
               "debug_hold_allocations")

    def debug_allocations_held(self) -> int:
        """How many :meth:`alloc_slab` calls wait in that test hook now."""
        return int(lib.isw_store_debug_allocations_held(self._p()))

    def close(self) -> None:
        """Unmap and close the memfd (devices that mapped it keep their mapping).
        OSError(EBUSY) while a DataServer on it runs."""
        p = self._ptr
        if p is None:
            return
        _check(lib.isw_store_close(p), "close")
        self._ptr = None


class DataServer(_Handle):
    """TCP data server of a daemon: serves READ/WRITE of ``store``'s allocated slabs to
    connections that proved the cluster ``key`` (default: the key directory's) within
    ``handshake_timeout`` seconds; the others are closed and counted (``stats()``).
    ``max_connections``: the most connections held at once (default
    ``infiniswap.limits.default_max_connections()``: half the open-file limit, 16..4096); at
    the cap the oldest one that has not proved the key makes room, proven ones are kept.
    ``port=0`` lets the OS pick; see :meth:`port`. ``rto_min_us``: the retransmission-timeout
    floor every accepted connection asks for (default ``$INFINISWAP_TCP_RTO_MIN_US``, else
    10 ms; 0: the kernel's 200 ms), so a reply that loses its tail is sent again after about a
    round trip."""

    _kind = "data server"

    def __init__(self, store: SlabStore, host: str = "127.0.0.1", port: int = 0, *,
                 key: bytes | None = None, handshake_timeout: float = 2.0,
                 rto_min_us: int | None = None, max_connections: int | None = None) -> None:
        from infiniswap.limits import default_max_connections

        self._ptr = None
        _uint(port, "port", 65535)
        cap = default_max_connections() if max_connections is None else max_connections
        _uint(cap, "max_connections", int(lib.ISW_SERVER_MAX_CONNECTIONS))
        if cap < 1:
            raise ValueError("max_connections must be at least 1")
        key = _cluster_key(key)
        rto_min_us = _rto_min(rto_min_us)
        handshake_ms = int(round(handshake_timeout * 1000))
        if handshake_ms < 1 or handshake_ms > 3_600_000:
            raise ValueError(f"handshake_timeout must be in 0.001..3600 s, got {handshake_timeout}")
        out = ffi.new("struct isw_server **")
        _check(lib.isw_server_start(store._p(), host.encode(), port, key, len(key), handshake_ms,
                                    rto_min_us, cap, out), "DataServer")
        self._ptr = ffi.gc(out[0], lib.isw_server_free)
        self._store = store         # the C server uses the store: keep it alive
        self.host: str = host

    def port(self) -> int:
        return int(lib.isw_server_port(self._p()))

    def stats(self) -> ServerStats:
        st = ffi.new("struct isw_server_stats *")
        _check(lib.isw_server_get_stats(self._p(), st), "stats")
        return ServerStats(**_fields(st, tuple(ServerStats.__dataclass_fields__)))

    def last_refusal(self) -> str:
        """Why the last refused connection was refused ('' if none; never the key)."""
        out = ffi.new("char[]", 256)
        _check(lib.isw_server_last_refusal(self._p(), out, 256), "last_refusal")
        return ffi.string(out).decode("utf-8", "replace")

    def stop(self) -> None:
        """Close the listener and every connection and join the server's threads.
        Idempotent."""
        p = self._ptr
        if p is None:
            return
        lib.isw_server_stop(p)
        self._ptr = None

    close = stop


class FuseServer(_Handle):
    """Serve ``device`` (an open :class:`CoreDevice`) as the regular file ``disk`` (mode
    0600, the device's size) in a FUSE mount at ``mountpoint`` (an existing directory).

    C threads on libfuse3's low-level API do all I/O; any offset and length works
    (unaligned ones are widened / read-modify-written).  Files are opened with direct I/O,
    so ``losetup --direct-io=on`` on :attr:`path` gives a loop device without a page-cache
    copy.  The constructor returns once the mount answers.  :meth:`stop` detaches the
    mount, lets requests in flight finish for a few seconds while something (a loop
    device) still holds the file, then aborts the FUSE connection.  Keep ``device`` open
    until :meth:`stop` returned.  Mounting needs /dev/fuse (root, or fusermount3).
    """

    _kind = "FUSE server"

    def __init__(self, device: CoreDevice, mountpoint: str | os.PathLike[str],
                 fsname: str = "infiniswap") -> None:
        self._ptr = None
        if not isinstance(device, CoreDevice):
            raise TypeError(f"device must be a CoreDevice, got {type(device).__name__}")
        out = ffi.new("struct isw_fuse **")
        _check(lib.isw_fuse_start(device._p(), os.fsencode(mountpoint), fsname.encode(), out),
               "FuseServer")
        self._ptr = ffi.gc(out[0], lib.isw_fuse_free)
        self._device = device       # the C server uses the device: keep it alive
        self.mountpoint: str = os.fsdecode(ffi.string(lib.isw_fuse_mountpoint(self._ptr)))
        self.fsname: str = fsname

    @property
    def path(self) -> str:
        """The served file: ``<mountpoint>/disk``."""
        return os.path.join(self.mountpoint, "disk")

    def stats(self) -> FuseStats:
        st = ffi.new("struct isw_fuse_stats *")
        _check(lib.isw_fuse_stats(self._p(), st), "stats")
        return FuseStats(**_fields(st, tuple(FuseStats.__dataclass_fields__)))

    def last_io_error(self) -> str:
        """The message of the last request answered with an error ('' if none)."""
        out = ffi.new("char[]", 512)
        _check(lib.isw_fuse_last_io_error(self._p(), out, 512), "last_io_error")
        return ffi.string(out).decode("utf-8", "replace")

    def stop(self) -> None:
        """Unmount and join the threads.  Idempotent.  OSError(EBUSY) if the FUSE
        connection could not be aborted while something still held the file (call again
        to retry)."""
        p = self._ptr
        if p is None:
            return
        _check(lib.isw_fuse_stop(p), "stop")
        self._ptr = None
        self._device = None

    close = stop
