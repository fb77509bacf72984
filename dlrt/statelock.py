"""One owner per state directory: an exclusive lock on ``DIR/owner.lock`` (DESIGN §6).

A service that keeps state in a directory (``tiresias master --state``, ``autops master
--state-dir``) calls ``acquire`` before it reads anything there. ``acquire`` takes an
exclusive ``flock`` on the lock file, without waiting, and writes the owner's pid and program
into it; ``StateLock.record`` adds what the owner learns later (its URL, once bound). When
another process holds the lock, ``acquire`` raises ``StateLocked`` naming the owner (pid,
program, URL), and the caller exits without touching the directory.

The lock lives as long as the open file description: the kernel drops it when the owner exits,
``kill -9`` included, so a stale lock file is simply taken over by the next owner (which
rewrites its contents). The descriptor is not inherited by the owner's children
(``O_CLOEXEC``), so jobs that outlive a service never keep its directory locked. The lock
file is never removed (removing it would let two processes lock two different files).
Administrative commands that work on the state beside the owner (SQLite allows it) do not
take the lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from typing import Any

__all__ = ["LOCK_NAME", "StateLocked", "StateLock", "acquire", "read_owner"]

LOCK_NAME = "owner.lock"
READ_TRIES = 20              # an owner's record being rewritten: read again (every 10 ms)


class StateLocked(RuntimeError):
    """The directory is owned by another live process; ``owner`` is what it recorded."""

    def __init__(self, directory: str, owner: dict[str, Any], hint: str = "") -> None:
        self.directory = directory
        self.owner = owner
        who = owner.get("program") or "another process"
        pid = owner.get("pid")
        url = owner.get("url")
        where = f"pid {pid}" if pid else "pid unknown"
        where += f", {url}" if url else ", address not yet known"
        super().__init__(f"state dir {directory} is owned by {who} ({where}); stop it first"
                         + (f", or {hint}" if hint else ""))


class StateLock:
    """The held lock of one state directory (``acquire`` makes it)."""

    def __init__(self, directory: str, fd: int, program: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.program = program
        self._fd: int | None = fd
        self.info: dict[str, Any] = {"pid": os.getpid(), "program": program, "since": time.time()}
        self._write()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def record(self, **info: Any) -> None:
        """Add ``info`` (e.g. ``url=...``) to the owner's record in the lock file."""
        self.info.update(info)
        self._write()

    def _write(self) -> None:
        if self._fd is None:
            raise RuntimeError(f"the lock of {self.directory} is released")
        data = (json.dumps(self.info) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "StateLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def acquire(directory: str | os.PathLike, program: str, hint: str = "") -> StateLock:
    """Lock ``directory`` (created if missing) for this process, or raise ``StateLocked``
    naming its owner; ``hint`` ends that message (e.g. ``"give another --state"``)."""
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StateLocked(directory, read_owner(directory) or {}, hint) from None
        raise
    return StateLock(directory, fd, program)


def read_owner(directory: str | os.PathLike) -> dict[str, Any] | None:
    """What the owner of ``directory`` recorded (pid, program, url), or None when nothing
    readable is there (no lock file, or an owner still writing its record)."""
    path = os.path.join(os.fspath(directory), LOCK_NAME)
    for attempt in range(READ_TRIES):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return None
        try:
            data = json.loads(text)
            if isinstance(data, dict):
                return data
        except ValueError:
            pass
        time.sleep(0.01)
    return None
