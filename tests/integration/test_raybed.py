"""A real Ray cluster across three emulated hosts (dlrt_bench.raybed; root only).

The head runs on h0 (1 CPU), workers on h1 (2 CPUs, 2 GPUs that are only counted) and h2 (2 CPUs,
the custom resource ``lender`` and a label), each node bound to its host's own address. A driver
run in h0 sees the three nodes at the hosts' addresses, with those resources. An actor that needs ``lender`` runs on h2's node, where Ray's node
address, ``DLRT_HOST_ID`` and the node id are h2's, and it listens on a TCP socket at h2's address
that a process in h1 connects to; a task pinned to h1's node runs there as h1. After
``kill_node(2)`` the GCS reports h0 and h1 alive (bounded wait). After ``down()`` no Ray process
seen during the test is left (by pid), nothing at all runs in the hosts, Ray's temporary directory
is gone, and Ray never wrote this cluster's session into the machine's ``/tmp/ray``.

A node Ray refuses to start makes ``up`` fail at once with that node's name and Ray's message,
leaving no Ray process and no temporary directory behind.
"""
from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import time

import pytest

from dlrt_bench.raybed import NodeSpec, RayBed, RayBedError, running
from testbed_fixture import emulated_hosts, prefix_for

if importlib.util.find_spec("ray") is None:           # pragma: no cover - depends on the machine
    pytest.skip("Ray is not installed; pip install ray==2.60.0 to run these tests", allow_module_level=True)

PROBE = os.path.join(os.path.dirname(__file__), "raybed_probe.py")
UP_S = 60.0
DEAD_S = 30.0
PROBE_S = 45.0
MACHINE_RAY_DIR = "/tmp/ray"      # where clusters on 127.0.0.1 in the machine's namespace keep their state


def read_line(proc: subprocess.Popen, deadline: float) -> dict:
    """The next JSON line the process prints, before ``deadline`` (monotonic)."""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            assert line, f"the probe ended (exit {proc.wait()}): {proc.stderr.read()[-2000:]}"
            return json.loads(line)
        assert proc.poll() is None, f"the probe ended (exit {proc.returncode}): {proc.stderr.read()[-2000:]}"
    raise AssertionError("the probe did not answer in time")


def test_ray_cluster_over_emulated_hosts():
    seen: set[int] = set()            # every Ray process of the cluster seen during the test
    with emulated_hosts(3, prefix=prefix_for(__name__)) as tb:
        h0, h1, h2 = tb.hosts
        rb = RayBed(tb, {0: NodeSpec(num_cpus=1), 1: NodeSpec(num_cpus=2, num_gpus=2),
                         2: NodeSpec(num_cpus=2, resources={"lender": 1}, labels={"pool": "lender"})}, head=0)
        try:
            assert rb.up(UP_S) == f"{h0.addr}:6379"
            print(f"bring-up of 3 nodes: {rb.bring_up_s:.1f} s")
            seen |= rb.processes()
            session = os.path.basename(os.path.realpath(os.path.join(rb.temp_dir, "h0", "session_latest")))
            assert session.startswith("session_")
            assert not os.path.exists(os.path.join(MACHINE_RAY_DIR, session))

            nodes = {node["ip"]: node for node in rb.nodes()}
            assert sorted(nodes) == sorted(h.addr for h in tb.hosts)
            assert nodes[h2.addr]["resources"].get("lender") == 1
            assert nodes[h2.addr]["labels"].get("pool") == "lender"
            assert nodes[h1.addr]["resources"].get("GPU") == 2 and "GPU" not in nodes[h0.addr]["resources"]
            assert [nodes[h.addr]["resources"]["CPU"] for h in tb.hosts] == [1, 2, 2]

            deadline = time.monotonic() + PROBE_S
            probe = h0.popen([sys.executable, PROBE, rb.address, nodes[h1.addr]["id"]],
                             env=h0.env(rb.env), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                placed = read_line(probe, deadline)
                seen |= rb.processes()                      # the actor's and the task's workers too
                assert {k: placed["lender"][k] for k in ("ip", "host_id", "node_id")} == \
                    {"ip": h2.addr, "host_id": h2.host_id, "node_id": nodes[h2.addr]["id"]}
                assert {k: placed["pinned"][k] for k in ("ip", "host_id", "node_id")} == \
                    {"ip": h1.addr, "host_id": h1.host_id, "node_id": nodes[h1.addr]["id"]}
                assert placed["lender"]["pid"] in rb.processes(2)
                connect = ("import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                           "timeout=10); s.sendall(b'hello from ' + sys.argv[3].encode()); s.close()")
                h1.run([sys.executable, "-c", connect, h2.addr, str(placed["port"]), h1.host_id],
                       timeout=20, check=True)
                assert read_line(probe, deadline) == {"peer": h1.addr, "data": f"hello from {h1.host_id}"}
                assert probe.wait(max(1.0, deadline - time.monotonic())) == 0
            finally:
                if probe.poll() is None:
                    probe.kill()
                    probe.wait()

            doomed = rb.processes(2)
            dead_after = rb.kill_node(2, timeout=DEAD_S)
            print(f"node on h2 seen dead {dead_after:.1f} s after its Ray processes were killed")
            assert dead_after < DEAD_S and not running(doomed)
            assert sorted(node["ip"] for node in rb.nodes()) == sorted([h0.addr, h1.addr])
            seen |= rb.processes()
        finally:
            temp_dir = rb.temp_dir
            seen |= rb.processes()
            rb.down()
        assert not running(seen), f"Ray processes left after down(): {sorted(running(seen))}"
        assert all(tb.pids(h) == [] for h in tb.hosts), {h.name: tb.pids(h) for h in tb.hosts}
        assert temp_dir and not os.path.exists(temp_dir)
        rb.down()                                            # idempotent
    assert not running(seen)


def test_a_node_ray_refuses_fails_up_and_leaves_nothing():
    with emulated_hosts(2, prefix=prefix_for(__name__, 1)) as tb:
        h0, h1 = tb.hosts
        # Ray refuses CPU as a custom resource (--num-cpus says it): h1's `ray start` exits
        rb = RayBed(tb, {0: NodeSpec(num_cpus=1), 1: NodeSpec(num_cpus=1, resources={"CPU": 4})})
        started = time.monotonic()
        with pytest.raises(RayBedError, match=f"node on {h1.name} exited with 1") as failure:
            rb.up(UP_S)
        assert time.monotonic() - started < UP_S / 2
        assert "--num-cpus" in str(failure.value)            # Ray's own words, from the node's log
        assert rb.temp_dir is None and all(tb.pids(h) == [] for h in tb.hosts)
