"""A job's output log with a size cap: ``CappedLog`` writes it, ``read_log``/``tail`` read it.

A run's output reaches ``job.log`` through its supervisor (local executor) or launcher actor
(Ray executor), which reads the node commands' pipe and writes through ``CappedLog``: when
``job.log`` reaches ``max_bytes`` it is renamed to ``job.log.1`` (the previous ``.1`` is
dropped) and a new ``job.log`` begins, so a job's logs take at most about twice the cap.
``max_bytes`` 0: no cap.

Offsets are absolute: byte N of a job's output keeps offset N across rotations (the offset
of the first byte of the current ``job.log`` is kept in ``job.log.start``, written after each
rotation with the new file's inode). A reader asking for an offset that was rotated away
gets the oldest byte still kept, so ``logs --follow`` never repeats nor skips kept output.
Several writers of one log (the Ray executor's nodes) rotate under an ``flock`` of
``job.log.lock`` and reopen when another writer has rotated.

A write that fails for lack of space (``ENOSPC``, ``EDQUOT``) is dropped and counted
(``dropped``), never raised: a full disk must not stop a job nor its supervisor recording
how the run ended; the next write that succeeds first notes how much was lost.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
CHUNK = 1 << 16
START_SUFFIX = ".start"
LOCK_SUFFIX = ".lock"
OLD_SUFFIX = ".1"


class CappedLog:
    """Append-only writer of one job log, rotated at ``max_bytes`` (0: never). Thread-safe."""

    def __init__(self, path: str, max_bytes: int = 0) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self.dropped = 0                  # bytes lost to a full disk since the last successful write
        self.dropped_total = 0
        self._lock = threading.Lock()
        self._fd: int | None = None

    # --- writing -----------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Append ``data``, rotating first whenever the current file is full."""
        if not data:
            return
        with self._lock:
            try:
                if self.dropped:
                    note = f"\n=== tiresias: {self.dropped} bytes of output dropped: no space left ===\n"
                    self._append(note.encode())
                    self.dropped = 0
                self._append(data)
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                self.dropped += len(data)
                self.dropped_total += len(data)

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            fd = self._current()
            size = os.fstat(fd).st_size
            room = len(view) if not self.max_bytes else self.max_bytes - size
            if room <= 0:
                self._rotate(fd)
                continue
            written = os.write(fd, view[:room])
            view = view[written:]

    def _current(self) -> int:
        """The open fd of ``path``, reopened when another writer has rotated it away."""
        fd = self._fd
        if fd is not None:
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
        self._fd = _open_append(self.path)
        return self._fd

    def _rotate(self, fd: int) -> None:
        """``job.log`` -> ``job.log.1`` and a new ``job.log``, unless another writer just did."""
        lock = os.open(self.path + LOCK_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            st = os.fstat(fd)
            try:
                if os.stat(self.path).st_ino != st.st_ino:
                    return                                  # rotated by another writer: reopen
            except FileNotFoundError:
                return
            start = read_start(self.path)[0] + st.st_size
            os.replace(self.path, self.path + OLD_SUFFIX)
            new = _open_append(self.path)
            try:
                if os.geteuid() == 0:
                    os.fchown(new, st.st_uid, st.st_gid)     # a log handed to the job's user stays its
                os.fchmod(new, st.st_mode & 0o777)
            except OSError:
                pass
            _write_start(self.path, start, os.fstat(new).st_ino)
            os.close(new)
        finally:
            os.close(lock)

    def pump(self, fd: int) -> None:
        """Copy everything readable from ``fd`` (a pipe) until EOF; closes ``fd``."""
        try:
            while True:
                try:
                    data = os.read(fd, CHUNK)
                except InterruptedError:
                    continue
                if not data:
                    return
                self.write(data)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def start_pump(log: CappedLog, fd: int, name: str = "joblog-pump") -> threading.Thread:
    """A daemon thread running ``log.pump(fd)``."""
    thread = threading.Thread(target=log.pump, args=(fd,), name=name, daemon=True)
    thread.start()
    return thread


def _open_append(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _write_start(path: str, start: int, inode: int) -> None:
    tmp = f"{path}{START_SUFFIX}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps({"start": start, "inode": inode}).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path + START_SUFFIX)


def read_start(path: str) -> tuple[int, int | None]:
    """(absolute offset of ``path``'s first byte, the inode it was recorded for); (0, None) before
    any rotation."""
    try:
        with open(path + START_SUFFIX) as f:
            d = json.load(f)
        return int(d["start"]), int(d["inode"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, None


# --- reading ------------------------------------------------------------------------------------
def _snapshot(path: str) -> tuple[list[tuple[str, int, int]], int] | None:
    """The kept files as ``(file, absolute start, size)``, oldest first, and the end offset;
    None while a rotation is half done (the caller retries)."""
    start, inode = read_start(path)
    try:
        st = os.stat(path)
        size, ino = st.st_size, st.st_ino
    except FileNotFoundError:
        size, ino = 0, None
    old = path + OLD_SUFFIX
    try:
        old_size = os.stat(old).st_size
    except FileNotFoundError:
        old_size = None
    if old_size is not None and (inode is None or ino != inode):
        return None                                         # renamed, not yet recorded
    files = []
    if old_size is not None:
        files.append((old, start - old_size, old_size))
    files.append((path, start, size))
    return files, start + size


def _stable_snapshot(path: str) -> tuple[list[tuple[str, int, int]], int]:
    for _ in range(20):
        snap = _snapshot(path)
        if snap is not None:
            return snap
        time.sleep(0.005)
    start, _ = read_start(path)                               # a writer died mid-rotation: best effort
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return [(path, start, size)], start + size


def read_log(path: str, offset: int = 0, limit: int = 1 << 20) -> tuple[bytes, int]:
    """Up to ``limit`` bytes of the job's output from absolute ``offset``: ``(data, next offset)``.
    An offset already rotated away reads from the oldest byte kept; one past the end reads nothing."""
    files, end = _stable_snapshot(path)
    offset = max(offset, files[0][1], 0)
    out = bytearray()
    for name, start, size in files:
        if offset >= start + size or len(out) >= limit:
            continue
        try:
            with open(name, "rb") as f:
                f.seek(offset - start)
                want = min(limit - len(out), start + size - offset)
                chunk = f.read(want)
        except FileNotFoundError:
            break
        out += chunk
        offset += len(chunk)
        if len(chunk) < want:
            break                                           # shorter than stat said: stop here
    return bytes(out), offset


def tail(path: str, nbytes: int) -> bytes:
    """The last ``nbytes`` of the job's kept output."""
    _, end = _stable_snapshot(path)
    data, _ = read_log(path, max(0, end - nbytes), nbytes)
    return data

