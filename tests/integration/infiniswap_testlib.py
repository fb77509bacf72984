"""Helpers shared by the Infiniswap integration tests: polling with a deadline, and a thread
that keeps a device busy and checks every page it reads back."""
from __future__ import annotations

import time


def wait_until(cond, timeout: float, what: str, step: float = 0.02) -> None:
    """Poll ``cond()`` every ``step`` seconds; fail the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class PageChurn:
    """A thread that writes and reads random page ranges of ``dev`` (keeping its slabs hot)
    and checks every read against its own model of the device; ``reads`` counts the reads
    checked, ``errors`` names any mismatch (the thread then stops)."""

    def __init__(self, dev, pages: int, seed: int = 0, page: int = 4096) -> None:
        import random
        import threading

        self._dev, self._pages, self._page = dev, pages, page
        self._rng = random.Random(seed)
        self.model = bytearray(pages * page)
        self.reads = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="page-churn", daemon=True)

    def start(self) -> "PageChurn":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _range(self) -> tuple[int, int]:
        first = self._rng.randrange(self._pages)
        return first, min(self._rng.randint(1, 16), self._pages - first)

    def _run(self) -> None:
        p = self._page
        try:
            while not self._stop.is_set():
                first, n = self._range()
                data = self._rng.randbytes(n * p)
                self._dev.write(first * p, data)
                self.model[first * p:(first + n) * p] = data
                first, n = self._range()
                got = self._dev.read(first * p, n * p)
                if got != self.model[first * p:(first + n) * p]:
                    bad = next(i for i in range(n) if got[i * p:(i + 1) * p] !=
                               self.model[(first + i) * p:(first + i + 1) * p])
                    self.errors.append(f"page {first + bad} read back wrong after "
                                       f"{self.reads} good reads")
                    return
                self.reads += 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"I/O failed: {exc!r}")
