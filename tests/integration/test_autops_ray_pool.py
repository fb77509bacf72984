"""pMaster's Ray provider on a real Ray cluster of two nodes in one process tree.

``ray.cluster_utils.Cluster`` runs a head and a node bound to 127.0.0.1 with two CPUs each;
the node's ``ray start`` had ``DLRT_HOST_ID`` set, as an emulated second host. A pMaster (in
this process, a Ray driver) with ``RayProvider`` starts a job's two aggregators as Ray actors
spread over both nodes; they register as any aggregator does, each with its node's host id,
and a push/pull round trip goes through them. When the job leaves, pMaster keeps one spare
and stops the other; stopping pMaster ends the spare. No aggregator, actor or Ray process is
left (checked by pid). Every wait has a deadline; the cluster is shut down whatever happens.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import psutil
import pytest

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError as exc:                           # pragma: no cover - depends on the machine
    pytest.skip(f"Ray is not installed ({exc}); pip install ray==2.60.0 to run these tests",
                allow_module_level=True)

from autops.admin import query_status
from autops.master.elastic import ElasticConfig
from autops.config import MasterConfig
from autops.master.pmaster import Master, provider_maker
from autops.master.rayprovider import RayProvider, actor_prefix
from autops.worker.agent import Agent
from autops_testlib import secret_for
from dlrt.hostid import HOST_ID_ENV, host_id
from waiting import until

NODE_ARGS = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
NODE_B_HOST = "ray-node-b"
DEADLINE = 30.0
ORPHAN_S = 120.0


def tree() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def with_aggregators(master: str, n: int) -> dict | None:
    """pMaster's status once it lists ``n`` aggregators, else None."""
    status = query_status(master)
    return status if len(status["aggregators"]) == n else None


@pytest.fixture
def cluster():
    """A head and a node with 2 CPUs each; afterwards every process it started is gone."""
    before = tree()
    c = Cluster(initialize_head=True, head_node_args=dict(NODE_ARGS, include_dashboard=False))
    ray_pids: set[int] = set()
    try:
        os.environ[HOST_ID_ENV] = NODE_B_HOST            # the node's raylet and workers inherit it
        try:
            c.add_node(**NODE_ARGS)
        finally:
            del os.environ[HOST_ID_ENV]
        c.wait_for_nodes()
        yield c
        ray_pids = tree() - before
    finally:
        ray.shutdown()
        c.shutdown()
    until("every Ray process to end", lambda: all(gone(pid) for pid in ray_pids), DEADLINE)


def test_pmaster_starts_aggregators_through_ray_and_ends_them(cluster, tmp_path):
    made: list[RayProvider] = []

    # what `autops master --provider ray --ray-address ADDR --max-aggregators 4` builds; orphan
    # timeout past the test's deadlines: only pMaster's stop can end them in time
    maker = provider_maker(MasterConfig(provider="ray", ray_address=cluster.address, max_aggregators=4,
                                        aggregator_orphan_timeout=ORPHAN_S, log_level="WARNING"))

    def make(address: str) -> RayProvider:
        made.append(maker(address))
        return made[0]

    master = Master("tcp://127.0.0.1:0", make_provider=make, elastic=ElasticConfig(enabled=False, spare=1),
                    state_dir=tmp_path / "state")
    thread = threading.Thread(target=master.run, name="pmaster", daemon=True)
    thread.start()
    (provider,) = made
    agents: list[Agent] = []
    try:
        assert provider.capacity(0) == 4 and provider.can_start(0) == 4
        for rank in range(2):            # registering asks for 2 aggregators: pMaster starts them
            agents.append(Agent(master.address, "rayjob", rank, 2, num_aggregators=2, average=False,
                                timeout=DEADLINE, secret=secret_for("rayjob")))
        for agent in agents:
            agent.declare([("w", (50_000,), "float32"), ("b", (10,), "float32")])
        outs = [{"w": np.empty(50_000, np.float32), "b": np.empty(10, np.float32)} for _ in agents]
        handles = [agent.push_pull(name, np.full(out.shape, rank + 1, np.float32), out, 1)
                   for rank, (agent, o) in enumerate(zip(agents, outs)) for name, out in o.items()]
        for handle in handles:
            handle.wait(DEADLINE)
        assert all(np.all(out == 3) for o in outs for out in o.values())

        status = query_status(master.address)
        aggs = {a["id"]: a for a in status["aggregators"]}
        assert status["provider"] == "ray" and len(aggs) == 2
        assert all(name.startswith(actor_prefix("ray", master.address)) for name in aggs)
        assert set(agents[0].aggregators) == set(aggs)
        where = {name: provider.where(name) for name in aggs}
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert {w["node_id"] for w in where.values()} == nodes           # spread: one on each node
        head = cluster.head_node.node_id
        for name, agg in aggs.items():
            assert agg["pid"] == where[name]["pid"]
            cmd = psutil.Process(agg["pid"]).cmdline()
            assert cmd[cmd.index("--orphan-timeout") + 1] == str(ORPHAN_S) and cmd[cmd.index("--name") + 1] == name
            assert agg["host"] == (host_id() if where[name]["node_id"] == head else NODE_B_HOST)
        pids = {name: (w["pid"], w["actor_pid"]) for name, w in where.items()}

        for agent in agents:             # the job leaves: one aggregator stays as the spare
            agent.close()
        agents.clear()
        status = until("one aggregator to be stopped", lambda: with_aggregators(master.address, 1), DEADLINE)
        (spare,) = [a["id"] for a in status["aggregators"]]
        (stopped,) = set(aggs) - {spare}
        until("the stopped aggregator and its actor to end", lambda: all(gone(pid) for pid in pids[stopped]),
              DEADLINE)
        until("Ray to forget the stopped actor",
              lambda: stopped not in ray.util.list_named_actors() and not provider.stopping, DEADLINE)
        assert provider.owns(spare) and all(not gone(pid) for pid in pids[spare])
    finally:
        for agent in agents:
            agent.close()
        master.stop()
        thread.join(DEADLINE)
    assert not thread.is_alive()
    # pMaster's end stopped the spare and disconnected from Ray
    until("the spare aggregator and its actor to end", lambda: all(gone(pid) for pid in pids[spare]), DEADLINE)
    assert not ray.is_initialized()
