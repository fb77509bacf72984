"""``dlrt cluster up|status|down --ray ADDR`` on a real Ray cluster in one process tree.

``ray.cluster_utils.Cluster`` on 127.0.0.1: a head (no GPU, the one node with the
``infiniswap`` resource: every node shares 127.0.0.1, so one daemon only) and a node with
two fake GPUs labelled ``gpu-a``. ``up`` (a driver on the head) starts pMaster with the Ray
provider, the daemon and the Tiresias master with the Ray executor as detached actors;
``status`` finds each and its answer; a Tiresias job runs on ``gpu-a`` through Ray; ``down``
leaves no actor and no process of the setup. A driver holding other cluster keys than the
nodes is refused, naming the node, with nothing left running. The emulated-host test
(``test_cluster_hosts.py``) runs the same across network namespaces with an AutoPS job.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError as exc:                           # pragma: no cover - depends on the machine
    pytest.skip(f"Ray is not installed ({exc}); pip install ray==2.60.0 to run these tests",
                allow_module_level=True)

from cluster_testlib import dlrt, ours
from dlrt.keys import ensure_cluster_secret, temporary_cluster
from ports import free_port
from waiting import until

pytestmark = pytest.mark.timeout(300)
NODE = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


@pytest.fixture
def cluster():
    ensure_cluster_secret()                 # the session's key directory, shared by every node
    c = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False,
                                                          resources={"infiniswap": 1}))
    try:
        c.add_node(**NODE, num_gpus=2, labels={"tiresias.io/node": "gpu-a"})
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_up_status_job_and_down_on_ray(cluster, tmp_path):
    state = str(tmp_path / "cluster")
    config = tmp_path / "cluster.toml"
    config.write_text(f"""
[cluster]
state = "{state}"
start_timeout = 90
[autops]
port = {free_port()}
report_port = {free_port()}
max_aggregators = 2
[infiniswap]
port = {free_port()}
report_port = {free_port()}
ray_resource = "infiniswap"
headroom = "64M"
capacity = "256M"
args = ["--slab-size", "16M", "--no-lock"]
[tiresias]
port = {free_port()}
args = ["--interval", "0.5"]
""")
    with temporary_cluster(curve=False):    # a driver whose keys no node holds
        ensure_cluster_secret()
        refused = dlrt("cluster", "up", "--ray", cluster.address, "--config", str(config))
    assert refused.returncode == 1
    assert "holds other cluster keys than this machine" in refused.stderr.strip().splitlines()[-1], refused.stderr
    until("nothing of the refused setup runs", lambda: not ours(state), timeout=30)

    up = dlrt("cluster", "up", "--ray", cluster.address, "--config", str(config), "--json", "-")
    try:
        assert up.returncode == 0, up.stderr
        rows = {r["name"]: r for r in json.loads(up.stdout)["services"]}
        daemon = [name for name in rows if name.startswith("dlrt-infiniswap-")]
        assert len(daemon) == 1 and {"dlrt-autops-master", "dlrt-tiresias-master"} <= set(rows)
        assert all(r["answers"] for r in rows.values()), rows
        argv = ray_argv(cluster, "dlrt-tiresias-master")         # wired to pMaster and the daemon
        assert argv[argv.index("--autops-master") + 1] == rows["dlrt-autops-master"]["endpoint"]
        assert argv[argv.index("--infiniswap-reports") + 1].startswith("tcp://127.0.0.1:")
        assert argv[argv.index("--executor") + 1] == "ray"

        status = dlrt("cluster", "status", "--ray", cluster.address, "--config", str(config), "--json", "-")
        assert status.returncode == 0 and set(r["name"] for r in json.loads(status.stdout)["services"]) == set(rows)

        marker = tmp_path / "ran"
        sub = subprocess.run([sys.executable, "-m", "tiresias.cli", "submit", "--state", f"{state}/tiresias",
                              "--gpus", "1", "--launcher", "plain", "--",
                              sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ok')"],
                             capture_output=True, text=True, timeout=60)
        assert sub.returncode == 0, sub.stderr
        until("the job ran on gpu-a through Ray", marker.exists, timeout=90)
    finally:
        down = dlrt("cluster", "down", "--ray", cluster.address, "--config", str(config))
    assert down.returncode == 0, down.stderr
    assert "stopped dlrt-tiresias-master" in down.stdout and "dlrt-autops-master" in down.stdout
    until("nothing of the setup runs", lambda: not ours(state), timeout=30)
    after = dlrt("cluster", "status", "--ray", cluster.address, "--config", str(config))
    assert after.returncode == 1 and after.stdout.strip() == "nothing is up"


def ray_argv(cluster, name: str) -> list[str]:
    """The command line of the setup's actor ``name`` (a driver of its own)."""
    code = ("import json; from dlrt.rayconn import join; ray = join(%r, 'dlrt', 'test');"
            "print(json.dumps(ray.get(ray.get_actor(%r).where.remote())['argv']))") % (cluster.address, name)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
