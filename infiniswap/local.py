"""Daemons as child processes on this machine, for the benchmark, tests and demos.

Owns starting ``infiniswap daemon`` subprocesses (``python -m infiniswap.cli daemon`` on a
free loopback port, or on another ``bind`` address through another ``popen``, e.g. an
emulated host's; or again on the same one after a crash: ``restart``), reading the
address each one announces, and stopping exactly those
processes by pid: SIGTERM and a bounded wait (a clean shutdown gives every slab back),
SIGKILL when asked to emulate a crash or when a daemon does not stop
(``dlrt.procs.stop_processes``).  Each daemon can run
with an emulated local memory usage (``--emulate-usage``) that ``set_usage`` changes, so
memory pressure (HeadRoom, eviction) can be caused on purpose.
"""
from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

from dlrt.procs import stop_processes

__all__ = ["DaemonProcess", "LocalDaemons"]

_READY = re.compile(r"control (?P<control>\S+) data (?P<data>\S+) pid (?P<pid>\d+)")


class DaemonProcess:
    """One ``infiniswap daemon`` child process (not started until ``start()``)."""

    def __init__(self, *, slab_size: int, capacity: int, headroom: int = 0, period: float = 0.2,
                 timeout: float = 2.0, emulate_usage: bool = True, lock: bool = False,
                 workdir: str | None = None, extra: Sequence[str] = (),
                 bind: str = "tcp://127.0.0.1:0",
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> None:
        self.slab_size, self.capacity, self.headroom = slab_size, capacity, headroom
        self.period, self.timeout = period, timeout
        self.lock = lock
        self.extra = list(extra)
        self._own_workdir = workdir is None       # removed again by stop()
        self.workdir = workdir or tempfile.mkdtemp(prefix="infiniswap-daemon-")
        self.usage_file = os.path.join(self.workdir, "usage") if emulate_usage else None
        self.proc: subprocess.Popen | None = None
        self.bind = bind                  # e.g. an emulated host's address, with its popen
        self._popen = popen
        self.address = ""
        self.data_address = ""
        self.pid = 0
        self.log_path = ""
        self.starts = 0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "infiniswap.cli", "daemon", "--bind", self.bind,
               "--slab-size", str(self.slab_size), "--capacity", str(self.capacity),
               "--headroom", str(self.headroom), "--period", str(self.period),
               "--timeout", str(self.timeout), "--exit-with-parent"]
        if not self.lock:
            cmd.append("--no-lock")
        if self.usage_file:
            cmd += ["--emulate-usage", self.usage_file]
        return cmd + self.extra

    def start(self, wait: float = 30.0) -> "DaemonProcess":
        """Start (or restart) the process; returns once it announced its address."""
        if self.running:
            raise RuntimeError(f"daemon {self.pid} is already running")
        os.makedirs(self.workdir, exist_ok=True)
        if self.usage_file and not os.path.exists(self.usage_file):
            self.set_usage(0)
        self.starts += 1
        self.log_path = os.path.join(self.workdir, f"daemon.{self.starts}.log")
        with open(self.log_path, "wb") as log:
            self.proc = self._popen(self.command(), stdout=subprocess.PIPE, stderr=log,
                                    stdin=subprocess.DEVNULL)
        line = self._ready_line(wait)
        m = _READY.search(line)
        if m is None:
            self.kill()
            raise RuntimeError(f"unexpected first line from the daemon: {line!r}")
        self.address, self.data_address, self.pid = m["control"], m["data"], int(m["pid"])
        return self

    def restart(self, wait: float = 30.0) -> "DaemonProcess":
        """Start a new incarnation (fresh memory) at the control address of the last one, as
        a supervisor restarts a crashed daemon: devices that know the address find it again."""
        if not self.address:
            raise RuntimeError("the daemon never started: nothing to restart")
        self.bind = self.address
        return self.start(wait)

    def _ready_line(self, wait: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline().decode("utf-8", "replace")
                if line:
                    return line
            if self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"the daemon did not start within {wait:g} s; its log "
                           f"({self.log_path}) ends with:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def set_usage(self, nbytes: int) -> None:
        """Emulated memory used by everything else on the daemon's machine."""
        if not self.usage_file:
            raise RuntimeError("this daemon does not emulate its memory usage")
        tmp = self.usage_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(int(nbytes)))
        os.replace(tmp, self.usage_file)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to this daemon (if running) and, for SIGKILL, reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)
            self._close_pipe()

    def stop(self, wait: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``wait`` s, then SIGKILL; returns the exit status.  Removes the
        working directory (logs, usage file) if this object created it."""
        try:
            return self._stop(wait)
        finally:
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop(self, wait: float) -> int | None:
        if self.proc is None:
            return None
        stop_processes([self.proc], wait)
        self._close_pipe()
        return self.proc.returncode

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def cpu_seconds(self) -> float:
        """User + system CPU time of the daemon process so far (all its threads)."""
        import psutil
        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system


class LocalDaemons:
    """``n`` daemon processes, all stopped (by pid) on ``stop()`` / leaving the ``with``."""

    def __init__(self, n: int, **kwargs: object) -> None:
        self.daemons = [DaemonProcess(**kwargs) for _ in range(n)]  # type: ignore[arg-type]

    def start(self) -> "LocalDaemons":
        try:
            for d in self.daemons:
                d.start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self.daemons]

    def __getitem__(self, i: int) -> DaemonProcess:
        return self.daemons[i]

    def __len__(self) -> int:
        return len(self.daemons)

    def stop(self) -> list[int | None]:
        return [d.stop() for d in self.daemons]

    def __enter__(self) -> "LocalDaemons":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
