"""The machine's memory in use, read from ``/proc/meminfo`` through a descriptor opened once.

This module owns that descriptor.  The daemon's memory monitor reads it every period with
``os.pread`` (procfs makes the text anew at offset 0), so the monitor keeps seeing memory
pressure when the process has no descriptor left to open a file with (a flood of
connections took them all); ``psutil.virtual_memory()`` opens the file on every call.
``parse_meminfo`` is the pure part: the text to (total, available) bytes, ``MemAvailable``
being what ``psutil`` and ``free`` report as available.
"""
from __future__ import annotations

import os

__all__ = ["MemInfo", "parse_meminfo"]

_READ = 1 << 16             # /proc/meminfo is about 1.5 KiB


def parse_meminfo(text: bytes) -> tuple[int, int]:
    """``(MemTotal, MemAvailable)`` in bytes from ``/proc/meminfo``'s text; ``ValueError``
    when either is missing or garbled (kernels before 3.14 have no MemAvailable)."""
    found: dict[bytes, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(b":")
        if name in (b"MemTotal", b"MemAvailable"):
            fields = rest.split()
            if len(fields) != 2 or fields[1] != b"kB" or not fields[0].isdigit():
                raise ValueError(f"garbled /proc/meminfo line: {line!r}")
            found[name] = int(fields[0]) * 1024
    if len(found) != 2:
        raise ValueError("/proc/meminfo has no MemTotal or no MemAvailable")
    return found[b"MemTotal"], found[b"MemAvailable"]


class MemInfo:
    """``/proc/meminfo`` (or ``path``), opened now and read again by each ``used()``.
    ``OSError`` / ``ValueError`` when it cannot be opened or parsed; ``close()`` when done."""

    def __init__(self, path: str = "/proc/meminfo") -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.used()
        except BaseException:
            self.close()
            raise

    def used(self) -> int:
        """Bytes in use on the machine now: total less available."""
        if self._fd < 0:
            raise ValueError("MemInfo is closed")
        total, available = parse_meminfo(os.pread(self._fd, _READ, 0))
        return max(0, total - available)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
