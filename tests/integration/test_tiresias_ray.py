"""The Ray executor on a real Ray cluster of three nodes in one process tree.

``ray.cluster_utils.Cluster`` runs a head and two nodes bound to 127.0.0.1, each with two
fake GPUs; one node is named by a label, one by a custom resource, one by its Ray node id.
Every job is a tiny ``python -c`` command that records where it ran; the tests wait for
outcomes with deadlines, never for a fixed time.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import psutil
import pytest

try:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group
except ImportError as exc:                           # pragma: no cover - depends on the machine
    pytest.skip(f"Ray is not installed ({exc}); pip install ray==2.60.0 to run these tests",
                allow_module_level=True)

from tiresias.service.executor import LaunchSpec, RunEnd
from tiresias.service.ray_executor import NODE_LABEL, RayExecutor

NODE_ARGS = {"num_cpus": 1, "num_gpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
DEADLINE = 60.0

# a job: record where it runs, then act as told by argv (exit CODE | wait FILE | sleep | ignore-term)
JOB = r"""
import json, os, signal, socket, sys, time
rank = os.environ["TIRESIAS_NODE_RANK"]
out = os.path.join(sys.argv[1], f"rank{rank}.json")
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
keys = ("CUDA_VISIBLE_DEVICES", "TIRESIAS_NODE", "TIRESIAS_NODE_RANK", "TIRESIAS_RAY_NODE_ID", "TIRESIAS_RDZV")
info = {k: os.environ.get(k) for k in keys}
info.update(host=socket.gethostname(), pid=os.getpid())
with open(out + ".tmp", "w") as f:
    json.dump(info, f)
os.replace(out + ".tmp", out)
action = sys.argv[2 + int(rank)] if len(sys.argv) > 3 else sys.argv[2]
if action.startswith("exit"):
    sys.exit(int(action[4:] or 0))
while not (action.startswith("wait") and os.path.exists(action[4:])):
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args=dict(NODE_ARGS, include_dashboard=False,
                                                          labels={NODE_LABEL: "alpha"}))
    try:
        c.add_node(**NODE_ARGS, resources={"tiresias_node:beta": 1})
        c.add_node(**NODE_ARGS)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def ex(cluster):
    executor = RayExecutor(cluster.address, ready_timeout=DEADLINE)
    executor.reconcile({})                           # leftovers of an earlier failed test
    try:
        yield executor
    finally:
        executor.close()


def spec_of(job_id: int, tmp_path, placement: list[tuple[str, list[int]]], *actions: str) -> LaunchSpec:
    out = tmp_path / f"job{job_id}"
    out.mkdir(exist_ok=True)
    return LaunchSpec(job_id, 1, f"job{job_id}", [sys.executable, "-c", JOB, str(out), *actions], "plain",
                      placement, env={"TIRESIAS_JOB_ID": str(job_id),
                                      "TIRESIAS_STOPPED_FILE": str(out / "stopped")},
                      workdir=str(tmp_path), log_path=str(tmp_path / f"job{job_id}.log"),
                      run_dir=str(out))


def wait_for(pred: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_end(ex: RayExecutor, spec: LaunchSpec, ends: dict[tuple[int, int], RunEnd] | None = None) -> RunEnd:
    """Poll until ``spec``'s run ends; other runs' ends go to ``ends``."""
    ends = {} if ends is None else ends

    def ended():
        ends.update({(e.job_id, e.run): e for e in ex.poll()})
        return ends.get((spec.job_id, spec.run))
    return wait_for(ended, f"the end of job {spec.job_id}")


def recorded(spec: LaunchSpec, rank: int) -> dict[str, Any]:
    path = os.path.join(spec.run_dir, f"rank{rank}.json")
    wait_for(lambda: os.path.exists(path), f"job {spec.job_id} node {rank} to start")
    with open(path) as f:
        return json.load(f)


def started(spec: LaunchSpec) -> list[dict[str, Any]]:
    """What every node of ``spec`` recorded once its command was running."""
    return [recorded(spec, rank) for rank in range(len(spec.placement))]


def ray_ids(ex: RayExecutor) -> dict[str, str]:
    return {name: node_id for name, (_, node_id) in ex._scan().items()}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def gpus_free(ex: RayExecutor, placement: list[tuple[str, list[int]]]) -> bool:
    """Can a placement group of the same size be reserved on the same nodes now?"""
    ids = ray_ids(ex)
    pg = placement_group([{"GPU": len(g)} for _, g in placement], name="probe",
                         bundle_label_selector=[{"ray.io/node-id": ids[n]} for n, _ in placement])
    try:
        return pg.wait(timeout_seconds=DEADLINE)
    finally:
        remove_placement_group(pg)


def test_nodes_lists_gpu_nodes_by_stable_names(ex):
    nodes = {n.name: n for n in ex.nodes()}
    assert len(nodes) == 3
    assert {"alpha", "beta"} <= set(nodes)
    (other,) = set(nodes) - {"alpha", "beta"}
    assert other.startswith("ray-") and len(other) == 12
    assert all(n.gpus == 2 and n.alive and n.address == "127.0.0.1" for n in nodes.values())


def test_plain_run_executes_on_the_pinned_nodes(ex, tmp_path):
    names = sorted(n.name for n in ex.nodes())
    placement = [(names[2], [1]), (names[0], [0, 1])]          # not the order Ray would pick
    spec = spec_of(1, tmp_path, placement, "exit0")
    handle = ex.launch(spec)
    assert json.loads(json.dumps(handle)) == handle
    assert handle["placement_group"] == "tiresias-job1-run1"
    assert handle["actors"] == ["tiresias-job1-run1-node0", "tiresias-job1-run1-node1"]
    end = wait_end(ex, spec)
    assert (end.exit_code, end.lost, end.stopped) == (0, False, False)
    ids = ray_ids(ex)
    for rank, (node, gpus) in enumerate(placement):
        got = recorded(spec, rank)
        assert got["TIRESIAS_NODE_RANK"] == str(rank) and got["TIRESIAS_NODE"] == node
        assert got["TIRESIAS_RAY_NODE_ID"] == ids[node] == handle["ray_nodes"][rank]
        assert got["CUDA_VISIBLE_DEVICES"].split(",") == handle["gpus"][rank]
        assert len(handle["gpus"][rank]) == len(gpus)
        assert got["TIRESIAS_RDZV"] == handle["rdzv"]
    assert ex.poll() == []                                     # reported once
    wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["name"].startswith("tiresias-job1-")], "the actors to go")


