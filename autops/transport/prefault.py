"""Memory made ready ahead of its first use, paced so that it does not take the data path's CPU.

Page faults on a latency-critical path are avoided by populating memory ahead: the buffers of
keys that migrate to an aggregator (in server mode also their gradient accumulators and
optimizer state: ``zeroed_arrays``), and the heap its receive path will fill with the new
keys' pushes (glibc keeps freed message buffers there once ``keep_freed_buffers`` raised its
thresholds, so a warmed heap serves them without faulting). The kernel zeroes every page
populated this way, which costs a core about half a second per GB.

Done on a helper thread, that work still competes with other processes at full weight: a
nice value orders threads only within their scheduling group, and the kernel groups every
session (autogroup) and every cgroup, so a nice-19 thread of an aggregator takes as much of a
busy machine as a worker does. ``Pace`` caps it: each chunk is followed by a sleep in
proportion to the CPU time it took, so the work uses at most ``share`` of a core. Given a
``HostLoad`` it goes to idle CPU first: at full speed while the host has a CPU to spare (no
task lately waited for one: the kernel's CPU pressure, PSI), not at all while tasks wait --
between a job's communication phases an aggregator's host is mostly idle, and in them busy
-- and at ``share`` again only on a host busy for longer than ``BUSY_PATIENCE_S``. Given a
quiet probe (an aggregator: no job's message for a moment) it also keeps to the gaps between
the service's own jobs' communication phases, for up to ``QUIET_PATIENCE_S`` of a stretch
without one: on a host whose other cores are busy anyway (or a machine emulating several
hosts) those phases are where its CPU and memory bandwidth cost the jobs time.
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import time
from typing import Callable, Sequence

import numpy as np

MADV_POPULATE_WRITE = 23        # Linux 5.14
CHUNK = 4 << 20                 # bytes populated per step: a step under way when the host gets busy runs on
HEAP_CHUNK = 16 << 20           # heap warmed per allocation (below the mmap threshold keep_freed_buffers sets)
POPULATE_MIN_PAGES = 16         # zeroed_arrays populates arrays spanning at least this many whole pages
LOAD_WINDOW_S = 0.1     # how far back HostLoad looks
STALL_FREE = 0.05       # the share of that time tasks may have waited for a CPU on a host with a core to spare
BUSY_PATIENCE_S = 1.0   # how long Pace waits for a busy host to have a CPU to spare before it goes at its share
BUSY_POLL_S = 0.02      # and how often it looks
QUIET_PATIENCE_S = 5.0  # how long Pace waits for its service to be quiet before it goes at its share
CPU_PRESSURE = "/proc/pressure/cpu"


def cpu_stall_s(path: str = CPU_PRESSURE) -> float | None:
    """Seconds since boot during which some runnable task of this host waited for a CPU (the
    kernel's pressure stall information, ``some total``); None where the kernel has none."""
    try:
        with open(path) as f:
            first = f.readline()
        return int(first.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


class HostLoad:
    """Whether this host has a CPU to spare: over about the last ``window`` seconds, tasks
    waited for a CPU (``stall``, cumulative seconds: ``cpu_stall_s``) at most ``STALL_FREE``
    of the time. A usage count could not tell: work that takes a free core leaves the others
    less than all cores, but a runnable task waiting for a CPU is what taking one costs."""

    def __init__(self, window: float = LOAD_WINDOW_S, stall: Callable[[], float | None] = cpu_stall_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._stall, self._clock = stall, clock
        self._samples: collections.deque = collections.deque()   # (time, stall)

    @property
    def available(self) -> bool:
        return self._stall() is not None

    @classmethod
    def of_this_host(cls) -> "HostLoad | None":
        """This host's load, or None where the kernel reports no CPU pressure."""
        load = cls()
        return load if load.available else None

    def stalled(self) -> float | None:
        """The share of the last window during which some task waited for a CPU; None until
        the samples span a whole window (or without stall information)."""
        stall = self._stall()
        if stall is None:
            return None
        now = (self._clock(), stall)
        samples = self._samples
        samples.append(now)
        while len(samples) > 2 and now[0] - samples[1][0] >= self.window:
            samples.popleft()
        then = samples[0]
        span = now[0] - then[0]
        if span < self.window:
            return None
        return max(0.0, now[1] - then[1]) / span

    def core_free(self) -> bool:
        """True when no task had to wait for a CPU lately (beyond ``STALL_FREE`` of the time)."""
        stalled = self.stalled()
        return stalled is not None and stalled <= STALL_FREE


class Pace:
    """At most ``share`` of a core for work done in steps: after a step that took ``c``
    seconds of this thread's CPU, sleep ``c * (1 - share) / share``. ``share`` 1: at once,
    neither pauses nor waits.

    With a ``load`` (``HostLoad``) the work goes to the host's idle CPU first: a step taken
    while no task waited for a CPU is not paused for, and while tasks do wait the next step
    waits (polls every ``poll`` s) until they stop -- a job's communication phase, say --
    for at most ``patience`` seconds of that busy stretch; a host busy for longer gets the
    steps at ``share`` again, so the work always progresses.

    With ``quiet`` (whether the service doing the work has nothing of its own to do now: no
    job's messages lately) a step also waits for that, for at most ``quiet_patience`` seconds
    of a stretch without it: the work then fills the gaps between its jobs' communication
    phases instead of taking CPU and memory bandwidth from them."""

    def __init__(self, share: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                 cpu: Callable[[], float] = time.thread_time, load: HostLoad | None = None,
                 clock: Callable[[], float] = time.monotonic, patience: float = BUSY_PATIENCE_S,
                 poll: float = BUSY_POLL_S, quiet: Callable[[], bool] | None = None,
                 quiet_patience: float = QUIET_PATIENCE_S) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"pace share must be in (0, 1], not {share}")
        self.share = share
        self.load = load if share < 1 else None
        self.quiet = quiet if share < 1 else None
        self.patience, self.poll, self.quiet_patience = patience, poll, quiet_patience
        self._sleep, self._cpu, self._clock = sleep, cpu, clock
        self._busy_since: float | None = None
        self._noisy_since: float | None = None
        self.cpu_s = 0.0            # CPU the steps took
        self.idle_cpu_s = 0.0       # of which in steps started while the host had a CPU to spare
        self.paused_s = 0.0         # the pauses that kept the others to ``share``
        self.waited_s = 0.0         # and the waits for a busy host to have a CPU to spare

    def figures(self) -> dict[str, float]:
        """What the work took so far: its CPU seconds (of them, on CPU the host had to spare),
        the pauses and the waits."""
        return {"cpu_s": self.cpu_s, "idle_cpu_s": self.idle_cpu_s, "paused_s": self.paused_s,
                "waited_s": self.waited_s}

    def _host_busy(self) -> bool:
        """Whether the host has no CPU to spare; tracks since when."""
        if self.load.core_free():
            self._busy_since = None
            return False
        if self._busy_since is None:
            self._busy_since = self._clock()
        return True

    def _patient(self) -> bool:
        return self._busy_since is not None and self._clock() - self._busy_since < self.patience

    def _waits_for_quiet(self) -> bool:
        """Whether the service is busy with its own work and has been for less than
        ``quiet_patience`` (tracks since when)."""
        if self.quiet():
            self._noisy_since = None
            return False
        if self._noisy_since is None:
            self._noisy_since = self._clock()
        return self._clock() - self._noisy_since < self.quiet_patience

    def step(self, work: Callable[[], object]) -> object:
        spare = False
        if self.load is not None or self.quiet is not None:
            while (self.quiet is not None and self._waits_for_quiet()) or \
                    (self.load is not None and self._host_busy() and self._patient()):
                self.waited_s += self.poll
                self._sleep(self.poll)
            spare = self.load is not None and self._busy_since is None
        start = self._cpu()
        result = work()
        used = max(0.0, self._cpu() - start)
        self.cpu_s += used
        if spare:
            self.idle_cpu_s += used
            return result
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_free() -> int:
    """Bytes this process's glibc heaps hold free (``mallinfo2``'s ``fordblks``, every arena):
    memory already mapped -- a warmed heap's, freed buffers' -- that the next allocations
    take before asking the system for more. 0 where glibc has no ``mallinfo2`` (before 2.33)."""
    call = getattr(_LIBC, "mallinfo2", None) if _LIBC is not None else None
    if call is None:
        return 0
    call.argtypes, call.restype = [], _MallInfo2
    return int(call().fordblks)


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
_FENCES: list[int] = []         # blocks warm_heap(fence=True) left allocated (never freed)
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


def warm_heap(nbytes: int, pace: Pace | None = None, fence: bool = False) -> int:
    """Grow this process's heap by about ``nbytes`` of populated pages and free them again, so
    that the next allocations of that much (received messages) find pages already mapped.
    Only worth it where glibc keeps freed memory (``keep_freed_buffers``: chunks of
    ``HEAP_CHUNK`` stay below its mmap threshold, and fewer bytes than its trim threshold are
    freed at once). Returns the bytes populated.

    ``fence``: the last block stays allocated, for good. The blocks freed below it then do
    not join the free top of the heap, the only part glibc gives back to the system (past
    its trim threshold), so they stay mapped however many they are: a reserve, which later
    allocations take before the heap grows, and which what they free joins again."""
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
            if not populate(start, length, pace):
                break
            warmed += length
    finally:
        if fence and blocks:
            _FENCES.append(blocks.pop(max(range(len(blocks)), key=blocks.__getitem__)))
        for block in reversed(blocks):
            _LIBC.free(block)
    return warmed


def zeroed_arrays(sizes: Sequence[tuple[int, str]], pace: Pace | None = None) -> list[np.ndarray]:
    """Zero-filled flat arrays of ``(numel, dtype)``, private to this process, their pages
    populated at ``pace``. They come from the allocator as any array does: where
    ``keep_freed_buffers`` keeps freed memory in the heap, an array freed when its key moves
    away leaves populated pages for the next one (its zeroing then touches only those)."""
    out = []
    page = mmap.PAGESIZE
    for numel, dtype in sizes:
        array = np.zeros(int(numel), np.dtype(dtype))
        address = array.ctypes.data
        start = -(-address // page) * page
        end = (address + array.nbytes) // page * page
        if end - start >= POPULATE_MIN_PAGES * page:
            populate(start, end - start, pace)      # best effort: a failure only costs faults later
        out.append(array)
    return out
