"""Memory made ready ahead of its first use, paced so that it does not take the data path's CPU.

Page faults on a latency-critical path are avoided by populating memory ahead: the buffers of
keys that migrate to an aggregator, and the heap its receive path will fill with the new
keys' pushes (glibc keeps freed message buffers there once ``keep_freed_buffers`` raised its
thresholds, so a warmed heap serves them without faulting). The kernel zeroes every page
populated this way, which costs a core about half a second per GB.

Done on a helper thread, that work still competes with other processes at full weight: a
nice value orders threads only within their scheduling group, and the kernel groups every
session (autogroup) and every cgroup, so a nice-19 thread of an aggregator takes as much of a
busy machine as a worker does. ``Pace`` caps it: each chunk is followed by a sleep in
proportion to the CPU time it took, so the work uses at most ``share`` of a core.
"""
from __future__ import annotations

import ctypes
import mmap
import time
from typing import Callable

MADV_POPULATE_WRITE = 23        # Linux 5.14
CHUNK = 16 << 20                # bytes populated between two pauses
HEAP_CHUNK = 16 << 20           # heap warmed per allocation: below the mmap threshold keep_freed_buffers sets
# an aggregator's default share of a core for memory made ready for keys migrating in: a
# helper thread's nice value would not keep that off the workers' and other jobs' CPU
PREFAULT_SHARE = 0.25


class Pace:
    """At most ``share`` of a core for work done in steps: after a step that took ``c``
    seconds of this thread's CPU, sleep ``c * (1 - share) / share``. ``share`` 1: no pauses."""

    def __init__(self, share: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                 cpu: Callable[[], float] = time.thread_time) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"pace share must be in (0, 1], not {share}")
        self.share = share
        self._sleep, self._cpu = sleep, cpu
        self.cpu_s = 0.0            # CPU the steps took
        self.paused_s = 0.0         # and the pauses after them

    def step(self, work: Callable[[], object]) -> object:
        start = self._cpu()
        result = work()
        used = max(0.0, self._cpu() - start)
        self.cpu_s += used
        pause = used * (1.0 - self.share) / self.share
        if pause > 0:
            self.paused_s += pause
            self._sleep(pause)
        return result


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
        libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
        return libc
    except (OSError, AttributeError):
        return None


def _address(buffer: mmap.mmap) -> int:
    """Where a mapping starts (the ctypes view is dropped at once, so it can still be closed)."""
    anchor = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(anchor)
    del anchor
    return address


def _can_populate(libc: ctypes.CDLL | None) -> bool:
    if libc is None:
        return False
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        return libc.madvise(_address(probe), mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0
    finally:
        probe.close()


_LIBC = _libc()
CAN_POPULATE = _can_populate(_LIBC)


def populate(address: int, nbytes: int, pace: Pace | None = None) -> bool:
    """Allocate and map the pages of ``[address, address + nbytes)`` (page-aligned start), in
    chunks of ``CHUNK`` with ``pace``'s pauses between them; each ``madvise`` call releases
    the GIL. False when this kernel cannot (the pages then fault in on first use)."""
    if not CAN_POPULATE or nbytes <= 0:
        return False
    pace = pace or Pace()
    for offset in range(0, nbytes, CHUNK):
        length = min(CHUNK, nbytes - offset)
        if pace.step(lambda: _LIBC.madvise(address + offset, length, MADV_POPULATE_WRITE)) != 0:
            return False
    return True


def populate_buffer(buffer: mmap.mmap, pace: Pace | None = None) -> bool:
    """``populate`` for a whole mapping."""
    return populate(_address(buffer), len(buffer), pace)


def warm_heap(nbytes: int, pace: Pace | None = None) -> int:
    """Grow this process's heap by about ``nbytes`` of populated pages and free them again, so
    that the next allocations of that much (received messages) find pages already mapped.
    Only worth it where glibc keeps freed memory (``keep_freed_buffers``: chunks of
    ``HEAP_CHUNK`` stay below its mmap threshold, and fewer bytes than its trim threshold are
    freed at once). Returns the bytes populated."""
    if not CAN_POPULATE or nbytes <= 0:
        return 0
    pace = pace or Pace()
    page = mmap.PAGESIZE
    blocks, warmed = [], 0
    try:
        while warmed < nbytes:
            block = _LIBC.malloc(HEAP_CHUNK)
            if not block:
                break
            blocks.append(block)
            start = -(-block // page) * page
            length = (block + HEAP_CHUNK - start) // page * page
            if pace.step(lambda: _LIBC.madvise(start, length, MADV_POPULATE_WRITE)) != 0:
                break
            warmed += length
    finally:
        for block in reversed(blocks):
            _LIBC.free(block)
    return warmed
