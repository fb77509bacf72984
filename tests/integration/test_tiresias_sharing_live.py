"""GPU sharing under ``tiresias master --policy tesserae-las``, every piece real: the master's
local executor runs two jobs whose pair the co-location table packs on one emulated GPU at
once, and a third that must not share waits for it."""
from __future__ import annotations

import pytest

from tiresias.packing.profiles import DEFAULT_COLOCATION
from tiresias_live import MasterProcess, counter, wait_for

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not DEFAULT_COLOCATION.exists(), reason="no co-location table in ../shared/data")]


def test_two_jobs_share_one_gpu_and_a_no_share_job_waits(tmp_path):
    master = MasterProcess(tmp_path / "state", "--nodes", "1x1", "--interval", "0.3", "--policy", "tesserae-las",
                           "--round-interval", "1").start()
    try:
        a = master.submit(1, *counter(30, 0.1), name="a", model="resnet50", batch_size="32")
        b = master.submit(1, *counter(30, 0.1), name="b", model="vgg19", batch_size="32")
        c = master.submit(1, *counter(5, 0.1), name="c", model="vgg19", batch_size="32", share=False)
        def together():
            ja, jb = master.job(a), master.job(b)
            return (ja, jb) if ja["status"] == jb["status"] == "running" else None

        ja, jb = wait_for(together, 30, "a and b running together")
        assert ja["placement"] == jb["placement"] == {"node0": [0]}
        assert ja["shares_with"] == b and jb["shares_with"] == a
        assert master.job(c)["status"] == "waiting"
        assert "c" in master.cli("jobs").stdout
        for job_id in (a, b, c):
            master.wait_status(job_id, "finished", 60)
        assert master.job(c)["started"] >= max(master.job(a)["ended"], master.job(b)["ended"]) - 1.0
    finally:
        master.stop()
