"""Memory limits for jobs that declare their memory (``tiresias submit --memory SIZE``).

One cgroup per node of a run, under ``tiresias/`` on the cgroup v2 hierarchy when it has the
memory controller, else on the v1 ``memory`` hierarchy. The node's command joins it before it
executes (``join_self`` as the child's pre-exec step), so every page it touches is charged;
what does not fit is paged to the node's swap — an Infiniswap device when the node runs one.
The cgroup is removed when the run ends (leftover processes are killed first). Its name
(``run_cgroup_name``) carries a short hash of the run's directory, so two masters on one host
(different state dirs) never share a cgroup.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time

PARENT = "tiresias"


class CgroupError(RuntimeError):
    """No usable memory cgroup here, or a cgroup file could not be written."""


def _memory_mount() -> tuple[str, str]:
    v1 = None
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 4:
                continue
            if parts[2] == "cgroup2":
                try:
                    with open(os.path.join(parts[1], "cgroup.controllers")) as c:
                        if "memory" in c.read().split():
                            return "v2", parts[1]
                except OSError:
                    pass
            elif parts[2] == "cgroup" and "memory" in parts[3].split(","):
                v1 = parts[1]
    if v1 is None:
        raise CgroupError("no cgroup memory controller is mounted")
    return "v1", v1


def run_cgroup_name(run_dir: str, job_id: int, run: int, rank: int) -> str:
    """The cgroup of node ``rank`` of a run: ``job{id}-run{run}-node{rank}-{hash of run_dir}``."""
    owner = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:10]
    return f"job{job_id}-run{run}-node{rank}-{owner}"


def unavailable() -> str | None:
    """Why job memory limits cannot be enforced here, or None when they can."""
    if os.geteuid() != 0:
        return "memory limits need the master to run as root (cgroups)"
    try:
        _memory_mount()
    except (CgroupError, OSError) as exc:
        return str(exc)
    return None


class MemoryLimit:
    """A memory cgroup of a given size; ``create`` it, ``join_self`` in the child, ``remove``."""

    def __init__(self, path: str, version: str) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> "MemoryLimit":
        version, mount = _memory_mount()
        parent = os.path.join(mount, PARENT)
        try:
            os.makedirs(parent, exist_ok=True)
            if version == "v2":
                _enable_memory(mount, parent)
            path = os.path.join(parent, name)
            os.makedirs(path, exist_ok=True)
            limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(int(limit_bytes)))
        except OSError as exc:
            raise CgroupError(f"cannot create memory cgroup {name}: {exc}") from None
        return cls(path, version)

    @classmethod
    def existing(cls, name: str) -> "MemoryLimit | None":
        """The cgroup ``name`` under ``tiresias/`` if it exists (to remove it), else None."""
        try:
            version, mount = _memory_mount()
        except (CgroupError, OSError):
            return None
        path = os.path.join(mount, PARENT, name)
        return cls(path, version) if os.path.isdir(path) else None

    def join_self(self) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def remove(self, timeout: float = 5.0) -> None:
        """Kill what is left in the cgroup (``cgroup.kill`` on v2) and remove it."""
        kill_file = os.path.join(self.path, "cgroup.kill")
        if os.path.exists(kill_file):
            with open(kill_file, "w") as f:
                f.write("1")
        else:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise CgroupError(f"cannot remove {self.path}: {exc}") from None
                time.sleep(0.05)


def _enable_memory(mount: str, parent: str) -> None:
    """v2: the memory controller must be enabled in every ancestor's subtree_control."""
    for d in (mount, parent):
        try:
            with open(os.path.join(d, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        except OSError:
            pass
