"""Every child of a live ``tiresias master`` is reaped (DESIGN §6): after dozens of short
runs, no zombie whose parent is the master is left (the local executor's supervisors)."""
from __future__ import annotations

import os

import pytest

from tiresias_live import MasterProcess, wait_for

pytestmark = pytest.mark.timeout(120)
JOBS = 50


def zombie_children(pid: int) -> list[int]:
    """Pids in state Z whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue                                   # gone meanwhile
        if fields[0] == "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def test_fifty_finished_runs_leave_no_zombie(tmp_path):
    with MasterProcess(tmp_path / "state", "--nodes", "2x4", "--interval", "0.2") as m:
        ids = [m.submit(1, "true", name=f"quick{i}") for i in range(JOBS)]
        for job_id in ids:
            assert m.wait_status(job_id, ("finished", "failed"), timeout=60)["status"] == "finished"
        runs = list(m.state.glob("jobs/*/run*/supervisor.pid"))
        assert len(runs) >= JOBS                       # one supervisor (a child of the master) per run
        # the last supervisors may still be exiting: the next poll (every 0.2 s) reaps them
        wait_for(lambda: not zombie_children(m.proc.pid), 10, "the master to reap its children")
        assert m.proc.poll() is None
