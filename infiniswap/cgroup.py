"""Memory-limited containers for ``infiniswap run`` (thesis §2.3.2: the container model).

A ``MemoryCgroup`` is one cgroup with a memory limit, on the cgroup v2 unified hierarchy when
its memory controller is available, else on the v1 ``memory`` hierarchy. A command started
with ``run_limited`` joins it before it executes (so every page it touches is charged) and
pages to whatever swap is active -- our device when ``infiniswap device --swap`` runs.
The cgroup is removed when the command has exited, also when it failed; leftover processes
of the command in it are killed first. The Infiniswap processes themselves are never put
into it: the device must not page into itself.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

PARENT = "infiniswap"


class CgroupError(RuntimeError):
    """No usable memory cgroup (not root, no controller) or a cgroup file could not be written."""


def _mounts() -> list[tuple[str, str, list[str]]]:
    out = []
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[1], parts[2], parts[3].split(",")))
    return out


def find_hierarchy() -> tuple[str, str]:
    """(version, mount point) of the memory controller: ("v2", path) or ("v1", path)."""
    for point, fstype, _ in _mounts():
        if fstype == "cgroup2":
            try:
                with open(os.path.join(point, "cgroup.controllers")) as f:
                    if "memory" in f.read().split():
                        return "v2", point
            except OSError:
                continue
    for point, fstype, opts in _mounts():
        if fstype == "cgroup" and "memory" in opts:
            return "v1", point
    raise CgroupError("no cgroup memory controller is mounted (need cgroup v2 with the memory "
                      "controller, or the v1 memory hierarchy)")


def available() -> str | None:
    """None when memory cgroups can be created here, else the reason why not."""
    if os.geteuid() != 0:
        return "creating memory cgroups needs root"
    try:
        find_hierarchy()
    except CgroupError as exc:
        return str(exc)
    return None


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@dataclass
class MemoryCgroup:
    """One memory-limited cgroup; ``create`` makes it, ``remove`` deletes it."""

    path: str
    version: str

    @classmethod
    def create(cls, limit: int, name: str | None = None, swappiness: int | None = None) -> "MemoryCgroup":
        if limit < 1 << 20:
            raise CgroupError(f"memory limit {limit} is below 1 MiB")
        version, root = find_hierarchy()
        parent = os.path.join(root, PARENT)
        os.makedirs(parent, exist_ok=True)
        if version == "v2":
            try:
                _write(os.path.join(root, "cgroup.subtree_control"), "+memory")
                _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
            except CgroupError:
                pass          # already enabled, or delegated differently: the limit write tells
        path = os.path.join(parent, name or f"run-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        os.mkdir(path)
        group = cls(path, version)
        try:
            if version == "v2":
                _write(os.path.join(path, "memory.max"), str(limit))
            else:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
                if swappiness is not None:
                    _write(os.path.join(path, "memory.swappiness"), str(swappiness))
        except BaseException:
            group.remove()
            raise
        return group

    def procs(self) -> list[int]:
        try:
            return [int(p) for p in _read(os.path.join(self.path, "cgroup.procs")).split()]
        except OSError:
            return []

    def join(self, pid: int = 0) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), str(pid or os.getpid()))

    def stats(self) -> dict[str, int]:
        """Peak memory and the memory.stat counters (bytes / events)."""
        out: dict[str, int] = {}
        try:
            for line in _read(os.path.join(self.path, "memory.stat")).splitlines():
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
            peak = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
            if os.path.exists(os.path.join(self.path, peak)):
                out["peak_bytes"] = int(_read(os.path.join(self.path, peak)).strip())
        except (OSError, ValueError):
            pass
        return out

    def remove(self, timeout: float = 10.0) -> None:
        """Kill what is left inside (SIGKILL by pid), then delete the cgroup."""
        deadline = time.monotonic() + timeout
        while os.path.isdir(self.path):
            for pid in self.procs():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.path)
                try:
                    os.rmdir(os.path.dirname(self.path))   # the parent too, when no other run uses it
                except OSError:
                    pass
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise CgroupError(f"cannot remove {self.path}: processes {self.procs()} stay in it")
                time.sleep(0.05)


def run_limited(cmd: Sequence[str], limit: int, swappiness: int | None = None,
                env: dict | None = None) -> tuple[int, dict[str, int]]:
    """Run ``cmd`` inside a new cgroup limited to ``limit`` bytes; (exit status, stats)."""
    group = MemoryCgroup.create(limit, swappiness=swappiness)
    try:
        procs_file = os.path.join(group.path, "cgroup.procs")

        def enter() -> None:              # in the child, before exec: charged from its first page
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.Popen(list(cmd), preexec_fn=enter, env=env)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            rc = proc.wait()
        return rc, group.stats()
    finally:
        group.remove()
