"""Remote-memory paging end to end on this machine: the building blocks the Infiniswap demo
(``examples/infiniswap_demo.py``), the e2e tests and the benchmarks share.


* :class:`Stack` — daemons (``LocalDaemons``) + :class:`~infiniswap.device.Device` (backup
  file on disk, never tmpfs) + :class:`~infiniswap.frontend.Frontend` (FUSE, loop, swap);
  ``stop()`` undoes everything in reverse order.
* :class:`DiskSwap` — a plain loop device (direct I/O) on a file on local disk, optionally
  swap: the peer to compare with.
* :class:`Watchdog` — kills (SIGKILL, by pid) a workload whose progress counters stopped
  moving for ``stall`` seconds: a paging deadlock fails a test instead of hanging it.
* :func:`run_limited_watched` — a command in a new memory cgroup under a watchdog.
* :func:`workload_cmd` / :func:`parse_workload` — the self-checking application
  (``python -m dlrt_bench.workload``) and its JSON result line.

``missing()`` says why the full stack cannot run here (not root, no FUSE, ...).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

MiB = 1 << 20
DISK_DIR = "/var/tmp"            # backup files and disk swap files: a disk file system


def missing() -> str | None:
    """None when the full stack can run here, else the reason."""
    if sys.platform != "linux":
        return "Linux only"
    if os.geteuid() != 0:
        return "needs root (FUSE mount, losetup, swapon, memory cgroups)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    for tool in ("losetup", "mkswap", "swapon", "swapoff"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux)"
    from infiniswap import cgroup
    why = cgroup.available()
    if why:
        return why
    try:
        from infiniswap.core import FuseServer  # noqa: F401
    except ImportError as exc:
        return f"the C core has no FUSE front end: {exc}"
    return None


def active_swaps() -> list[str]:
    with open("/proc/swaps", encoding="utf-8") as fh:
        return [line.split()[0] for line in fh.readlines()[1:] if line.strip()]


def vmstat_swap() -> tuple[int, int]:
    vals = {}
    with open("/proc/vmstat", encoding="ascii") as fh:
        for line in fh:
            k, _, v = line.partition(" ")
            if k in ("pswpin", "pswpout"):
                vals[k] = int(v)
    return vals.get("pswpin", 0), vals.get("pswpout", 0)


def _sh(cmd: Sequence[str], timeout: float = 120) -> str:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


class Stack:
    """``daemons`` daemon processes + a device of ``size`` bytes in ``slab_size`` slabs
    (backup file under ``DISK_DIR``) + its front end (FUSE file, loop device, swap)."""

    def __init__(self, size: int, slab_size: int = 16 * MiB, daemons: int = 2, *,
                 daemon_capacity: int | None = None, loop: bool = True, swap: bool = False,
                 swap_priority: int | None = None, period: float = 0.2,
                 hot_slab: float = 20.0, lock: bool = True) -> None:
        self.size, self.slab_size, self.n = size, slab_size, daemons
        self.capacity = daemon_capacity or size
        self.loop, self.swap, self.swap_priority = loop, swap, swap_priority
        self.period, self.hot_slab, self.lock = period, hot_slab, lock
        self.workdir = ""
        self.daemons: Any = None
        self.device: Any = None
        self.frontend: Any = None

    @property
    def loop_device(self) -> str:
        return self.frontend.loop_device

    @property
    def mount(self) -> str:
        return os.path.join(self.workdir, "mnt")

    def start(self) -> "Stack":
        from infiniswap.device import Device
        from infiniswap.frontend import Frontend
        from infiniswap.local import LocalDaemons
        self.workdir = tempfile.mkdtemp(prefix="infiniswap-stack-", dir=DISK_DIR)
        try:
            if self.n:
                self.daemons = LocalDaemons(self.n, slab_size=self.slab_size,
                                            capacity=self.capacity, headroom=0,
                                            period=self.period, timeout=2.0,
                                            lock=self.lock).start()
            self.device = Device(self.size, os.path.join(self.workdir, "backup"),
                                 self.daemons.addresses if self.daemons else [],
                                 slab_size=self.slab_size, period=self.period,
                                 hot_slab=self.hot_slab, timeout=1.0)
            self.frontend = Frontend(self.device, self.mount, loop=self.loop or self.swap,
                                     swap=self.swap, swap_priority=self.swap_priority,
                                     fsname=f"infiniswap-{os.getpid()}").start()
        except BaseException:
            self.stop()
            raise
        return self

    def stats(self) -> dict[str, Any]:
        return self.device.stats()

    def progress(self) -> int:
        """A counter that grows while pages move: FUSE requests served + pswpin + pswpout."""
        n = sum(vmstat_swap())
        fe = self.frontend
        if fe is not None and fe.fuse is not None:
            st = fe.fuse.stats()
            n += st.reads + st.writes
        return n

    def stop(self) -> None:
        from infiniswap.frontend import SwapStillActive
        try:
            if self.frontend is not None:
                for attempt in range(20):
                    try:
                        self.frontend.stop()
                        break
                    except SwapStillActive:
                        if attempt == 19:
                            raise
                        time.sleep(1)
                self.frontend = None
        finally:
            try:
                if self.device is not None:
                    self.device.close()
                    self.device = None
            finally:
                if self.daemons is not None:
                    self.daemons.stop()
                    self.daemons = None
                if self.workdir:
                    shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class DiskSwap:
    """A loop device (direct I/O, 4 KiB sectors) on a ``size``-byte file on local disk;
    ``swap=True`` also makes it the swap area.  ``stop()`` undoes it."""

    def __init__(self, size: int, swap: bool = False) -> None:
        self.size, self.swap = size, swap
        self.path = ""
        self.loop_device = ""
        self.swap_on = False

    def start(self) -> "DiskSwap":
        fd, self.path = tempfile.mkstemp(prefix="infiniswap-diskswap-", dir=DISK_DIR)
        try:
            os.posix_fallocate(fd, 0, self.size)
            os.close(fd)
            self.loop_device = _sh(["losetup", "--find", "--show", "--direct-io=on",
                                    "--sector-size", "4096", self.path]).strip()
            if self.swap:
                _sh(["mkswap", self.loop_device])
                _sh(["swapon", self.loop_device])
                self.swap_on = True
        except BaseException:
            self.stop()
            raise
        return self

    def progress(self) -> int:
        return sum(vmstat_swap())

    def stop(self) -> None:
        if self.swap_on:
            _sh(["swapoff", self.loop_device], timeout=600)
            self.swap_on = False
        if self.loop_device:
            _sh(["losetup", "-d", self.loop_device])
            self.loop_device = ""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = ""

    def __enter__(self) -> "DiskSwap":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Watchdog(threading.Thread):
    """Every second read ``progress()``; when it has not changed for ``stall`` seconds while
    ``pids()`` are alive, SIGKILL them (by pid) and set ``fired`` to the reason."""

    def __init__(self, progress: Callable[[], int], pids: Callable[[], list[int]],
                 stall: float = 30.0, what: str = "workload") -> None:
        super().__init__(daemon=True, name="infiniswap-watchdog")
        self.progress, self.pids, self.stall, self.what = progress, pids, stall, what
        self.fired = ""
        self._halt = threading.Event()

    def run(self) -> None:
        last, since = None, time.monotonic()
        while not self._halt.wait(1.0):
            try:
                now = self.progress()
            except Exception:                  # a counter source going away: no progress
                now = last
            if now != last:
                last, since = now, time.monotonic()
                continue
            if time.monotonic() - since >= self.stall:
                pids = self.pids()
                self.fired = (f"no paging progress for {self.stall:g} s: {self.what} "
                              f"(pids {pids}) killed by the watchdog — deadlock?")
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def __enter__(self) -> "Watchdog":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_watched(cmd: Sequence[str], progress: Callable[[], int], stall: float = 30.0,
                timeout: float | None = None) -> tuple[int, str, str, str]:
    """Run ``cmd`` (no cgroup) under a watchdog: (status, stdout, stderr, watchdog reason)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with Watchdog(progress, lambda: [proc.pid] if proc.poll() is None else [], stall,
                  cmd[0]) as dog:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return -9, out, err, f"timed out after {timeout:g} s"
    return proc.returncode, out, err, dog.fired


