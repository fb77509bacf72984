"""A run the AutoPS pool refuses for now is requeued by a real master, not failed.

The pool has one aggregator and a job outside Tiresias holds it. A Tiresias job asking for
one aggregator is refused admission: its run exits non-zero after writing the reason
(``dlrt.requeue``), and the master queues the job again, shows why in ``tiresias jobs``' table
(its rows as the API gives them between runs) and ``tiresias events``, and retries with a
back-off. Once the other job leaves, the next retry
is admitted and the job finishes.
"""
from __future__ import annotations

import sys

import pytest

from autops.worker.agent import Agent
from autops.local import LocalPool
from autops_testlib import secret_for
from tiresias.service.cli import jobs_table
from tiresias_live import JOBS, MasterProcess, wait_for

pytestmark = pytest.mark.timeout(300)


def events(master: MasterProcess, job_id: int, kind: str) -> list[str]:
    return [e["detail"] for e in master.client.get(f"/api/v1/events?job={job_id}") if e["kind"] == kind]


def test_a_run_the_pool_refuses_is_requeued_and_runs_once_there_is_room(tmp_path):
    with LocalPool(1, master_args=["--job-timeout", "600"]) as pool:
        blocker = Agent(pool.master, "blocker", 0, 1, num_aggregators=1, timeout=20, secret=secret_for("blocker"))
        master = MasterProcess(tmp_path / "state", "--nodes", "1x1", "--interval", "1",
                               "--autops-master", pool.master)
        try:
            master.start()
            job_id = master.submit(1, sys.executable, str(JOBS / "autops_job.py"), "20", "0.01", name="refused",
                                   launcher="torchrun", autops_aggregators=1)
            wait_for(lambda: events(master, job_id, "requeued"), 120, "the refused run to be requeued")
            view = master.job(job_id)
            assert view["status"] in ("waiting", "running") and view["exit_code"] is None
            first = events(master, job_id, "requeued")[-1]      # newest first: the oldest is last
            assert first.startswith("run 1: AutoPS pool refused the job for now: job tiresias-"), first
            assert "admission refused" in first and first.endswith("; retry in 1 s")
            assert "requeued" in master.cli("events", "--job", str(job_id)).stdout
            # between its runs (short while the back-off is): the reason, in `tiresias jobs`' table
            waiting = wait_for(lambda: [j for j in master.client.get("/api/v1/jobs")
                                        if j["status"] == "waiting" and (j["reason"] or "").startswith("requeued:")],
                               120, "the job waiting with its reason")
            row = jobs_table(waiting).splitlines()[1]
            assert " waiting " in row and "requeued: AutoPS pool refused the job for now: job tiresias-" in row
            blocker.close()                                      # the pool has room again
            view = master.wait_status(job_id, ("finished", "failed"), 180)
            assert view["status"] == "finished", view
            outcomes = [r["outcome"] for r in view["runs"]]
            assert outcomes[-1] == "exit 0" and set(outcomes[:-1]) == {"exit 1 (asked to be requeued)"}, outcomes
            log = (master.state / "jobs" / str(job_id) / "job.log").read_text()
            assert "done after 20 steps" in log
        finally:
            blocker.close()
            master.stop()
