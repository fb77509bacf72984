"""Infiniswap over RDMA: the C core's verbs device (``csrc/infiniswap/isw_rdma.c``) from Python.

Owns the Python face of the core's RDMA pieces: opening a device (``RdmaDevice``;
``require_device`` answers at once whether this machine has one), the registration table
of the memory a daemon lends (register a slab when it is lent, look it up by address range,
deregister before it is taken back -- the rkey is the lease, see ``isw_rdma.h``), and RC
queue pairs (``QueuePair``: this side's address as a map, connected to the peer's), which a
device hands over to its RDMA remote (``CoreDevice.add_remote_rdma``).  The control loops
using them are ``infiniswap.rdmalend`` (the daemon's side) and ``infiniswap.devicectl``
(the device's); queue-pair addresses travel in RDMA_CONNECT / RDMA_ACCEPT
(``infiniswap.protocol``).

``RdmaDevice(fake=True)`` is a device on the core's fake fabric: keys from a counter,
nothing pinned, and a READ/WRITE is a memcpy within this process, checked as a NIC checks
it (a deregistered region's rkey fails with a remote access error) -- how the wiring is
tested without hardware.  Not run on hardware: this project's machines have no RDMA device.
"""
from __future__ import annotations

from typing import Any, Mapping

from infiniswap._core import ffi, lib
from infiniswap.protocol import QP_FIELDS

__all__ = ["RdmaUnavailable", "RdmaDevice", "QueuePair", "built", "device_count", "require_device",
           "check_transport"]


