"""GPU sharing under ``tiresias master --policy tesserae-las`` (and ``tesserae-optimus``), every piece real: the master's
local executor runs two jobs whose pair the co-location table packs on one emulated GPU at
once (both told the same device), a job that must not share waits, and a packed pair of
``examples/train_digits.py`` jobs both train to the end while their measured speeds, alone and
side by side, update the co-location profile."""
from __future__ import annotations

import pathlib
import re
import sys

import pytest

from tiresias.packing.profiles import DEFAULT_COLOCATION
from tiresias_live import MasterProcess, counter, wait_for

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not DEFAULT_COLOCATION.exists(), reason="no co-location table in ../shared/data")]
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def _together(master, a, b):
    def both():
        ja, jb = master.job(a), master.job(b)
        return (ja, jb) if ja["status"] == jb["status"] == "running" else None
    return wait_for(both, 60, f"jobs {a} and {b} running together")


@pytest.mark.parametrize("policy", ["tesserae-las", "tesserae-optimus"])
def test_two_jobs_share_one_gpu_and_a_no_share_job_waits(tmp_path, policy):
    """Under Optimus's allocation the second job is a guest on the first one's GPU."""
    master = MasterProcess(tmp_path / "state", "--nodes", "1x1", "--interval", "0.3", "--policy", policy,
                           "--round-interval", "1").start()
    try:
        a = master.submit(1, *counter(30, 0.1), name="a", model="resnet50", batch_size="32")
        b = master.submit(1, *counter(30, 0.1), name="b", model="vgg19", batch_size="32")
        c = master.submit(1, *counter(5, 0.1), name="c", model="vgg19", batch_size="32", share=False)
        ja, jb = _together(master, a, b)
        assert ja["placement"] == jb["placement"] == {"node0": [0]}
        assert ja["shares_with"] == b and jb["shares_with"] == a
        assert master.job(c)["status"] == "waiting"
        nodes = master.cli("nodes").stdout
        assert "shared: GPU 0 by jobs" in nodes, nodes
        for job_id in (a, b, c):
            master.wait_status(job_id, "finished", 60)
        assert master.job(c)["started"] >= max(master.job(a)["ended"], master.job(b)["ended"]) - 1.0
    finally:
        master.stop()


def test_a_packed_pair_of_training_jobs_trains_and_teaches_the_profile(tmp_path):
    master = MasterProcess(tmp_path / "state", "--nodes", "1x1", "--interval", "0.3", "--policy", "tesserae-las",
                           "--round-interval", "2", "--profile-settle", "3").start()
    train = [sys.executable, str(EXAMPLE), "--epochs", "25", "--emulate-gpu", "0.02"]
    try:
        a = master.submit(1, *train, name="a", model="resnet50", batch_size="32")
        master.wait_status(a, "running", 30)
        wait_for(lambda: (master.job(a).get("progress") or {}).get("step", 0) > 60, 60, "job a measured alone")
        b = master.submit(1, *train, name="b", model="vgg19", batch_size="32")
        _together(master, a, b)
        for job_id in (a, b):
            master.wait_status(job_id, "finished", 150)
            log = master.cli("logs", str(job_id)).stdout
            accuracy = float(re.findall(r"test accuracy ([0-9.]+)", log)[-1])
            assert accuracy >= 0.95, log[-2000:]
        events = wait_for(lambda: [e for e in master.client.get("/api/v1/events") if e["kind"] == "profile"] or None,
                          20, "the pair's measurement folded into the profile")
        assert re.search(r"shared GPUs with job \d+: [0-9.]+ and [0-9.]+ of their speeds alone", events[0]["detail"])
    finally:
        master.stop()
