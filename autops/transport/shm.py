"""Same-host shared-memory payloads: tensor bytes move by one memcpy instead of a socket.

A process creates anonymous shared memory with ``memfd_create`` (nothing appears in
``/dev/shm``, the kernel frees it when the last mapping goes) and carves it into aligned
slices (``Arena``). A peer on the same host maps a segment through
``/proc/<pid>/fd/<fd>``; messages over the ipc socket then carry only a reference
``[segment id, pid, fd, size, offset]`` to a slice. The segment id guards against a
reused pid. Control messages still travel over ZeroMQ; only payload bytes move here.
"""
from __future__ import annotations

import mmap
import os
import threading
import uuid

import numpy as np

ALIGN = 64


def available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def background_priority() -> None:
    """Lowest CPU priority for the calling thread (Linux nice is per thread): memory
    population and mapping done ahead of time must not take CPU from the data path."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


def _flags(populate: bool) -> int:
    return mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)


class Segment:
    """One shared-memory segment, created here or attached from a peer."""

    def __init__(self, seg_id: str, pid: int, fd: int, size: int, mm: mmap.mmap, owner: bool) -> None:
        self.seg_id, self.pid, self.fd, self.size = seg_id, pid, fd, size
        self.mm = mm
        self.owner = owner
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, size: int, name: str = "autops", populate: bool = False) -> "Segment":
        """``populate``: allocate and map every page now (MAP_POPULATE), so the first use of
        the memory does not page-fault on a latency-critical path."""
        size = max(ALIGN, size)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, _flags(populate), mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(uuid.uuid4().hex, os.getpid(), fd, size, mm, owner=True)

    @classmethod
    def attach(cls, seg_id: str, pid: int, fd: int, size: int, populate: bool = True) -> "Segment":
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        local = os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(local).st_size
            if actual < size:
                raise ValueError(f"shared segment {seg_id} is {actual} bytes, expected {size}")
            mm = mmap.mmap(local, size, _flags(populate), mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(local)
        return cls(seg_id, pid, fd, size, mm, owner=False)

    def array(self, offset: int, nbytes: int, dtype: str) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"slice [{offset}, {offset + nbytes}) outside shared segment of {self.size} bytes")
        itemsize = np.dtype(dtype).itemsize
        if nbytes % itemsize:
            raise ValueError(f"{nbytes} bytes is not a whole number of {dtype}")
        return np.frombuffer(self.buf, dtype=dtype, count=nbytes // itemsize, offset=offset)

    def ref(self, offset: int) -> list:
        return [self.seg_id, self.pid, self.fd, self.size, offset]

    def handle(self) -> list:
        """What a peer needs to map the whole segment: [id, pid, fd, size]."""
        return [self.seg_id, self.pid, self.fd, self.size]

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


class Arena:
    """Aligned slices of freshly created segments (one segment per ``allocate`` call)."""

    def __init__(self, name: str = "autops", populate: bool = True) -> None:
        self.name = name
        self.populate = populate
        self.segments: list[Segment] = []

    @staticmethod
    def layout(sizes: list[tuple[int, str]]) -> tuple[list[int], int]:
        """Aligned offsets of ``(numel, dtype)`` arrays in one segment, and its size."""
        offsets, total = [], 0
        for numel, dtype in sizes:
            offsets.append(total)
            total += -(-numel * np.dtype(dtype).itemsize // ALIGN) * ALIGN
        return offsets, total

    def allocate(self, sizes: list[tuple[int, str]]) -> list[tuple[np.ndarray, list]]:
        """Arrays of ``(numel, dtype)`` backed by one new segment, with their references."""
        _, total = self.layout(sizes)
        return self.adopt(Segment.create(total, self.name, populate=self.populate), sizes)

    def adopt(self, seg: Segment, sizes: list[tuple[int, str]]) -> list[tuple[np.ndarray, list]]:
        """Carve a segment created elsewhere (e.g. populated by another thread) into arrays."""
        offsets, total = self.layout(sizes)
        if seg.size < total:
            raise ValueError(f"segment of {seg.size} bytes cannot hold {total}")
        self.segments.append(seg)
        return [(seg.array(off, numel * np.dtype(dtype).itemsize, dtype), seg.ref(off))
                for off, (numel, dtype) in zip(offsets, sizes)]

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
        self.segments.clear()


class Attachments:
    """Segments of peers, mapped once and reused; released by owner tag (e.g. a job)."""

    def __init__(self) -> None:
        self._segs: dict[str, Segment] = {}
        self._tags: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def array(self, ref: list, nbytes: int, dtype: str, tag: str = "") -> np.ndarray:
        if not isinstance(ref, (list, tuple)) or len(ref) != 5:
            raise ValueError(f"malformed shared-memory reference {ref!r}")
        seg_id, pid, fd, size, offset = ref
        if not isinstance(seg_id, str) or not all(isinstance(v, int) for v in (pid, fd, size, offset)):
            raise ValueError(f"malformed shared-memory reference {ref!r}")
        with self._lock:
            seg = self._segs.get(seg_id)
        if seg is None:
            # map outside the lock: populating a large segment must not stall other threads
            try:
                fresh = Segment.attach(seg_id, pid, fd, size)
            except OSError as exc:
                raise ValueError(f"cannot map shared memory of process {pid} ({exc.strerror}); "
                                 "use the ipc or tcp transport") from None
            with self._lock:
                seg = self._segs.get(seg_id)
                if seg is None:
                    seg = self._segs[seg_id] = fresh
                    self._tags.setdefault(tag, set()).add(seg_id)
                else:
                    fresh.close()          # another thread mapped it meanwhile
        return seg.array(offset, nbytes, dtype)

    def attach(self, handle: list, tag: str = "") -> None:
        """Map a peer's whole segment ahead of its first use (``Segment.handle``)."""
        if not isinstance(handle, (list, tuple)) or len(handle) != 4:
            raise ValueError(f"malformed shared-memory handle {handle!r}")
        self.array([*handle, 0], 0, "uint8", tag=tag)

    def handles(self, tag: str) -> list[list]:
        with self._lock:
            return [self._segs[s].handle() for s in self._tags.get(tag, ()) if s in self._segs]

    def release(self, tag: str) -> None:
        with self._lock:
            for seg_id in self._tags.pop(tag, set()):
                seg = self._segs.pop(seg_id, None)
                if seg is not None:
                    seg.close()

    def close(self) -> None:
        for tag in list(self._tags):
            self.release(tag)
