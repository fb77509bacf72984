"""Same-host shared memory: the buffers a process lends to peers on its host, and theirs it maps.

A process creates anonymous shared memory with ``memfd_create`` (nothing appears in
``/dev/shm``, the kernel frees it when the last mapping goes) and carves it into aligned
slices (``Arena``). A peer on the same host maps a segment through
``/proc/<pid>/fd/<fd>``. A segment's handle is ``[scope, segment id, pid, fd, size]`` and
a slice's reference is the handle plus its offset; the segment id guards against a reused
pid, the scope (a job) says which memory is released together. ``SharedMemory`` is the
``Memory`` of the ``shm`` transport: what this process allocates to lend, and what it has
mapped of its peers' (``Attachments``). An aggregator's ``--reserve`` keeps populated
segments ready for it (``SegmentReserve``).
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import uuid
from typing import Any, Iterable, Sequence

import numpy as np

from dlrt.procs import name_this_thread

from .prefault import CAN_POPULATE, Pace, populate_buffer
from .base import Memory, PayloadError, Shared, background_priority

log = logging.getLogger("autops.transport")

ALIGN = 64
PREFAULT_IN_BACKGROUND = 4 << 20    # allocations with more bytes are populated by a helper thread
RESERVE_PIECE = 16 << 20            # bytes per segment a SegmentReserve makes ahead


def available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _flags(populate: bool) -> int:
    """With ``populate`` the pages are allocated and mapped at once: by madvise after the
    mmap (``prefault.populate``), which, as a ctypes call, releases the GIL -- MAP_POPULATE
    holds it through the whole mmap call, so a helper thread populating gigabytes would stop
    every other thread of the process -- or by MAP_POPULATE where madvise cannot."""
    return mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate and not CAN_POPULATE else 0)


def _populate(mm: mmap.mmap, populate: bool, pace: Pace | None = None) -> None:
    if populate:
        populate_buffer(mm, pace)      # best effort, as MAP_POPULATE: a failure only costs faults later


class Segment:
    """One shared-memory segment, created here or attached from a peer."""

    def __init__(self, scope: str, seg_id: str, pid: int, fd: int, size: int, mm: mmap.mmap,
                 owner: bool) -> None:
        self.scope, self.seg_id, self.pid, self.fd, self.size = scope, seg_id, pid, fd, size
        self.mm = mm
        self.owner = owner
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, size: int, scope: str, name: str = "autops", populate: bool = False,
               pace: Pace | None = None) -> "Segment":
        """``populate``: allocate and map every page now, so the first use of the memory does
        not page-fault on a latency-critical path (``pace``: at most its share of a core)."""
        size = max(ALIGN, size)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, _flags(populate), mmap.PROT_READ | mmap.PROT_WRITE)
            _populate(mm, populate, pace)
        except BaseException:
            os.close(fd)
            raise
        return cls(scope, uuid.uuid4().hex, os.getpid(), fd, size, mm, owner=True)

    @classmethod
    def attach(cls, scope: str, seg_id: str, pid: int, fd: int, size: int, populate: bool = True) -> "Segment":
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        local = os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(local).st_size
            if actual < size:
                raise ValueError(f"shared segment {seg_id} is {actual} bytes, expected {size}")
            mm = mmap.mmap(local, size, _flags(populate), mmap.PROT_READ | mmap.PROT_WRITE)
            _populate(mm, populate)
        finally:
            os.close(local)
        return cls(scope, seg_id, pid, fd, size, mm, owner=False)

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"slice [{offset}, {offset + nbytes}) outside shared segment of {self.size} bytes")
        return self.buf[offset:offset + nbytes]

    def handle(self) -> list:
        """What a peer needs to map the whole segment: [scope, id, pid, fd, size]."""
        return [self.scope, self.seg_id, self.pid, self.fd, self.size]

    def close(self) -> None:
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:
            pass       # a numpy view is still alive; the mapping goes when it does
        if self.owner:
            try:
                os.close(self.fd)
            except OSError:
                pass


def _aligned(numel: int, dtype: str) -> int:
    return -(-int(numel) * np.dtype(dtype).itemsize // ALIGN) * ALIGN


class SegmentReserve:
    """Populated segments of ``piece`` bytes made ahead (``fill``), each handed whole to one
    scope (``take``), so memory lent to a job's peers is ready without page faults. A piece
    is never given back: it goes with its scope, as a segment created for it would, and
    ``fill`` makes new ones -- memory one job's workers mapped is never another job's."""

    def __init__(self, label: str = "autops-reserve", piece: int = RESERVE_PIECE) -> None:
        self.label, self.piece = label, max(ALIGN, int(piece))
        self.drawn = threading.Event()      # set when ``take`` handed pieces out
        self._pieces: list[Segment] = []
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes ready now."""
        with self._lock:
            return len(self._pieces) * self.piece

    def fill(self, target: int, pace: Pace | None = None) -> int:
        """Make populated pieces (at ``pace``) until at least ``target`` bytes are ready --
        rounded down to whole pieces; returns the bytes made."""
        made = 0
        while self.held + self.piece <= target:
            seg = Segment.create(self.piece, "", self.label, populate=True, pace=pace)
            with self._lock:
                self._pieces.append(seg)
            made += self.piece
        return made

    def take(self, sizes: Sequence[tuple[int, str]], scope: str) -> list[tuple[Segment, list[int]]]:
        """Pieces for as many of the arrays ``sizes`` as they hold, for ``scope``: ``[(piece,
        indices of the arrays it is to hold)]``, arrays in order, each piece filled before
        the next is taken. Arrays larger than a piece, and the rest once no piece is left,
        are not in the answer."""
        groups: list[list[int]] = []
        used = self.piece
        for i, (numel, dtype) in enumerate(sizes):
            nbytes = _aligned(numel, dtype)
            if nbytes > self.piece:
                continue
            if used + nbytes > self.piece:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += nbytes
        with self._lock:
            taken, self._pieces = self._pieces[:len(groups)], self._pieces[len(groups):]
        for seg in taken:
            seg.scope = scope
        if taken:
            self.drawn.set()
        return list(zip(taken, groups))

    def close(self) -> None:
        with self._lock:
            pieces, self._pieces = self._pieces, []
        for seg in pieces:
            seg.close()


