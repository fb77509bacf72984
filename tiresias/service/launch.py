"""An embedded master on this machine: ``tiresias master`` as a child process, on 127.0.0.1.

Used by the demo, the benchmark and the tests, as ``autops.local.LocalPool`` is for AutoPS.
``stop`` ends the master (SIGTERM) and, with ``kill_jobs``, every process of the runs it
started (each supervisor's whole tree, found through the state dir) — a master's jobs
normally outlive it, which is not what a demo or a test wants.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from .client import Client
from dlrt.procs import kill_tree, signal_group

from .local import remove_run_cgroups
from .supervisor import read_json


class LocalMaster:
    def __init__(self, state: str | os.PathLike, *args: str, log: str | os.PathLike | None = None,
                 env: dict | None = None, start_timeout: float = 30.0) -> None:
        self.state = pathlib.Path(state)
        self.args = list(args)
        self.env = env
        self.log = pathlib.Path(log) if log else self.state.parent / f"{self.state.name}-master.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LocalMaster":
        self.state.mkdir(parents=True, exist_ok=True)
        address = self.state / "master.json"
        address.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "tiresias.cli", "master", "--state", str(self.state),
                                      "--bind", "127.0.0.1:0", *self.args],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while not address.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tiresias master exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"tiresias master did not start within {self.start_timeout:g} s")
            time.sleep(0.05)
        return self

    @property
    def client(self) -> Client:
        return Client.from_state(str(self.state))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self, kill_jobs: bool = True) -> None:
        self.kill(signal.SIGTERM)
        if kill_jobs:
            kill_runs(self.state)

    def __enter__(self) -> "LocalMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def kill_runs(state: pathlib.Path) -> None:
    """Kill every process of every run recorded in a local-executor state dir, and remove the
    memory cgroups of those runs (a killed supervisor cannot)."""
    for pidfile in state.glob("jobs/*/run*/supervisor.pid"):
        try:
            pid = int(pidfile.read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tiresias.service.supervisor" in f.read():
                    kill_tree(pid, include_root=True)
        except (OSError, ValueError):
            pass
    for groups in state.glob("jobs/*/run*/groups.json"):
        for pgid in (read_json(str(groups)) or {}).get("groups", []):
            signal_group(pgid, signal.SIGKILL)
    for run_dir in state.glob("jobs/*/run*"):
        problem = remove_run_cgroups(str(run_dir))
        if problem:
            print(f"kill_runs: {run_dir}: {problem}", file=sys.stderr)