def test_failing_node_ends_its_run_only(ex, tmp_path):
    names = sorted(n.name for n in ex.nodes())
    failing = spec_of(2, tmp_path, [(names[0], [0]), (names[1], [0])], "sleep", "exit3")
    bystander = spec_of(3, tmp_path, [(names[2], [0])], f"wait{tmp_path / 'go3'}")
    ex.launch(bystander)
    ex.launch(failing)
    sleeper = recorded(failing, 0)["pid"]
    ends: dict[tuple[int, int], RunEnd] = {}
    end = wait_end(ex, failing, ends)
    assert end.exit_code == 3 and not end.lost and names[1] in end.detail
    assert gone(sleeper)                                        # the other node was stopped
    assert (3, 1) not in ends
    (tmp_path / "go3").touch()
    assert wait_end(ex, bystander, ends).exit_code == 0


def test_terminate_frees_the_gpus(ex, tmp_path):
    names = sorted(n.name for n in ex.nodes())
    placement = [(names[0], [0, 1]), (names[1], [0, 1])]
    polite = spec_of(4, tmp_path, placement, "sleep")
    handle = ex.launch(polite)
    started(polite)
    ex.terminate(4, 1, handle)
    ex.terminate(4, 1, handle)                                  # idempotent
    assert wait_end(ex, polite).exit_code == -15
    ignoring = spec_of(5, tmp_path, placement, "ignore-term")
    handle = ex.launch(ignoring)                                # the same GPUs: they were freed
    started(ignoring)
    ex.terminate(5, 1, handle)
    ex.terminate(5, 1, handle, force=True)
    end = wait_end(ex, ignoring)
    assert end.exit_code == -9 and not end.lost
    ex.terminate(5, 1, handle, force=True)                      # after the end: harmless
    assert gpus_free(ex, placement)


def test_reconcile_after_master_restart(cluster, ex, tmp_path):
    names = sorted(n.name for n in ex.nodes())
    go = tmp_path / "go6"
    alive = spec_of(6, tmp_path, [(names[0], [0]), (names[1], [0])], f"wait{go}")
    done = spec_of(7, tmp_path, [(names[2], [0])], "exit0")
    stray = spec_of(8, tmp_path, [(names[2], [1])], "sleep")
    handles = {s.job_id: ex.launch(s) for s in (alive, done, stray)}
    stray_pid = recorded(stray, 0)["pid"]
    started(alive)
    ex.close()                                                  # the master goes down
    wait_for(lambda: gone(recorded(done, 0)["pid"]), "job 7 to finish")

    ex2 = RayExecutor(cluster.address)                          # a new driver
    try:
        ends = ex2.reconcile({(6, 1): handles[6], (7, 1): handles[7]})
        assert [(e.job_id, e.exit_code, e.lost) for e in ends] == [(7, 0, False)]
        wait_for(lambda: gone(stray_pid), "the stray job to be killed")
        wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                              if a["name"].startswith(("tiresias-job7-", "tiresias-job8-"))], "stray actors to go")
        assert ex2.poll() == []
        go.touch()
        end = wait_end(ex2, alive)
        assert (end.exit_code, end.lost) == (0, False)
        assert gpus_free(ex2, [(names[2], [0, 1])])             # the stray's group was removed
    finally:
        ex2.close()


def test_removed_node_ends_its_run_as_lost(cluster, ex, tmp_path):
    node = cluster.add_node(**NODE_ARGS, labels={NODE_LABEL: "doomed"})
    cluster.wait_for_nodes()
    wait_for(lambda: "doomed" in {n.name for n in ex.nodes() if n.alive}, "the new node")
    names = sorted(n.name for n in ex.nodes() if n.name != "doomed")
    spec = spec_of(9, tmp_path, [("doomed", [0, 1]), (names[0], [0])], "sleep")
    ex.launch(spec)
    orphan, survivor = (r["pid"] for r in started(spec))
    cluster.remove_node(node)
    end = wait_end(ex, spec)
    assert end.lost and "died" in end.detail
    assert gone(survivor)
    wait_for(lambda: gone(orphan), "the command on the removed node to die with its launcher")
    wait_for(lambda: not {n.name: n.alive for n in ex.nodes()}["doomed"], "the node to be reported dead")
