"""The thread a service's control loop runs on, and how it is stopped.

The Infiniswap daemon and device controller each own their sockets on one thread (ZeroMQ
sockets are not thread-safe) and loop: poll the sockets and a ``Waker`` until the next
deadline, handle what arrived, run what is due. ``ControlThread`` owns that thread, the
waker other threads use to interrupt the poll, and the stop flag the loop checks:
``stop()`` sets the flag, wakes the loop and joins it, and is idempotent.
"""
from __future__ import annotations

import threading
from typing import Callable

from .waker import Waker

__all__ = ["ControlThread"]


class ControlThread:
    """Runs ``loop`` on a named daemon thread; ``loop`` returns once ``stopping`` is set."""

    def __init__(self, name: str, loop: Callable[[], None]) -> None:
        self.name = name
        self._loop = loop
        self.waker = Waker()
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def wake(self) -> None:
        self.waker.wake()

    def stop(self) -> None:
        """Ask the loop to end, wake it, wait for it (no-op when not running)."""
        t, self._thread = self._thread, None
        if t is not None:
            self.stopping.set()
            self.waker.wake()
            t.join()

    def close(self) -> None:
        """``stop()``, then release the waker."""
        self.stop()
        self.waker.close()
