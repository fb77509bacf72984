"""A counter sampler for the benchmarks: reads some counters every ``interval`` seconds on a
thread, from ``start`` to ``stop``, and says afterwards what changed over a time window
(``time.monotonic``, the clock every process on the machine shares). Subclasses say what
they read (``read``) and how two readings differ (``delta``)."""
from __future__ import annotations

import bisect
import threading
from abc import ABC, abstractmethod
import time
from typing import Any


class PeriodicSampler(ABC):
    """Samples ``read()`` every ``interval`` seconds; ``window(t0, t1)`` is ``delta`` of the
    last samples taken at or before ``t0`` and ``t1`` plus one interval."""

    name = "sampler"

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
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
