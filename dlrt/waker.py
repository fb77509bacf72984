"""A self-pipe a control thread polls next to its sockets, so other threads can wake it.

ZeroMQ sockets are not thread-safe: each is used by the one thread that polls it. Other
threads (stop, commands, a new push) call ``wake()``; the polling thread watches ``fd``
and calls ``clear()`` when it woke, before it looks at what it was woken for.

A wake while the pipe already holds an unread wake writes nothing: a burst of commands (a
training step submits one per tensor) costs one ``write`` and one wake-up of the polling
thread, not one each.
"""
from __future__ import annotations

import os

__all__ = ["Waker"]


class Waker:
    """``wake()`` from any thread makes ``fd`` readable until ``clear()``."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._armed = False      # a wake is in the pipe (or on its way) and not cleared yet

    @property
    def fd(self) -> int:
        return self._r

    def wake(self) -> None:
        if self._armed or self._w < 0:
            return
        self._armed = True
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):      # full (already awake) or closed
            pass

    def clear(self) -> None:
        """Drain the pipe, then accept wakes again: whatever a skipped wake announced was
        queued before this returns, so the caller sees it when it looks next."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._armed = False

    def close(self) -> None:
        """Close both ends once (a second call must not close a reused descriptor)."""
        fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
