"""Identity of this host, so peers can tell whether they share a machine (ipc, shared memory)."""
from __future__ import annotations

import functools
import socket


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Hostname plus the kernel boot id: equal only for processes on the same running machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}:{boot}"
