"""The ``rdma`` transport's memory: registrations by address range, landing buffers, lendable arrays.

A buffer a peer READs, or a READ lands in, must lie in a memory region registered with the
device (``Verbs.reg_mr``). Registering pins pages and costs time, so it is done once per
buffer and reused:

* ``Registrations`` -- the table of this process's regions, looked up by address range.
  A buffer is registered whole (its root object: the numpy array that owns the memory),
  and the region lives exactly as long as that array: a ``weakref.finalize`` on it
  deregisters the region when it is freed, so an address is never looked up in a region
  whose pages went back to the allocator. Memory owned by anything else -- ``bytes``, an
  mmap (closable while it lives), a torch tensor (its storage can be resized) -- is never
  registered (``NotRegistrable``): the channel stages a copy. (A numpy array resized in
  place while registered would escape this; nothing here does that.)
* ``LandingPool`` -- registered, writable blocks that incoming READs land in, handed out as
  exact-size arrays and taken back when the last view of them is freed.
* ``RdmaMemory`` -- the transport's ``Memory``: arrays allocated for a scope are registered
  once and lent (``Shared.ref = [addr, nbytes, rkey]``: a peer READs them in place), and
  released with their scope.

The device is a ``Verbs`` (``rdma_verbs``), given to the constructors, so all of this is
tested with a fake one.
"""
from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from .base import Memory, Shared
from .rdma_verbs import MemoryRegion, Verbs
from .shm import Arena

__all__ = ["NotRegistrable", "Registrations", "LandingPool", "RdmaMemory", "locate"]

LANDING_MIN = 64 << 10            # smallest landing block
LANDING_IDLE_MAX = 512 << 20      # idle landing bytes kept registered for reuse
SLOW_TO_REGISTER = 4 << 20        # allocations at least this large are made off the serving thread


class NotRegistrable(ValueError):
    """A buffer whose lifetime cannot be watched (or that is not contiguous)."""


def _root(obj: Any) -> Any:
    """The object that owns the memory behind ``obj`` (through array bases and memoryviews)."""
    while True:
        if isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        elif isinstance(obj, memoryview) and obj.obj is not None:
            obj = obj.obj
        else:
            return obj


def _span(obj: Any) -> tuple[int, int, bool]:
    """``(address, nbytes, writable)`` of a contiguous buffer."""
    if not isinstance(obj, np.ndarray):
        try:
            obj = np.frombuffer(obj, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise NotRegistrable(f"not a contiguous buffer: {exc}") from None
    if not obj.flags.c_contiguous:
        raise NotRegistrable("not a contiguous buffer")
    return obj.__array_interface__["data"][0], obj.nbytes, bool(obj.flags.writeable)


def locate(buf: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous buffer."""
    addr, nbytes, _ = _span(buf)
    return addr, nbytes


class _Entry:
    """One registered region, whether READs may land in it, and its owner's finalizer."""

    __slots__ = ("region", "writable", "finalizer")

    def __init__(self, region: MemoryRegion, writable: bool) -> None:
        self.region, self.writable = region, writable
        self.finalizer: weakref.finalize | None = None

    @property
    def end(self) -> int:
        return self.region.addr + self.region.nbytes


class Registrations:
    """This process's memory regions, by address range; each lives as long as its owner."""

    def __init__(self, verbs: Verbs) -> None:
        self.verbs = verbs
        self._starts: list[int] = []                  # sorted start addresses
        self._entries: dict[int, list[_Entry]] = {}   # start -> the regions starting there
        self._longest = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._entries.values()))

    def lookup(self, addr: int, nbytes: int, writable: bool = False) -> MemoryRegion | None:
        """A region holding ``[addr, addr + nbytes)`` (one READs may land in, if
        ``writable``), or ``None``."""
        end = addr + nbytes
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            while i > 0:
                i -= 1
                start = self._starts[i]
                if start + self._longest < end:
                    break              # no region starting this early is long enough
                for entry in self._entries[start]:
                    if end <= entry.end and (entry.writable or not writable):
                        return entry.region
        return None

    def register(self, buf: Any, writable: bool = False) -> MemoryRegion:
        """The region holding ``buf``: found, or its whole owner registered now (writable
        when the owner's memory is). ``writable``: READs will land in ``buf``.
        ``NotRegistrable`` when the owner's lifetime cannot be watched."""
        addr, nbytes, _ = _span(buf)
        found = self.lookup(addr, nbytes, writable)
        if found is not None:
            return found
        owner = _root(buf)
        if not (isinstance(owner, np.ndarray) and owner.flags.owndata):
            raise NotRegistrable(f"the memory of a {type(owner).__name__} cannot be registered "
                                 "(only a numpy array's own memory lives exactly as long as it)")
        start, length, owner_writable = _span(owner)
        if writable and not owner_writable:
            raise NotRegistrable("READs cannot land in read-only memory")
        entry = _Entry(self.verbs.reg_mr(start, length, owner_writable), owner_writable)
        with self._lock:
            if start not in self._entries:
                bisect.insort(self._starts, start)
                self._entries[start] = []
            self._entries[start].append(entry)
            self._longest = max(self._longest, length)
        entry.finalizer = weakref.finalize(owner, self._drop, entry)
        return entry.region

    def deregister(self, region: MemoryRegion) -> None:
        """Deregister ``region`` now, whether or not its owner lives on."""
        with self._lock:
            entry = next((e for e in self._entries.get(region.addr, ()) if e.region is region), None)
        if entry is not None:
            self._drop(entry)

    def deregister_owner(self, owner: Any) -> None:
        """Deregister every region whose memory lies inside ``owner``."""
        start, length, _ = _span(owner)
        with self._lock:
            inside = [e for s in self._starts if start <= s < start + length
                      for e in self._entries[s] if e.end <= start + length]
        for entry in inside:
            self._drop(entry)

    def close(self) -> None:
        with self._lock:
            entries = [e for s in self._starts for e in self._entries[s]]
        for entry in entries:
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            entries = self._entries.get(entry.region.addr, [])
            if entry not in entries:
                return                       # deregistered already
            entries.remove(entry)
            if not entries:
                del self._entries[entry.region.addr]
                self._starts.remove(entry.region.addr)
        if entry.finalizer is not None:
            entry.finalizer.detach()
        self.verbs.dereg_mr(entry.region)


