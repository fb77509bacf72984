"""An AutoPS pool on emulated hosts: pMaster and aggregators inside ``dlrt_bench.testbed`` hosts.

``HostPool(tb, aggregator_hosts, master_host=None)`` starts pMaster on ``master_host``
(default: the first aggregator's host, beside that aggregator) bound to the host's bridge
address, and aggregator ``agg-i`` on ``aggregator_hosts[i]``, bound to and advertising its
host's address, with the host's identity (``DLRT_HOST_ID``, set by ``Host.popen``): workers
on other hosts reach them over tcp across the shaped links, never over ipc or shared memory
(the namespaces share unix sockets and ``/dev/shm``; the distinct host identities are what
keeps ``auto`` transports off them). ``start()`` returns once every aggregator has
registered -- asked from inside the master's host, since the machine itself has no route to
the testbed. The processes are the testbed's too: its ``down()`` stops whatever is left.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from dlrt.procs import stop_processes

from .testbed import Host, Testbed

__all__ = ["HostPool", "MASTER_PORT"]

MASTER_PORT = 5555        # each emulated host has a port space of its own


class HostPool:
    """pMaster and aggregators on emulated hosts; a context manager (``start`` / ``stop``)."""

    def __init__(self, tb: Testbed, aggregator_hosts: Sequence[Host], master_host: Host | None = None,
                 log_level: str = "WARNING", master_args: Sequence[str] = ("--static",),
                 start_timeout: float = 60.0, aggregator_args: Sequence[str] = ()) -> None:
        if not aggregator_hosts:
            raise ValueError("an AutoPS pool needs at least one aggregator host")
        self.tb = tb
        self.aggregator_hosts = list(aggregator_hosts)
        self.master_host = master_host or self.aggregator_hosts[0]
        self.log_level = log_level
        self.master_args = list(master_args)
        self.aggregator_args = list(aggregator_args)
        self.start_timeout = start_timeout
        self.master = f"tcp://{self.master_host.addr}:{MASTER_PORT}"
        self.procs: list[subprocess.Popen] = []
        self.aggregators: dict[str, subprocess.Popen] = {}
        self.runtime_dir: str | None = None

    def _spawn(self, host: Host, *args: str) -> subprocess.Popen:
        env = host.env({"AUTOPS_RUNTIME_DIR": self.runtime_dir or tempfile.gettempdir()})
        proc = host.popen([sys.executable, "-m", "autops.cli", *args, "--log-level", self.log_level],
                          env=env, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def start(self) -> "HostPool":
        # unix sockets the aggregators offer (unused across hosts) live in a directory of ours
        self.runtime_dir = tempfile.mkdtemp(prefix="autops-hosts-")
        try:
            self._spawn(self.master_host, "master", "--bind", self.master, "--state-dir",
                        os.path.join(self.runtime_dir, "state"), *self.master_args)
            for i, host in enumerate(self.aggregator_hosts):
                name = f"agg-{i}"
                self.aggregators[name] = self._spawn(host, "aggregator", "--master", self.master,
                                                     "--bind", host.addr, "--name", name,
                                                     *self.aggregator_args)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def status(self, timeout: float = 5.0) -> dict:
        """pMaster's status, asked by a client in the master's host."""
        done = self.master_host.run([sys.executable, "-m", "autops.cli", "status", "--master", self.master,
                                     "--timeout", str(timeout), "--json", "-"],
                                    capture_output=True, timeout=timeout + 30)
        if done.returncode != 0:
            raise RuntimeError(f"autops status on {self.master_host.name}: "
                               f"{done.stderr.decode(errors='replace').strip()[-300:]}")
        return json.loads(done.stdout)

    def wait_ready(self) -> dict:
        """Block until every aggregator has registered; ``TimeoutError`` naming what is missing."""
        deadline = time.monotonic() + self.start_timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"pool process `autops {' '.join(proc.args[7:])}` exited with {proc.returncode}")
            try:
                status = self.status(timeout=2.0)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                last = str(exc)
            else:
                alive = [a for a in status["aggregators"] if a["alive"]]
                if len(alive) >= len(self.aggregator_hosts):
                    return status
                last = f"{len(alive)} of {len(self.aggregator_hosts)} aggregators registered"
            time.sleep(0.2)
        raise TimeoutError(f"AutoPS pool on emulated hosts did not come up within {self.start_timeout:.0f}s: {last}")

    def stop(self, timeout: float = 5.0) -> None:
        stop_processes(reversed(self.procs), timeout)      # aggregators first, pMaster last
        self.procs.clear()
        self.aggregators.clear()
        if self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            self.runtime_dir = None

    def __enter__(self) -> "HostPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
