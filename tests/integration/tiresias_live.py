"""Test helpers around a real ``tiresias master`` process on 127.0.0.1 (``LocalMaster``).

``MasterProcess`` adds what tests ask of a master: submitting, waiting for a job's status,
running the CLI against it. ``stop`` (inherited) ends the master and every process of the
runs it started, so no test leaves a job behind.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

from tiresias.service.launch import LocalMaster
from waiting import wait_for  # noqa: F401 (the live tests import it from here)

BIN = pathlib.Path(sys.executable).parent
JOBS = pathlib.Path(__file__).with_name("tiresias_jobs")


class MasterProcess(LocalMaster):
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


def counter(total: int, pause: float, *flags: str) -> list[str]:
    return [sys.executable, str(JOBS / "counter.py"), str(total), str(pause), *flags]


def steps(state: pathlib.Path, job_id: int) -> list[int]:
    path = state / "checkpoints" / str(job_id) / "checkpoint" / "steps.log"
    return [int(x) for x in path.read_text().split()] if path.exists() else []
