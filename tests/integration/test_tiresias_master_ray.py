"""``tiresias master --executor ray`` on a real 3-process Ray cluster (head without GPUs, two
nodes of two fake GPUs), all on 127.0.0.1.

One master run covers what the Ray backend must do for the master: a job spanning both nodes,
preemption by checkpoint and resume, a node removed under a running job (requeued from its
checkpoint onto the other node), and a master SIGKILL + restart that re-attaches a running
job through Ray's named actors instead of starting it twice.
"""
from __future__ import annotations

import signal

import pytest

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError as exc:                           # pragma: no cover - depends on the machine
    pytest.skip(f"Ray is not installed ({exc}); pip install ray==2.60.0 to run these tests",
                allow_module_level=True)

from tiresias_live import MasterProcess, counter, steps, wait_for

pytestmark = pytest.mark.timeout(300)
NODE = {"num_cpus": 2, "num_gpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


def test_master_on_ray_preempts_survives_node_loss_and_restart(tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, num_gpus=0, include_dashboard=False))
    master = None
    try:
        cluster.add_node(**NODE, labels={"tiresias.io/node": "gpu-a"})
        doomed = cluster.add_node(**NODE, labels={"tiresias.io/node": "gpu-b"})
        cluster.wait_for_nodes()
        args = ("--executor", "ray", "--ray-address", cluster.address, "--interval", "0.5",
                "--stop-grace", "3", "--thresholds", "4")
        master = MasterProcess(tmp_path / "state", *args).start()
        names = sorted(n["name"] for n in master.client.get("/api/v1/nodes"))
        assert names == ["gpu-a", "gpu-b"]

        # a 4-GPU job spans both nodes; a later job preempts it by checkpoint, it resumes
        wide = master.submit(4, *counter(40, 0.1), name="wide")
        view = master.wait_status(wide, "running", 120)
        assert sorted(view["placement"]) == ["gpu-a", "gpu-b"]
        wait_for(lambda: len(steps(master.state, wide)) >= 10, 60, "wide to pass its threshold")
        short = master.submit(2, *counter(5, 0.1), name="short")
        master.wait_status(short, "finished", 120)
        done = master.wait_status(wide, "finished", 180)
        assert done["preemptions"] >= 1 and steps(master.state, wide) == list(range(1, 41))

        # a node removed under a running job: requeued from its checkpoint on the other node
        lone = master.submit(2, *counter(400, 0.05), name="lone")
        view = master.wait_status(lone, "running", 120)
        wait_for(lambda: len(steps(master.state, lone)) >= 5, 60, "lone to make progress")
        if list(view["placement"]) == ["gpu-a"]:      # make sure it runs where the node goes away
            master.client.post("/api/v1/nodes/gpu-a/drain")
            master.wait_status(lone, "running", 120)
            view = wait_for(lambda: (v := master.job(lone))["placement"] == {"gpu-b": v["placement"].get("gpu-b")}
                            and v["status"] == "running" and v, 120, "lone to move to gpu-b")
            master.client.post("/api/v1/nodes/gpu-a/undrain")
        cluster.remove_node(doomed)
        view = wait_for(lambda: (v := master.job(lone))["status"] == "running" and "gpu-a" in v["placement"]
                        and v, 180, "lone to resume on gpu-a")
        nodes = {n["name"]: n for n in master.client.get("/api/v1/nodes")}
        assert not nodes["gpu-b"]["online"]
        kinds = [e["kind"] for e in master.client.get("/api/v1/events?limit=500")]
        assert "node-lost" in kinds

        # the master dies and comes back: the running job is re-attached, not started again
        run_before = master.job(lone)["run"]
        master.kill(signal.SIGKILL)
        master = MasterProcess(tmp_path / "state", *args).start()
        assert master.job(lone)["status"] == "running" and master.job(lone)["run"] == run_before
        done = master.wait_status(lone, "finished", 180)
        assert done["run"] == run_before and steps(master.state, lone)[-1] == 400
        assert not (master.state / "checkpoints" / str(lone) / "checkpoint" / "DOUBLE").exists()
    finally:
        if master is not None:
            master.stop()
        ray.shutdown()
        cluster.shutdown()
