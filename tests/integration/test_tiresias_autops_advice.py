"""A job of several workers that uses ``autops.torch`` without a pool: the error tells a
Tiresias user what to pass to ``tiresias submit`` (and anyone else how to start a pool)."""
from __future__ import annotations

import sys

import pytest

from tiresias_live import MasterProcess

pytestmark = pytest.mark.timeout(180)

JOB = "import autops.torch as aps; aps.init()"


def test_the_advice_fits_the_launcher(monkeypatch):
    import autops.torch as aps
    monkeypatch.delenv("AUTOPS_MASTER", raising=False)
    monkeypatch.delenv("TIRESIAS_JOB_ID", raising=False)
    aps.shutdown()
    with pytest.raises(aps.AutoPSError, match=r"AUTOPS_MASTER is not set; start a pool \(`autops local -- CMD`"):
        aps.init(world_size=2, rank=0)
    monkeypatch.setenv("TIRESIAS_JOB_ID", "7")
    monkeypatch.setenv("TIRESIAS_GPUS", "4")
    with pytest.raises(aps.AutoPSError) as refused:
        aps.init(world_size=4, rank=1)
    message = str(refused.value)
    assert "Tiresias job 7 has 4 workers" in message and "autops local" not in message
    assert "`tiresias submit --gpus 4 --autops-aggregators K -- SCRIPT ...`" in message
    assert "--autops-master ADDR" in message


def test_a_tiresias_job_of_two_workers_without_aggregators_is_told_what_to_submit(tmp_path):
    with MasterProcess(tmp_path / "state", "--nodes", "1x2", "--interval", "0.2") as m:
        # rank 0 of a 2-worker job, as torchrun starts it (the plain launcher keeps this test light)
        job = m.submit(2, sys.executable, "-c", JOB, name="two-workers", env={"WORLD_SIZE": "2", "RANK": "0"})
        done = m.wait_status(job, ("finished", "failed"), timeout=120)
        assert done["status"] == "failed"
        log = m.cli("logs", str(job)).stdout
        assert f"Tiresias job {job} has 2 workers" in log
        assert "tiresias submit --gpus 2 --autops-aggregators K" in log and "autops local" not in log