class LandingPool:
    """Registered blocks READs land in: ``take(n)`` is an ``n``-byte array on a block of the
    next power of two (at least ``LANDING_MIN``); the block comes back when that array and
    every view of it are freed. At most ``idle_max`` idle bytes stay registered."""

    def __init__(self, regions: Registrations, idle_max: int = LANDING_IDLE_MAX) -> None:
        self.regions = regions
        self.idle_max = idle_max
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle = 0
        self._lock = threading.Lock()

    @staticmethod
    def block_size(nbytes: int) -> int:
        return max(LANDING_MIN, 1 << max(0, nbytes - 1).bit_length())

    def take(self, nbytes: int) -> tuple[np.ndarray, MemoryRegion]:
        """An ``nbytes`` array in registered memory, and the region holding it."""
        size = self.block_size(nbytes)
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
            if block is not None:
                self._idle -= size
        if block is None:
            block = np.empty(size, np.uint8)
        region = self.regions.register(block, writable=True)
        view = block[:nbytes]
        weakref.finalize(view, self._give_back, block)
        return view, region

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            if self._idle + block.nbytes <= self.idle_max:
                self._free.setdefault(block.nbytes, []).append(block)
                self._idle += block.nbytes
                return
        # over the limit: dropped here; its region goes with it (Registrations' finalizer)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle = 0


class RdmaMemory(Memory):
    """Registered memory: lendable arrays per scope, READ landing blocks, the region table."""

    lends = True

    def __init__(self, verbs: Verbs) -> None:
        self.verbs = verbs
        self.regions = Registrations(verbs)
        self.landing = LandingPool(self.regions)
        self._scopes: dict[str, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def allocate(self, sizes: Sequence[tuple[int, str]], scope: str, pace: Any = None) -> list[Shared]:
        if not sizes:
            return []
        offsets, total = Arena.layout(sizes)
        backing = np.zeros(max(total, 1), np.uint8)       # zeros: pages touched before pinning
        region = self.regions.register(backing, writable=True)
        with self._lock:
            self._scopes.setdefault(scope, []).append(backing)
        out = []
        for off, (numel, dtype) in zip(offsets, sizes):
            array = np.frombuffer(backing, dtype=dtype, count=numel, offset=off)
            out.append(Shared(array, [region.addr + off, array.nbytes, region.rkey]))
        return out

    def slow_to_allocate(self, nbytes: int) -> bool:
        return nbytes >= SLOW_TO_REGISTER

    def release(self, scope: str) -> None:
        with self._lock:
            backings = self._scopes.pop(scope, [])
        for backing in backings:
            self.regions.deregister_owner(backing)

    def close(self) -> None:
        with self._lock:
            self._scopes.clear()
        self.landing.close()
        self.regions.close()
