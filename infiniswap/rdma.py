"""Infiniswap over RDMA: the C core's verbs device (``csrc/infiniswap/isw_rdma.c``) from Python.

What exists: opening a device (``RdmaDevice``; ``require_device`` answers at once whether
this machine has one), the registration table of the memory the daemon lends (register a
slab when it is lent, look it up by address range, deregister before it is taken back --
the rkey is the lease, see ``isw_rdma.h``), RC queue pairs, and the device's remote
backend that READs and WRITEs a slab one-sidedly. What does not exist yet: the control
loops using them -- the daemon registering slabs on MAP and sending ``addr``/``rkey`` and
its queue pair's address in MR_INFO, the device connecting a queue pair per daemon and
adding the remote (``docs/rdma.md`` says exactly what is missing). So ``--transport rdma``
fails at once: with the core's "no RDMA device found ..." where there is no device, and
saying it is not wired where there is one.

Not run on hardware: this project's machines have no RDMA device.
"""
from __future__ import annotations

from typing import Any

from infiniswap._core import ffi, lib

__all__ = ["RdmaUnavailable", "RdmaDevice", "built", "device_count", "require_device", "check_transport",
           "NOT_WIRED"]

NOT_WIRED = ("an RDMA device is present, but Infiniswap's daemon and device do not use the RDMA remote "
             "yet (docs/rdma.md): use --transport tcp")


class RdmaUnavailable(RuntimeError):
    """This process cannot use RDMA here (no device, or a core built without libibverbs):
    a runtime error, exit status 1."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(message)
        self.errno = errno


def _failure(rc: int) -> RdmaUnavailable:
    return RdmaUnavailable(-rc, ffi.string(lib.isw_last_error()).decode("utf-8", "replace"))


def built() -> bool:
    """Whether the C core was built with libibverbs."""
    return bool(lib.isw_rdma_built())


def device_count() -> int:
    """RDMA devices ``ibv_get_device_list`` reports (0 when none, or not built)."""
    return int(lib.isw_rdma_device_count())


class RdmaDevice:
    """One opened device and the memory registered through it (``fake``: a device that
    only keeps the books, for tests). ``register`` / ``lookup`` / ``deregister`` take an
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

    def selftest(self, slab_size: int = 1 << 20) -> None:
        """On a real device: a slab lent over a queue pair looped back to this device --
        WRITE, READ, a stale generation refused, and the fence (an access after the slab's
        region was deregistered fails and kills the remote). ``RdmaUnavailable`` naming the
        step that failed."""
        rc = lib.isw_rdma_selftest(self._live(), slab_size)
        if rc < 0:
            raise _failure(rc)

    def close(self) -> None:
        if self._ptr is not None:
            lib.isw_rdma_close(self._ptr)
            self._ptr = None

    def __enter__(self) -> "RdmaDevice":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def require_device(name: str | None = None) -> str:
    """The name of the device that opens (``name``, or the first); ``RdmaUnavailable`` with
    the core's message at once when there is none."""
    with RdmaDevice(name) as device:
        return device.name


def check_transport(transport: str) -> None:
    """Fail at once for ``--transport rdma``: no device (the core's message), or a device
    that the control loops cannot use yet."""
    if transport == "rdma":
        require_device()
        raise RdmaUnavailable(0, NOT_WIRED)
