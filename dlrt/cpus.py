"""How many CPUs this process can really use.

``os.cpu_count()`` is the machine's count; a process may be confined to fewer, by its CPU
affinity (``taskset``, cpusets) and by a cgroup's CPU quota (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, as containers set them). ``usable_cpus`` is the
smallest of those, rounded up to whole CPUs: what a service reports as its CPU capacity.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cpus", "quota_cpus"]


def quota_cpus(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
               proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 1.5), None when unlimited or unknown."""
    root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":                                   # cgroup v2
            quota = _read(root / rel / "cpu.max", root / "cpu.max")
            if quota is not None:
                fields = quota.split()
                if len(fields) == 2 and fields[0] != "max":
                    return _ratio(fields[0], fields[1])
        elif "cpu" in controllers.split(","):                   # cgroup v1
            for base in (root / controllers / rel, root / "cpu" / rel, root / "cpu,cpuacct" / rel):
                quota, period = _read(base / "cpu.cfs_quota_us"), _read(base / "cpu.cfs_period_us")
                if quota is not None and period is not None:
                    return _ratio(quota, period) if int(quota) > 0 else None
    return None


def usable_cpus() -> int:
    """CPUs this process can use: its affinity, capped by its cgroup's quota (at least 1)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = quota_cpus()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def _read(*paths: Path) -> str | None:
    for path in paths:
        try:
            return path.read_text().strip()
        except OSError:
            continue
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