class Arena:
    """Aligned slices of segments created for one scope."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    @staticmethod
    def layout(sizes: Sequence[tuple[int, str]]) -> tuple[list[int], int]:
        """Aligned offsets of ``(numel, dtype)`` arrays in one segment, and its size."""
        offsets, total = [], 0
        for numel, dtype in sizes:
            offsets.append(total)
            total += _aligned(numel, dtype)
        return offsets, total

    def adopt(self, seg: Segment, sizes: Sequence[tuple[int, str]]) -> list[Shared]:
        """Carve a segment into arrays of ``(numel, dtype)`` with their references."""
        offsets, total = self.layout(sizes)
        if seg.size < total:
            raise ValueError(f"segment of {seg.size} bytes cannot hold {total}")
        self.segments.append(seg)
        handle = seg.handle()
        return [Shared(np.frombuffer(seg.buf, dtype=dtype, count=numel, offset=off), [*handle, off])
                for off, (numel, dtype) in zip(offsets, sizes)]

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
        self.segments.clear()


def _parse_handle(handle: Any, width: int) -> tuple:
    if not isinstance(handle, (list, tuple)) or len(handle) != width:
        raise ValueError(f"malformed shared-memory reference {handle!r}")
    scope, seg_id, *ints = handle
    if not isinstance(scope, str) or not isinstance(seg_id, str) \
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise ValueError(f"malformed shared-memory reference {handle!r}")
    return tuple(handle)


class Attachments:
    """Segments of peers, mapped once and reused; released by scope."""

    def __init__(self) -> None:
        self._segs: dict[str, Segment] = {}
        self._scopes: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def view(self, ref: Any, nbytes: int) -> memoryview:
        """``nbytes`` at a peer's reference ``[scope, id, pid, fd, size, offset]``; ``ValueError``
        when the reference is malformed or the memory cannot be mapped."""
        if type(ref) is list and len(ref) == 6 and type(ref[1]) is str and type(ref[5]) is int:
            seg = self._segs.get(ref[1])           # mapped already: the common case, no lock needed
            if seg is not None:
                return seg.view(ref[5], nbytes)
        scope, seg_id, pid, fd, size, offset = _parse_handle(ref, 6)
        with self._lock:
            seg = self._segs.get(seg_id)
        if seg is None:
            # map outside the lock: populating a large segment must not stall other threads
            try:
                fresh = Segment.attach(scope, seg_id, pid, fd, size)
            except OSError as exc:
                raise ValueError(f"cannot map shared memory of process {pid} ({exc.strerror}); "
                                 "use the ipc or tcp transport") from None
            with self._lock:
                seg = self._segs.get(seg_id)
                if seg is None:
                    seg = self._segs[seg_id] = fresh
                    self._scopes.setdefault(scope, set()).add(seg_id)
                else:
                    fresh.close()          # another thread mapped it meanwhile
        return seg.view(offset, nbytes)

    def attach(self, handle: Any) -> None:
        """Map a peer's whole segment ahead of its first use (``Segment.handle``)."""
        self.view([*_parse_handle(handle, 5), 0], 0)

    def handles(self, scope: str) -> list[list]:
        with self._lock:
            return [self._segs[s].handle() for s in self._scopes.get(scope, ()) if s in self._segs]

    def release(self, scope: str) -> None:
        with self._lock:
            for seg_id in self._scopes.pop(scope, set()):
                seg = self._segs.pop(seg_id, None)
                if seg is not None:
                    seg.close()

    def close(self) -> None:
        for scope in list(self._scopes):
            self.release(scope)


