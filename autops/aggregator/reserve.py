"""Memory an aggregator makes ready off its loop, so that page faults never land on the data path.

``MemoryReadier`` owns the helper threads that populate memory and what they hand back to
the loop: the reserve made at start (``keep_reserve``: populated shared segments and warmed
heap, its segments made again as jobs take them, once the moves here are over), and the
memory of keys a job declares or that migrate or are backed up here (``ready_in_background``:
at the prefault pace, or at once where the job waits), the pace itself (the host's idle CPU
first, in the gaps between the jobs' communication phases), and those threads' figures in
the aggregator's ``stats``. Work a helper thread finished runs on the loop, which polls
``fd`` and calls ``run_ready``.

``timed`` adds the serving thread's time and minor page faults for a block to ``stats``: the
faults the memory made ready here is meant to spare it.
"""
from __future__ import annotations

import contextlib
import logging
import resource
import threading
import time
from typing import Callable, Iterator

import psutil

from dlrt.procs import name_this_thread
from dlrt.waker import Waker

from ..transport import Shared, Transport, background_priority
from ..transport.prefault import HostLoad, Pace, warm_heap, zeroed_arrays
from .store import Store

__all__ = ["MemoryReadier", "timed", "thread_faults", "RESERVE_MOVE_POLL_S", "RESERVE_MOVE_WAIT_S",
           "RESERVE_QUIET_PATIENCE_S", "DATA_QUIET_S"]

RESERVE_MOVE_POLL_S = 0.5   # how often the reserve's thread looks whether a move it waits out is over
RESERVE_MOVE_WAIT_S = 60.0  # the longest it waits for the moves here to be over before making segments
# the reserve's segments, once being made again, wait out a move here and the jobs' messages for
# this long at most per stretch (longer than memory for arrivals: nothing waits for the reserve)
RESERVE_QUIET_PATIENCE_S = 30.0
# memory made ready in the background waits for this long without a job's message, and for
# no reply waiting to be sent (the gap between the jobs' communication phases), before each
# step, for at most the pace's patience
DATA_QUIET_S = 0.02

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


def thread_faults() -> int:
    """The calling thread's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@contextlib.contextmanager
def timed(stats: dict, name: str) -> Iterator[None]:
    """Add the block's time and this thread's minor page faults to ``name``'s figures in ``stats``."""
    started, faults = time.perf_counter(), thread_faults()
    try:
        yield
    finally:
        took = time.perf_counter() - started
        stats[f"{name}_s"] = round(stats[f"{name}_s"] + took, 4)
        stats[f"{name}_max_ms"] = max(stats[f"{name}_max_ms"], round(1e3 * took, 2))
        stats[f"{name}_faults"] += thread_faults() - faults


