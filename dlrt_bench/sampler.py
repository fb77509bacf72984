"""A counter sampler for the benchmarks: reads some counters every ``interval`` seconds on a
thread, from ``start`` to ``stop``, and says afterwards what changed over a time window
(``time.monotonic``, the clock every process on the machine shares). Subclasses say what
they read (``read``) and how two readings differ (``delta``). ``ProcFiles`` reads the
``/proc`` files they sample without opening them again each time."""
from __future__ import annotations

import bisect
import os
import threading
from abc import ABC, abstractmethod
import time
from typing import Any


def read_text(path: str) -> str:
    """A file's whole text, opened for this one read."""
    with open(path) as f:
        return f.read()


class ProcFiles:
    """Files read again and again (``/proc`` counters), each kept open and read whole from
    its start with one ``pread``: the kernel makes the text afresh for every read, and the
    path lookup an ``open`` costs under ``/proc`` (two thirds of a small file's read) is paid
    once. A benchmark sampling a dozen processes 50 times a second took about 9% of a 2-core
    machine opening and parsing them (``autops bench migrate``); reads of a file whose
    process is gone raise ``OSError`` and close it."""

    def __init__(self, size: int = 1 << 16) -> None:
        self.size = size
        self._fds: dict[str, int] = {}

    def read(self, path: str) -> str:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, self.size, 0)
            if not data:
                raise OSError(f"{path}: nothing to read (its process is gone)")
        except OSError:
            self.forget(path)
            raise
        return data.decode()

    def forget(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for path in list(self._fds):
            self.forget(path)


class PeriodicSampler(ABC):
    """Samples ``read()`` every ``interval`` seconds; ``window(t0, t1)`` is ``delta`` of the
    last samples taken at or before ``t0`` and ``t1`` plus one interval. ``read`` reads its
    files through ``files`` (closed at ``stop``)."""

    name = "sampler"

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.files = ProcFiles()
        self.times: list[float] = []
        self.samples: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    @abstractmethod
    def read(self) -> Any:
        """One reading of the counters."""

    @abstractmethod
    def delta(self, a: Any, b: Any) -> dict:
        """What changed from reading ``a`` to the later ``b``."""

    def start(self) -> "PeriodicSampler":
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()
        self.files.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        sample = self.read()
        self.times.append(time.monotonic())
        self.samples.append(sample)

    def _at(self, t: float) -> Any:
        """The last sample taken at or before ``t`` (the first one before them all)."""
        i = max(0, bisect.bisect_right(self.times, t) - 1)
        return self.samples[i] if self.samples else {}

    def window(self, t0: float, t1: float) -> dict:
        """What changed over ``[t0, t1]``, to the sampling interval's precision."""
        return self.delta(self._at(t0), self._at(t1 + self.interval))