class SharedMemory(Memory):
    """The ``shm`` transport's memory: memfd segments per scope, and the peers' mapped ones."""

    lends = True

    def __init__(self, label: str | None = None) -> None:
        self.label = label
        self.arenas: dict[str, Arena] = {}
        self.attached = Attachments()
        self.reserve = SegmentReserve(f"{label or 'autops'}-reserve")
        self._premapped: set[str] = set()
        self._lock = threading.Lock()

    def allocate(self, sizes: Sequence[tuple[int, str]], scope: str,
                 pace: Pace | None = None) -> list[Shared]:
        """Arrays from the reserve's pieces while it has some, the others in a segment created
        for them."""
        if not sizes:
            return []
        out: list[Shared | None] = [None] * len(sizes)

        def adopt(seg: Segment, indices: list[int]) -> None:
            with self._lock:
                arena = self.arenas.setdefault(scope, Arena())
                for i, buf in zip(indices, arena.adopt(seg, [sizes[i] for i in indices])):
                    out[i] = buf

        for seg, indices in self.reserve.take(sizes, scope):
            adopt(seg, indices)
        rest = [i for i, buf in enumerate(out) if buf is None]
        if rest:
            _, total = Arena.layout([sizes[i] for i in rest])
            adopt(Segment.create(total, scope, self.label or f"autops-{scope}", populate=True, pace=pace), rest)
        return out

    def slow_to_allocate(self, nbytes: int) -> bool:
        return nbytes >= PREFAULT_IN_BACKGROUND

    def handles_of(self, buffers: Iterable[Shared]) -> list:
        seen: dict[str, list] = {}
        for buf in buffers:
            if buf.ref is not None:
                seen.setdefault(buf.ref[1], list(buf.ref[:5]))
        return list(seen.values())

    def mapped_handles(self, scope: str) -> list:
        return self.attached.handles(scope)

    def view(self, ref: Any, nbytes: int) -> memoryview | PayloadError:
        """A lent payload, or the ``PayloadError`` that stands in for it."""
        try:
            return self.attached.view(ref, nbytes)
        except ValueError as exc:
            return PayloadError(str(exc))

    def premap(self, handles: Any) -> None:
        fresh = [h for h in handles or () if isinstance(h, list) and len(h) == 5 and h[1] not in self._premapped]
        if not fresh:
            return
        self._premapped.update(h[1] for h in fresh)
        threading.Thread(target=self._premap, args=(fresh,), name="autops-premap", daemon=True).start()

    def _premap(self, handles: list) -> None:
        name_this_thread()
        background_priority()
        for handle in handles:
            try:
                self.attached.attach(handle)
            except (ValueError, OSError) as exc:
                log.info("could not map a peer's shared memory ahead of time: %s", exc)

    def release(self, scope: str) -> None:
        self.attached.release(scope)
        with self._lock:
            arena = self.arenas.pop(scope, None)
        if arena is not None:
            arena.close()

    def close(self) -> None:
        self.attached.close()
        self.reserve.close()
        with self._lock:
            arenas, self.arenas = list(self.arenas.values()), {}
        for arena in arenas:
            arena.close()

