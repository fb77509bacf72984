"""The state disk's free space: the floor below which submits are refused (policy) and a probe.

``floor(total, configured)``: the configured ``--min-free-bytes``, or by default the smaller of
256 MiB and 5% of the filesystem. 256 MiB holds SQLite's WAL growth and several jobs' log
rotations on a big disk; on a small one (a 4 GiB root, a test's 64 MiB tmpfs) a fixed 256 MiB
would be most of the disk, and 5% still leaves the master room for its own writes.
``check(path, floor_bytes)`` answers None or a one-line refusal naming the path, the free
bytes and the option.
"""
from __future__ import annotations

import os

DEFAULT_FLOOR_BYTES = 256 << 20
DEFAULT_FLOOR_FRACTION = 0.05


def floor(total_bytes: int, configured: int | None = None) -> int:
    """The free-space floor for a filesystem of ``total_bytes`` (``configured``: the option, 0: off)."""
    if configured is not None:
        return configured
    return min(DEFAULT_FLOOR_BYTES, int(total_bytes * DEFAULT_FLOOR_FRACTION))


def usage(path: str) -> tuple[int, int]:
    """(free bytes an unprivileged writer may use, total bytes) of the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check(path: str, configured: int | None = None) -> str | None:
    """None when ``path``'s filesystem has at least the floor free, else the refusal."""
    try:
        free, total = usage(path)
    except OSError:
        return None                                  # cannot tell: do not refuse on a guess
    need = floor(total, configured)
    if need and free < need:
        return (f"the state disk {path} has {free} bytes free, below the floor of {need} bytes "
                f"(--min-free-bytes); submits are refused until space is freed")
    return None
