"""Test helpers: a real ``tiresias master`` process on 127.0.0.1 and its clean-up.

``MasterProcess`` starts the master with the local executor, waits for its address file,
and on ``stop`` terminates the master and every process of the runs it started (their
supervisors and process groups, found in the state dir), so no test leaves a job behind.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tiresias.service.client import Client
from tiresias.service.supervisor import kill_tree

BIN = pathlib.Path(sys.executable).parent
JOBS = pathlib.Path(__file__).with_name("tiresias_jobs")


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class MasterProcess:
    def __init__(self, state: pathlib.Path, *args: str, env: dict | None = None) -> None:
        self.state = state
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.log = state.parent / f"{state.name}-master.log"

    def start(self) -> "MasterProcess":
        self.state.mkdir(parents=True, exist_ok=True)
        try:
            (self.state / "master.json").unlink()
        except FileNotFoundError:
            pass
        self.proc = subprocess.Popen([str(BIN / "tiresias"), "master", "--state", str(self.state),
                                      "--bind", "127.0.0.1:0", *self.args],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        wait_for(lambda: (self.state / "master.json").exists() or self.proc.poll() is not None,
                 30, "the master's address file")
        if self.proc.poll() is not None:
            raise AssertionError(f"master exited {self.proc.returncode}:\n{self.log.read_text()}")
        return self

    @property
    def client(self) -> Client:
        return Client.from_state(str(self.state))

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "tiresias"), *args[:1], "--state", str(self.state), *args[1:]],
                              capture_output=True, text=True, timeout=timeout)

    def submit(self, gpus: int, *command: str, name: str = "job", **extra) -> int:
        spec = {"gpus": gpus, "name": name, "command": list(command), "launcher": "plain", **extra}
        return self.client.post("/api/v1/jobs", spec)["id"]

    def job(self, job_id: int) -> dict:
        return self.client.get(f"/api/v1/jobs/{job_id}")

    def wait_status(self, job_id: int, statuses, timeout: float = 60.0) -> dict:
        statuses = {statuses} if isinstance(statuses, str) else set(statuses)
        return wait_for(lambda: (j := self.job(job_id))["status"] in statuses and j, timeout,
                        f"job {job_id} to be {'/'.join(sorted(statuses))}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop the master and everything its runs started."""
        self.kill(signal.SIGTERM)
        for pidfile in self.state.glob("jobs/*/run*/supervisor.pid"):
            pid = int(pidfile.read_text())
            if _is_supervisor(pid):
                kill_tree(pid, include_root=True)
        for groups in self.state.glob("jobs/*/run*/groups.json"):
            try:
                record = json.loads(groups.read_text())
            except ValueError:
                continue
            for pgid in record.get("groups", []):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _is_supervisor(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"tiresias.service.supervisor" in f.read()
    except OSError:
        return False


def counter(total: int, pause: float, *flags: str) -> list[str]:
    return [sys.executable, str(JOBS / "counter.py"), str(total), str(pause), *flags]


def steps(state: pathlib.Path, job_id: int) -> list[int]:
    path = state / "checkpoints" / str(job_id) / "checkpoint" / "steps.log"
    return [int(x) for x in path.read_text().split()] if path.exists() else []