class MemoryReadier:
    """Memory made ready on helper threads for one aggregator, and the loop's side of it.

    ``transport``: where the keys' buffers come from (its ``memory``) and whether replies
    wait to be sent (``sending``); ``store``: read from the reserve's thread to tell whether
    a key moves here or away; ``stats``: the aggregator's figures this adds to (``prefault_*``,
    ``at_once_prefault_*``, ``heap_warmed_bytes``, ``reserve_*``); ``stop``: set when the
    aggregator stops; ``prefault_share``, ``reserve``, ``reserve_shared``: as the aggregator
    was given them (``check``)."""

    def __init__(self, transport: Transport, store: Store, stats: dict, stop: threading.Event,
                 prefault_share: float, reserve: int, reserve_shared: float) -> None:
        self.check(prefault_share, reserve, reserve_shared)
        self.transport = transport
        self.memory = transport.memory
        self.store = store
        self.stats = stats
        self.stop = stop
        self.prefault_share = prefault_share
        self.reserve = int(reserve)
        self.reserve_shared = reserve_shared
        # work finished by helper threads (memory populated for an incoming migration), run on the loop
        self.finished: list[tuple[Callable[..., None], tuple]] = []
        self.readying = 0               # helper threads readying memory for keys, not done on the loop yet
        self.data_at = 0.0              # when the loop last took the jobs' messages (time.monotonic)
        self._waker = Waker()

    @staticmethod
    def check(prefault_share: float, reserve: int, reserve_shared: float) -> None:
        """``ValueError`` for settings a helper thread would refuse later, or that make no sense."""
        Pace(prefault_share)        # a share outside (0, 1] is refused here, not in a helper thread later
        if reserve < 0:
            raise ValueError(f"reserve must be 0 or more bytes, not {reserve}")
        if not 0 < reserve_shared <= 1:
            raise ValueError(f"reserve_shared must be above 0 and at most 1, not {reserve_shared}")

    # --- the loop's side --------------------------------------------------------------
    @property
    def fd(self) -> int:
        """Readable while work a helper thread finished waits for ``run_ready``."""
        return self._waker.fd

    def run_ready(self) -> None:
        """Run, on the loop, what helper threads finished (their figures, then their callbacks)."""
        self._waker.clear()
        while self.finished:
            fn, args = self.finished.pop(0)
            fn(*args)

    def data_taken(self) -> None:
        """The loop takes a job's messages now (``quiet`` waits for a gap after it)."""
        self.data_at = time.monotonic()

    def close(self) -> None:
        self._waker.close()

    def _hand_back(self, fn: Callable[..., None], args: tuple) -> None:
        """From a helper thread: ``fn(*args)`` on the loop."""
        self.finished.append((fn, args))

    # --- the pace -------------------------------------------------------------------
    def background_pace(self, wait_out_moves: bool = False) -> Pace:
        """The pace of memory made ready in the background: the host's idle CPU first, else
        ``prefault_share`` of a core, and in the gaps between the jobs' communication phases
        here (``quiet``). ``wait_out_moves`` (the reserve's segments made again): also not
        while a move here is under way -- one that starts while they are being made stops
        them until it is over (at most ``RESERVE_QUIET_PATIENCE_S`` per stretch)."""
        if not wait_out_moves:
            return Pace(self.prefault_share, load=HostLoad.of_this_host(), quiet=self.quiet)
        return Pace(self.prefault_share, load=HostLoad.of_this_host(),
                    quiet=lambda: self.quiet() and not self.moves_under_way(),
                    quiet_patience=RESERVE_QUIET_PATIENCE_S)

    def quiet(self) -> bool:
        """Whether the loop took no job's message for ``DATA_QUIET_S`` and no reply waits to
        be sent (``Transport.sending``: a pull phase, the workers draining the replies, is
        the communication phase too) -- read from helper threads."""
        return time.monotonic() - self.data_at >= DATA_QUIET_S and not self.transport.sending()

    def moves_under_way(self) -> bool:
        """Whether a key of this aggregator is migrating in or out -- in until its first
        iteration here completed (the workers' switch iteration) -- or memory is being readied
        for keys arriving (read from a helper thread: a snapshot of the tables, never changed
        from here)."""
        if self.readying:
            return True
        for state in list(self.store.jobs.values()):
            for ks in list(state.keys.values()):
                if ks.arrival is not None or ks.move is not None:
                    return True
        return False

    # --- the reserve ----------------------------------------------------------------
    def keep_reserve(self) -> None:
        """Make ``reserve`` bytes ready on a helper thread, at the prefault pace:
        ``reserve_shared`` of it (where the transport's memory is lent: ``SegmentReserve``) as
        populated shared segments that the keys' published buffers then come from, made again
        as jobs take them (once the moves under way here are over); the rest as populated
        heap, freed below a block left allocated so that glibc keeps it mapped
        (``warm_heap(fence=True)``), which server-mode keys' accumulators and optimizer state
        and the received pushes' buffers then come from. Jobs arriving
        and keys migrating in find their memory ready, without page faults and without
        populating it then. Capped at half the memory available now."""
        nbytes = min(self.reserve, psutil.virtual_memory().available // 2)
        if nbytes < self.reserve:
            log.warning("reserve of %d bytes capped at %d: half the memory available", self.reserve, nbytes)
        if nbytes <= 0:
            return
        pieces = self.memory.reserve
        shared = int(nbytes * self.reserve_shared) if pieces is not None else 0

        def taken() -> bool:
            """Wait until jobs took shared segments and no key moves here or away any more
            (True; the segments are made again after a move, not in its window; after
            ``RESERVE_MOVE_WAIT_S`` at most) or the aggregator stops (False)."""
            while not self.stop.is_set():
                if pieces.drawn.wait(1.0):
                    until = time.monotonic() + RESERVE_MOVE_WAIT_S
                    while self.moves_under_way() and time.monotonic() < until \
                            and not self.stop.wait(RESERVE_MOVE_POLL_S):
                        pass
                    pieces.drawn.clear()
                    return not self.stop.is_set()
            return False

        def keep() -> None:
            name_this_thread()
            background_priority()
            pace, reported = self.background_pace(wait_out_moves=True), 0.0
            try:
                made = warm_heap(nbytes - shared, pace, fence=True)
                while True:
                    made += pieces.fill(shared, pace) if shared else 0
                    log.info("reserve: %d bytes made ready in %.2f s of CPU", made, pace.cpu_s - reported)
                    self._hand_back(self._reserve_made, (made, pace.cpu_s - reported))
                    self._waker.wake()
                    made, reported = 0, pace.cpu_s
                    if not shared or not taken():
                        return
            except (MemoryError, OSError) as exc:
                log.warning("reserve: cannot make memory ready: %s", exc)

        threading.Thread(target=keep, name="autops-reserve", daemon=True).start()

    def _reserve_made(self, made: int, cpu_s: float) -> None:
        self.stats["reserve_warmed_bytes"] += made
        self.stats["reserve_cpu_s"] = round(self.stats["reserve_cpu_s"] + cpu_s, 3)

    # --- keys' memory -----------------------------------------------------------------
    def ready_in_background(self, job: str, sizes: list, private: list, nbytes: int, warm: int,
                            then: Callable[[tuple, list | None], None], at_once: bool = False) -> None:
        """On a helper thread, at the prefault pace (``at_once``: keys a job waits for, at once,
        and counted apart): allocate and populate ``sizes`` (the transport's memory) and
        ``private`` (``zeroed_arrays``), ``nbytes`` in all, and warm ``warm`` bytes of heap;
        then, on the loop, ``then((buffers, allocation error), private arrays or None)``."""
        def populate() -> None:
            name_this_thread()
            background_priority()
            faults = thread_faults()
            pace = Pace() if at_once else self.background_pace()
            made = self.allocate(sizes, job, pace)
            arrays, warmed = None, 0
            if made[1] is None:
                try:
                    arrays = zeroed_arrays(private, pace) if private else None
                    warmed = warm_heap(warm, pace)
                except MemoryError as exc:      # answered as an allocation error, never lost
                    made = (None, exc)
            log.info("job %s: %d bytes populated and %d bytes of heap warmed in %.2f s of CPU (%.2f s of it "
                     "on CPU the host had to spare; %.2f s paused, %.2f s waiting for a busy host)", job, nbytes,
                     warmed, pace.cpu_s, pace.idle_cpu_s, pace.paused_s, pace.waited_s)
            faults = thread_faults() - faults
            self._hand_back(self._prefaulted, (0 if made[1] else nbytes, warmed, pace, faults, at_once))
            self._hand_back(readied, (made, arrays))
            self._waker.wake()

        def readied(made: tuple, arrays: list | None) -> None:
            self.readying -= 1
            then(made, arrays)

        self.readying += 1
        threading.Thread(target=populate, name="autops-populate", daemon=True).start()

    def allocate(self, sizes: list, job: str,
                 pace: Pace | None = None) -> tuple[list[Shared] | None, OSError | MemoryError | None]:
        """``sizes`` of the transport's memory for ``job`` (populated at ``pace``): ``(buffers,
        None)``, or ``(None, the error)`` when they cannot be had."""
        try:
            return self.memory.allocate(sizes, job, pace), None
        except (OSError, MemoryError) as exc:
            return None, exc

    def _prefaulted(self, nbytes: int, warmed: int, pace: Pace, faults: int, at_once: bool = False) -> None:
        if at_once:
            self.stats["at_once_prefaulted_bytes"] += nbytes
            self.stats["at_once_prefault_cpu_s"] = round(self.stats["at_once_prefault_cpu_s"] + pace.cpu_s, 3)
            self.stats["at_once_prefault_faults"] += faults
            return
        self.stats["prefaulted_bytes"] += nbytes
        self.stats["prefault_faults"] += faults
        self.stats["heap_warmed_bytes"] += warmed
        for name, value in pace.figures().items():
            self.stats[f"prefault_{name}"] = round(self.stats[f"prefault_{name}"] + value, 3)
