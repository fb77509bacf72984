"""A job's registration at pMaster ends with its workers, and a refusal for now is a requeue.

* A worker process that exits without ``autops.torch.shutdown()`` -- here rank 0 through
  ``tiresias.job.exit_stopped()``, as the README's preemption snippet does, and rank 1 at the
  end of its script -- leaves its job
  on the way out: once every rank is gone pMaster releases the job at once, not after its
  ``--job-timeout`` (600 s here), and one rank gone alone releases nothing.
* A registration pMaster refuses for now (no aggregator yet, admission control) or that it
  does not answer writes the reason to ``$DLRT_REQUEUE_FILE`` (the Tiresias master requeues
  such a run); a refusal that retrying cannot cure (a bad mode) writes nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from autops.worker.agent import Agent, AutoPSError, MasterUnreachable, PoolBusy
from autops.local import LocalPool
from autops_testlib import secret_for

pytestmark = pytest.mark.timeout(120)

WORKER = textwrap.dedent("""
    import os, sys, time
    from autops.agent import Agent
    from tiresias import job
    rank, go = int(sys.argv[2]), sys.argv[3]
    agent = Agent(sys.argv[1], "left", rank, 2, num_aggregators=1, timeout=20, secret=os.environ["SECRET"])
    agent.declare([("w", (1000,), "float32")])
    print("registered", flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
    if rank == 0:
        job.exit_stopped()                  # no close(), no shutdown()
    print("the end", flush=True)            # rank 1: the script just ends
""")


def jobs(pool: LocalPool) -> list[str]:
    return [j["job"] for j in pool.status()["jobs"]]


def wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def test_workers_that_exit_without_shutdown_release_their_job_at_once(tmp_path):
    with LocalPool(1, master_args=["--job-timeout", "600"]) as pool:
        env = dict(os.environ, SECRET=secret_for("left"), TIRESIAS_STOPPED_FILE=str(tmp_path / "stopped"))
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, pool.master, str(rank), str(tmp_path / f"go{rank}")],
                                  env=env, stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
        try:
            for proc in procs:
                assert proc.stdout.readline().strip() == "registered"
            assert jobs(pool) == ["left"]
            (tmp_path / "go0").touch()
            assert procs[0].wait(30) == 0
            time.sleep(0.5)
            assert jobs(pool) == ["left"]          # one rank left: the job stays
            (tmp_path / "go1").touch()
            assert procs[1].wait(30) == 0
            wait(lambda: jobs(pool) == [], 10, "pMaster to release the job")
            assert (tmp_path / "stopped").exists()
            # its aggregator is free again: a job asking for it is admitted at once
            Agent(pool.master, "next", 0, 1, num_aggregators=1, timeout=20, secret=secret_for("next")).close()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
                proc.stdout.close()


def test_refusals_for_now_ask_the_launcher_to_requeue(tmp_path, monkeypatch):
    file = tmp_path / "requeue"
    monkeypatch.setenv("DLRT_REQUEUE_FILE", str(file))
    with LocalPool(0) as pool:                      # no aggregator at all yet
        with pytest.raises(PoolBusy, match="no aggregator is registered"):
            Agent(pool.master, "early", 0, 1, num_aggregators=1, timeout=5, secret=secret_for("early"))
        assert "no aggregator is registered" in file.read_text()
        file.unlink()
        with pytest.raises(AutoPSError, match="mode must be one of") as refused:
            Agent(pool.master, "bad", 0, 1, mode="bogus", timeout=5, secret=secret_for("bad"))
        assert not isinstance(refused.value, PoolBusy) and not file.exists()
    with LocalPool(1) as pool:
        with pytest.raises(PoolBusy, match="admission refused"):
            Agent(pool.master, "big", 0, 1, num_aggregators=2, timeout=5, secret=secret_for("big"))
        text = file.read_text()
        assert text.startswith("AutoPS pool refused the job for now: ") and "admission refused" in text
        assert text.count("\n") == 1
        file.unlink()
    with pytest.raises(MasterUnreachable):
        Agent("tcp://127.0.0.1:9", "lonely", 0, 1, timeout=0.5, secret=secret_for("lonely"))
    assert "did not answer" in file.read_text()


def test_without_a_launcher_a_refusal_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("DLRT_REQUEUE_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MasterUnreachable):
        Agent("tcp://127.0.0.1:9", "lonely", 0, 1, timeout=0.3, secret=secret_for("lonely"))
    assert list(tmp_path.iterdir()) == []
