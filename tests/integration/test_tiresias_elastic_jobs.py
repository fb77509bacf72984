"""An elastic job under ``tiresias master --policy optimus``, every piece real: a pMaster pool,
the master's local executor, ``examples/train_digits.py --global-batch`` under torchrun.

Optimus starts the job at its minimum (1 GPU, nothing measured), learns its speed from what it
reports, grows it by stop-and-restart at 2 GPUs (the job resumes its checkpoint at the new world
size), and gives it a second aggregator live once measured where it runs (pMaster spreads its
keys, no restart). The job ends with the accuracy of an ordinary run, and its runs name their
GPU and aggregator counts.
"""
from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

from autops.local import LocalPool
from tiresias_live import MasterProcess, wait_for

pytestmark = pytest.mark.timeout(300)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_optimus_resizes_an_elastic_job_live_and_it_trains_to_the_end(tmp_path):
    pool = LocalPool(2, master_args=["--static"])
    master = None
    try:
        pool.start()
        master = MasterProcess(tmp_path / "state", "--nodes", "1x2", "--interval", "0.5", "--policy", "optimus",
                               "--round-interval", "2", "--stop-grace", "60", "--autops-master", pool.master,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}).start()
        job_id = master.submit(2, sys.executable, str(ROOT / "examples" / "train_digits.py"), "--global-batch", "64",
                               "--epochs", "100", name="elastic", launcher="torchrun", autops_aggregators=1,
                               min_gpus=1, converge=0.05)
        view = master.wait_status(job_id, "finished", 240)
        runs = view["runs"]
        gpus = [r["gpus"] for r in runs]
        assert gpus[0] == 1 and 2 in gpus, runs               # started small, grown by a restart
        log = master.cli("logs", str(job_id)).stdout
        assert "resumed from step" in log, log[-3000:]
        accuracy = float(re.findall(r"test accuracy ([0-9.]+)", log)[-1])
        assert accuracy >= 0.9, log[-2000:]
        events = master.client.get(f"/api/v1/events?job={job_id}")
        # a live aggregator change to 2 (a later round may pack it back: a run keeps its latest count)
        spread = [e for e in events if e["kind"] == "aggregators" and "over 2 aggregator(s)" in e["detail"]]
        assert spread, events
        assert all(r["aggregators"] in (1, 2) for r in runs), runs
        assert "preemptions" in view and view["preemptions"] >= 1
        shown = master.cli("job", str(job_id)).stdout
        assert "aggregator(s)" in shown
    finally:
        if master is not None:
            master.stop()
        pool.stop()
