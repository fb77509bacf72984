"""Both report feeds into a real master: a real pMaster (AutoPS pool) and real Infiniswap daemons.

The master subscribes to pMaster's utilization PUB and to two daemons' PUBs, which stand for
the hosts of the two emulated nodes (``--report-host node0/node1``). A job submitted with
``--autops-aggregators`` runs on the shared pool under the AutoPS name the master gave it; the
skew pMaster measures from its tensors appears on the job, and each node shows the memory
its daemon reports.
"""
from __future__ import annotations

import sys

import pytest

from autops.local import LocalPool
from infiniswap.local import DaemonProcess
from tiresias_live import JOBS, MasterProcess, wait_for
from ports import free_port

pytestmark = pytest.mark.timeout(240)
MiB = 1 << 20


def test_master_takes_skew_from_pmaster_and_memory_from_daemons(tmp_path):
    autops_reports = f"tcp://127.0.0.1:{free_port()}"
    daemon_ports = [free_port(), free_port()]
    daemons = [DaemonProcess(slab_size=MiB, capacity=64 * MiB, headroom=8 * MiB, period=0.1,
                             extra=["--reports", f"tcp://127.0.0.1:{port}", "--report-interval", "0.2",
                                    "--report-host", f"node{i}"]) for i, port in enumerate(daemon_ports)]
    pool = LocalPool(1, master_args=["--report-bind", autops_reports, "--report-period", "0.2"])
    master = None
    try:
        for d in daemons:
            d.start()
        pool.start()
        master = MasterProcess(tmp_path / "state", "--nodes", "2x2", "--interval", "0.5",
                               "--autops-master", pool.master, "--autops-reports", autops_reports,
                               "--infiniswap-reports", *[f"tcp://127.0.0.1:{p}" for p in daemon_ports]).start()
        job_id = master.submit(1, sys.executable, str(JOBS / "autops_job.py"), "400", "0.05", name="skewed",
                               launcher="torchrun", autops_aggregators=1)
        view = wait_for(lambda: (j := master.job(job_id))["skew_measured"] and j, 90, "pMaster's skew on the job")
        assert view["skew"] == pytest.approx(65536 / (65536 + 256 + 2048 + 8), abs=1e-3)
        nodes = wait_for(lambda: (n := master.client.get("/api/v1/nodes")) and
                         all(x["memory_free_bytes"] is not None for x in n) and n, 30, "memory on both nodes")
        for node in nodes:
            assert node["memory_total_bytes"] == 64 * MiB and 0 < node["memory_free_bytes"] <= 64 * MiB
            assert node["memory_lendable_bytes"] is not None
        text = master.cli("nodes").stdout
        assert "MiB" in text and "node0" in text and "node1" in text
        summary = master.client.get("/api/v1/summary")
        topics = {r["topic"] for r in summary["reports"] if not r["stale"]}
        assert topics == {"autops.utilization", "infiniswap.utilization"}
        master.client.post(f"/api/v1/jobs/{job_id}/cancel")
        master.wait_status(job_id, "cancelled", 60)
        stopped = (master.state / "checkpoints" / str(job_id) / "control" / "stopped").exists()
        assert stopped                                   # it saw the request and exited by itself
    finally:
        if master is not None:
            master.stop()
        pool.stop()
        for d in daemons:
            d.stop()