class RdmaUnavailable(RuntimeError):
    """This process cannot use RDMA here (no device, or a core built without libibverbs):
    a runtime error, exit status 1."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(message)
        self.errno = errno


def _message() -> str:
    return ffi.string(lib.isw_last_error()).decode("utf-8", "replace")


def _failure(rc: int) -> RdmaUnavailable:
    return RdmaUnavailable(-rc, _message())


def built() -> bool:
    """Whether the C core was built with libibverbs."""
    return bool(lib.isw_rdma_built())


def device_count() -> int:
    """RDMA devices ``ibv_get_device_list`` reports (0 when none, or not built)."""
    return int(lib.isw_rdma_device_count())


class RdmaDevice:
    """One opened device and the memory registered through it (``fake``: a device on the
    core's fake fabric, for tests). ``register`` / ``lookup`` / ``deregister`` take an
    address (an int) and a length."""

    def __init__(self, name: str | None = None, port: int = 1, gid_index: int = 0, fake: bool = False) -> None:
        out = ffi.new("struct isw_rdma **")
        if fake:
            rc = lib.isw_rdma_debug_open_fake(out)
        else:
            rc = lib.isw_rdma_open(name.encode() if name else ffi.NULL, port, gid_index, out)
        if rc < 0:
            raise _failure(rc)
        self._ptr: Any = out[0]

    @property
    def name(self) -> str:
        return ffi.string(lib.isw_rdma_device_name(self._live())).decode()

    def _live(self) -> Any:
        if self._ptr is None:
            raise ValueError("the RDMA device is closed")
        return self._ptr

    def register(self, addr: int, nbytes: int, writable: bool = True) -> tuple[int, int]:
        """``(lkey, rkey)`` of a region holding the range: found (one more reference) or new."""
        keys = ffi.new("uint32_t[2]")
        rc = lib.isw_rdma_reg(self._live(), ffi.cast("void *", addr), nbytes, int(writable), keys, keys + 1)
        if rc < 0:
            raise _failure(rc)
        return int(keys[0]), int(keys[1])

    def lookup(self, addr: int, nbytes: int, writable: bool = False) -> tuple[int, int] | None:
        keys = ffi.new("uint32_t[2]")
        rc = lib.isw_rdma_lookup(self._live(), ffi.cast("void *", addr), nbytes, int(writable), keys, keys + 1)
        return (int(keys[0]), int(keys[1])) if rc == 0 else None

    def deregister(self, addr: int, nbytes: int) -> None:
        """Drop one reference of the region holding the range (the last deregisters it)."""
        rc = lib.isw_rdma_dereg(self._live(), ffi.cast("void *", addr), nbytes)
        if rc < 0:
            raise _failure(rc)

    @property
    def regions(self) -> int:
        return int(lib.isw_rdma_region_count(self._live()))

    def queue_pair(self) -> "QueuePair":
        """A new RC queue pair of this device (``OSError`` when it cannot be made)."""
        return QueuePair(self._live())

    def selftest(self, slab_size: int = 1 << 20) -> None:
        """A slab lent over a queue pair looped back to this device (on the fake fabric too):
        WRITE, READ, a stale generation refused, and the fence (an access after the slab's
        region was deregistered fails and kills the remote). ``RdmaUnavailable`` naming the
        step that failed."""
        rc = lib.isw_rdma_selftest(self._live(), slab_size)
        if rc < 0:
            raise _failure(rc)

    def close(self) -> None:
        """Close the device; queue pairs still open keep what they need until destroyed."""
        if self._ptr is not None:
            lib.isw_rdma_close(self._ptr)
            self._ptr = None

    def __enter__(self) -> "RdmaDevice":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class QueuePair:
    """One RC queue pair of an opened device (``RdmaDevice.queue_pair``).  ``info``: this
    side's address (the ``QP_FIELDS`` map the peer connects to); ``connect(peer_info)``
    brings it to RTS towards the peer.  Destroyed by ``close()``, or handed over with
    ``release()`` (an RDMA remote then owns it)."""

    def __init__(self, device_ptr: Any) -> None:
        out = ffi.new("struct isw_rdma_qp **")
        info = ffi.new("struct isw_rdma_qp_info *")
        rc = lib.isw_rdma_qp_create(device_ptr, out, info)
        if rc < 0:
            raise OSError(-rc, _message())
        self._ptr: Any = ffi.gc(out[0], lib.isw_rdma_qp_destroy)
        self.info: dict[str, Any] = {name: int(getattr(info, name)) for name in QP_FIELDS if name != "gid"}
        self.info["gid"] = bytes(ffi.buffer(info.gid, lib.ISW_RDMA_GID_LEN))

    def _live(self) -> Any:
        if self._ptr is None:
            raise ValueError("the queue pair was closed or handed over")
        return self._ptr

    def connect(self, peer: Mapping[str, Any]) -> None:
        """RESET -> INIT -> RTR -> RTS towards ``peer`` (a ``QP_FIELDS`` map, as
        ``infiniswap.protocol`` validates it); ``OSError`` when refused."""
        gid = bytes(peer["gid"])
        if len(gid) != lib.ISW_RDMA_GID_LEN:
            raise ValueError(f"a GID has {lib.ISW_RDMA_GID_LEN} bytes, not {len(gid)}")
        info = ffi.new("struct isw_rdma_qp_info *")
        for name in QP_FIELDS:
            if name != "gid":
                setattr(info, name, int(peer[name]))
        ffi.memmove(info.gid, gid, len(gid))
        rc = lib.isw_rdma_qp_connect(self._live(), info)
        if rc < 0:
            raise OSError(-rc, _message())

    def release(self) -> Any:
        """The C queue pair, handed over (to ``CoreDevice.add_remote_rdma``, which destroys
        it with the remote); this object is closed afterwards."""
        ptr, self._ptr = self._live(), None
        ffi.gc(ptr, None)                       # no destructor any more: the remote owns it
        return ptr

    def close(self) -> None:
        """Destroy the queue pair (nothing when it was handed over).  Idempotent."""
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            ffi.gc(ptr, None)
            lib.isw_rdma_qp_destroy(ptr)

    def __enter__(self) -> "QueuePair":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def require_device(name: str | None = None) -> str:
    """The name of the device that opens (``name``, or the first); ``RdmaUnavailable`` with
    the core's message at once when there is none."""
    with RdmaDevice(name) as device:
        return device.name


def check_transport(transport: str) -> None:
    """Fail at once for ``--transport rdma`` where this process cannot use RDMA: no device,
    or a core built without libibverbs (``RdmaUnavailable`` with the core's message)."""
    if transport == "rdma":
        require_device()
