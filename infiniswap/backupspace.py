"""Does a device's backup file fit on its disk?

The backup file is created sparse (``ftruncate`` to the device size), so a size beyond the
file system's free space is only noticed when a disk write fails: as swap, a page the
kernel wrote out is then lost. ``backup_shortfall`` compares the size with the space
available to the file (the file system's available blocks, plus what an existing file at
that path holds, since opening the backup truncates it); ``infiniswap device`` refuses
such a size with ``--swap`` and warns without it.
"""
from __future__ import annotations

import os
import stat

from dlrt.sizes import format_size

__all__ = ["available_for", "backup_shortfall"]


def available_for(path: str | os.PathLike[str]) -> int | None:
    """Bytes a backup file at ``path`` can hold on its file system, or None when it cannot
    be told (the directory does not exist: creating the file reports that)."""
    path = os.path.abspath(os.fspath(path))
    try:
        fs = os.statvfs(os.path.dirname(path))
    except OSError:
        return None
    free = fs.f_bavail * fs.f_frsize
    try:
        st = os.stat(path)
    except OSError:
        return free
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        free += st.st_blocks * 512                 # freed when the device truncates it
    return free


def backup_shortfall(path: str | os.PathLike[str], size: int) -> str | None:
    """None when ``size`` bytes of backup file fit at ``path``, else one line saying not."""
    free = available_for(path)
    if free is None or size <= free:
        return None
    return (f"--size {format_size(size)} exceeds the {format_size(free)} available for the backup "
            f"file {os.fspath(path)} on its file system")
