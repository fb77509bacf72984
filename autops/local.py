"""An embedded pool on this machine: one pMaster and N aggregator processes on loopback.

Used by ``autops local``, ``make demo``, the benchmarks and the integration tests.
Children are started as separate processes and stopped by pid (SIGTERM, then SIGKILL,
``dlrt.procs.stop_processes``), also when the caller fails. pMaster keeps its state (the
live jobs' secret hashes, and the records of the aggregators its local provider starts) in
the pool's runtime directory, so it survives ``kill_master`` and ``start_master`` and goes
with the pool. Aggregators outlive a pMaster that dies; ``stop`` also stops the ones a killed
pMaster left behind, found by their records (``poolfiles``). The processes share this
process's key directory (``$DLRT_KEYS``): the cluster key and operator token are made there
on the first start.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from dlrt.curve import Security, default_security
from dlrt.keys import Keys
from dlrt.procs import die_with_parent, stop_processes

from .config import RUNTIME_DIR_ENV
from .master import poolfiles
from .admin import query_status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPool:
    """Context manager: ``with LocalPool(2) as pool: pool.master`` is the address to use.
    ``pool.security`` is what a client of this pool applies to its sockets (the key directory
    ``env`` names in ``DLRT_KEYS``, else this process's)."""

    def __init__(self, aggregators: int = 2, start_timeout: float = 30.0, log_level: str = "WARNING",
                 env: dict | None = None, master_args: list[str] | None = None,
                 aggregator_args: list[str] | None = None) -> None:
        self.n = aggregators
        self.start_timeout = start_timeout
        self.log_level = log_level
        self.master = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []
        # unix sockets of this pool live in a directory removed on stop, also after a SIGKILL
        self.runtime_dir = tempfile.mkdtemp(prefix="autops-pool-")
        self.env = {**os.environ, RUNTIME_DIR_ENV: self.runtime_dir, **(env or {})}
        keys = (env or {}).get("DLRT_KEYS")
        self.security: Security = Security(Keys.load(keys)) if keys else default_security()
        self.master_args = list(master_args or [])
        given = self.master_args.index("--state-dir") + 1 if "--state-dir" in self.master_args else None
        self.state_dir = self.master_args[given] if given else os.path.join(self.runtime_dir, "state")
        self.aggregator_args = list(aggregator_args or [])
        self.aggregators: dict[str, subprocess.Popen] = {}

    def _spawn(self, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "autops.cli", *args, "--log-level", self.log_level],
                                env=self.env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self.procs.append(proc)
        return proc

    def start(self) -> "LocalPool":
        try:
            self.start_master()
            for i in range(self.n):
                self.add_aggregator(f"agg-{i}")
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> subprocess.Popen:
        """Start pMaster at ``self.master`` (again, after ``kill_master``)."""
        state = [] if "--state-dir" in self.master_args else ["--state-dir", self.state_dir]
        proc = self._spawn("master", "--bind", self.master, *state, *self.master_args)
        self.procs.insert(0, self.procs.pop())       # stopped last
        return proc

    def kill_master(self) -> None:
        """SIGKILL pMaster (a failure, for tests and benchmarks) and reap it."""
        proc = self.procs.pop(0)
        proc.kill()
        proc.wait()

    def add_aggregator(self, name: str) -> subprocess.Popen:
        """Start one more aggregator process named ``name`` (it registers by itself)."""
        proc = self._spawn("aggregator", "--master", self.master, "--name", name, "--bind-host", "127.0.0.1",
                           *self.aggregator_args)
        self.aggregators[name] = proc
        return proc

    def kill_aggregator(self, name: str) -> None:
        """SIGKILL aggregator ``name`` (a failure, for tests and benchmarks) and reap it."""
        proc = self.aggregators.pop(name)
        proc.kill()
        proc.wait()
        self.procs.remove(proc)

    def reap(self) -> list[subprocess.Popen]:
        """Collect the pool's processes that exited (no zombies); returns them."""
        return [proc for proc in self.procs if proc.poll() is not None]

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + self.start_timeout
        last = None
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"pool process {proc.args[3:-2]} exited with {proc.returncode}")
            try:
                status = query_status(self.master, timeout=1.0, security=self.security)
                alive = [a for a in status["aggregators"] if a["alive"]]
                if len(alive) >= self.n:
                    return status
                last = f"{len(alive)} of {self.n} aggregators registered"
            except Exception as exc:  # master not up yet
                last = str(exc)
            time.sleep(0.1)
        raise TimeoutError(f"local pool did not come up within {self.start_timeout:.0f}s: {last}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the pool's processes: aggregators first, pMaster last (it stops the ones it
        started), then those a killed pMaster left behind."""
        stop_processes(reversed(self.procs), timeout)
        self.procs.clear()
        poolfiles.stop_recorded(self.state_dir, timeout)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def status(self) -> dict:
        return query_status(self.master, security=self.security)

    def __enter__(self) -> "LocalPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
