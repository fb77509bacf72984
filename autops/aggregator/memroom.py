"""How much memory an aggregator can really give a job (docs/autops.md, "Limits on what a peer
can make an aggregator hold").

The host's ``MemAvailable`` is not enough: in a memory cgroup (a container, a systemd slice)
the process is OOM-killed at the cgroup's limit long before the host runs short. What it can
give is the least of the host's ``MemAvailable`` and, for its cgroup and every ancestor with a
limit, that limit minus the cgroup's usage (cgroup v2 ``memory.max``/``memory.current``, v1
``memory.limit_in_bytes``/``memory.usage_in_bytes``); plus what the process holds ready for
jobs (free heap, the reserve); less a headroom it keeps for itself and the declared bytes it has
committed to jobs and not yet touched (allocation is lazy: a declared buffer takes memory only
as it is written, so until then the host's figures do not show it).

``room`` is the pure computation (unit-tested with injected figures); ``cgroup_room`` and
``mem_available`` read this machine's."""
from __future__ import annotations

import os

__all__ = ["room", "cgroup_room", "mem_available", "available", "DEFAULT_HEADROOM"]

DEFAULT_HEADROOM = 64 << 20     # kept for the aggregator itself: messages in flight, its own heap
_UNLIMITED = 1 << 60            # cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def room(mem_available: int, cgroup_free: int | None = None, ready: int = 0, headroom: int = 0,
         committed: int = 0, touched: int = 0) -> int:
    """Bytes a new declaration may still take (never below 0): the least of ``mem_available``
    (the host's ``MemAvailable``) and ``cgroup_free`` (the cgroups' limit less usage; None:
    no limit), plus ``ready`` (held ready for jobs), less ``headroom`` and the part of
    ``committed`` (bytes promised to jobs) not yet ``touched`` (already counted as used)."""
    free = mem_available if cgroup_free is None else min(mem_available, cgroup_free)
    outstanding = max(0, committed - max(0, touched))
    return max(0, free + ready - headroom - outstanding)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _chain(mount: str, path: str) -> list[str]:
    """The cgroup directories from ``path`` (under ``mount``) up to the mount point; where the
    path is not there (a container sees its cgroup as the mount's root), the mount point."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [os.path.join(mount, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)] or [mount]


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The least ``limit - usage`` over this process's memory cgroup and its ancestors (v2,
    else v1); None when no cgroup limits memory."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: int | None = None

    def consider(limit: int | None, usage: int | None) -> None:
        nonlocal best
        if limit is None or limit >= _UNLIMITED or usage is None:
            return
        free = max(0, limit - usage)
        best = free if best is None else min(best, free)

    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":                        # v2 (unified)
            if not os.path.exists(os.path.join(root, "cgroup.controllers")):
                continue
            for d in _chain(root, path):
                consider(_read_int(os.path.join(d, "memory.max")), _read_int(os.path.join(d, "memory.current")))
        elif "memory" in controllers.split(","):                    # v1
            mount = os.path.join(root, "memory")
            for d in _chain(mount, path):
                consider(_read_int(os.path.join(d, "memory.limit_in_bytes")),
                         _read_int(os.path.join(d, "memory.usage_in_bytes")))
    return best


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """The host's ``MemAvailable`` in bytes (psutil's figure where the file cannot be read)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil
    return int(psutil.virtual_memory().available)


def available() -> int:
    """What this machine can give now, before what the process holds ready and its commitments:
    the least of ``MemAvailable`` and the cgroups' free bytes."""
    return room(mem_available(), cgroup_room())