def run_limited_watched(cmd: Sequence[str], limit: int, progress: Callable[[], int],
                        stall: float = 30.0, timeout: float | None = None,
                        swappiness: int | None = 100) -> dict[str, Any]:
    """``cmd`` in a new memory cgroup (as :func:`infiniswap.cgroup.run_limited`) under a
    watchdog and an optional timeout.  Returns rc, stdout, stderr, seconds, cgroup stats,
    ``watchdog`` (reason or ""), ``timed_out``; the cgroup is removed in all cases."""
    from infiniswap.cgroup import MemoryCgroup
    group = MemoryCgroup.create(limit, swappiness=swappiness)
    result: dict[str, Any] = {"timed_out": False}
    try:
        procs_file = os.path.join(group.path, "cgroup.procs")

        def enter() -> None:
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))

        t0 = time.monotonic()
        proc = subprocess.Popen(list(cmd), preexec_fn=enter, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

        def pids() -> list[int]:
            return group.procs() or ([proc.pid] if proc.poll() is None else [])

        with Watchdog(progress, pids, stall, os.path.basename(cmd[0])) as dog:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for pid in pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                out, err = proc.communicate()
                result["timed_out"] = True
        result.update(rc=proc.returncode, stdout=out, stderr=err,
                      seconds=time.monotonic() - t0, stats=group.stats(), watchdog=dog.fired)
        return result
    finally:
        group.remove()


def workload_cmd(mib: int, rounds: int = 2, sort_mib: int = 0) -> list[str]:
    """The command line of the self-checking workload (``dlrt_bench.workload``)."""
    cmd = [sys.executable, "-m", "dlrt_bench.workload", "--mib", str(mib), "--rounds", str(rounds)]
    return cmd + (["--sort-mib", str(sort_mib)] if sort_mib else [])


def parse_workload(out: str) -> dict[str, Any] | None:
    """The workload's JSON result: the last line of ``out`` that is JSON (None if none)."""
    for line in reversed(out.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None
