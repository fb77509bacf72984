"""A self-pipe a control thread polls next to its sockets, so other threads can wake it.

ZeroMQ sockets are not thread-safe: each is used by the one thread that polls it. Other
threads (stop, commands, a new push) call ``wake()``; the polling thread watches ``fd``
and calls ``clear()`` when it woke.
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

    @property
    def fd(self) -> int:
        return self._r

    def wake(self) -> None:
        if self._w < 0:
            return
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):      # full (already awake) or closed
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Close both ends once (a second call must not close a reused descriptor)."""
        fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
