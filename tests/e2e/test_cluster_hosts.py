"""``dlrt cluster up --ray`` on a Ray cluster whose nodes are emulated hosts (root only).

Five hosts of ``dlrt testbed`` (own addresses, own host ids, links shaped to 1 Gbit/s), each
a Ray node (``dlrt_bench.raybed``): h0 the head, h1 and h2 one fake GPU each (``gpu1``,
``gpu2``), h3 and h4 two CPUs each that lend aggregators (Ray resource ``autops``); h1–h4
lend memory (``infiniswap``). From h0, the README's ``dlrt cluster up --ray HEAD:6379
--config cluster.toml`` (the block under the marker, run as written but for the address and
the file) brings the three systems up on that cluster. Then:

* a Tiresias job of 2 GPUs runs on gpu1 and gpu2 (Ray executor), its two workers pushing to
  two aggregators that pMaster started, as Ray actors, on h3 and h4 -- the job's bytes cross
  the shaped links of all four hosts (each host's counters);
* the Tiresias master sees the daemons' memory on its GPU nodes (``--node-host`` wiring);
* killing h4's Ray node (a machine lost) fails its aggregator over (pMaster marks it lost and
  the job's keys move to h3) and the job keeps training;
* killing h2's Ray node requeues the job (its run lost with the node);
* ``dlrt cluster down`` stops every service; the testbed's teardown finds nothing running
  in any host, and no Ray or service process of the test is left (by pid).

Printed (``-s``): the time from ``dlrt cluster up`` to the job running, and the bytes each
host moved.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import shlex
import sys
import time

import psutil
import pytest

from testbed_fixture import emulated_hosts, prefix_for
from waiting import until

if importlib.util.find_spec("ray") is None:           # pragma: no cover - depends on the machine
    pytest.skip("Ray is not installed; pip install ray==2.60.0 to run these tests", allow_module_level=True)

from dlrt_bench.raybed import NodeSpec, RayBed      # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = "<!-- tests/e2e/test_cluster_hosts.py runs this line: cluster-up -->"
PY = sys.executable


def readme_up_command(head: str, config: str) -> list[str]:
    """The README's ``dlrt cluster up --ray HEAD:6379 --config cluster.toml`` (the fenced
    block under the marker holds it), with the test's address and file."""
    text = (ROOT / "README.md").read_text()
    assert text.count(MARKER) == 1, f"README.md has no (single) marker {MARKER}"
    block = text.split(MARKER, 1)[1].split("```", 2)[1]
    line = next(line.split("#")[0].strip() for line in block.splitlines() if line.startswith("dlrt cluster up"))
    argv = shlex.split(line.replace("HEAD:6379", head).replace("cluster.toml", config))
    assert argv[:3] == ["dlrt", "cluster", "up"] and "--ray" in argv, line
    return [PY, "-m", "dlrt.main", *argv[1:]]


def step(job: dict) -> int:
    return int((job.get("progress") or {}).get("step") or 0)


def run_json(host, argv: list[str], timeout: float = 60) -> dict:
    done = host.run(argv, capture_output=True, timeout=timeout)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode())


def test_cluster_up_on_ray_over_emulated_hosts(tmp_path):
    state = tmp_path / "cluster"
    config = tmp_path / "cluster.toml"
    config.write_text(f"""
[cluster]
state = "{state}"
start_timeout = 120
[autops]
ray_resource = "autops"
max_aggregators = 4
[infiniswap]
ray_resource = "infiniswap"
headroom = "64M"
capacity = "256M"
args = ["--slab-size", "16M", "--no-lock", "--report-interval", "0.5"]
[tiresias]
args = ["--interval", "1", "--stop-grace", "5"]
""")
    lend = {"infiniswap": 1}
    specs = {0: NodeSpec(num_cpus=1),
             1: NodeSpec(num_cpus=1, num_gpus=1, resources=lend, labels={"tiresias.io/node": "gpu1"}),
             2: NodeSpec(num_cpus=1, num_gpus=1, resources=lend, labels={"tiresias.io/node": "gpu2"}),
             3: NodeSpec(num_cpus=2, resources={**lend, "autops": 2}),
             4: NodeSpec(num_cpus=2, resources={**lend, "autops": 2})}
    seen: set[int] = set()
    with emulated_hosts(5, link="1gbit", prefix=prefix_for(__name__)) as tb:
        h0 = tb.hosts[0]
        hosts = {h.host_id: h for h in tb.hosts}
        rb = RayBed(tb, specs, head=0)
        try:
            address = rb.up(90)
            print(f"\nRay on 5 emulated hosts: up in {rb.bring_up_s:.1f} s")
            began = time.monotonic()
            up = run_json(h0, readme_up_command(address, str(config)) + ["--json", "-"], timeout=300)
            up_s = time.monotonic() - began
            rows = {r["name"]: r for r in up["services"]}
            assert all(r["answers"] for r in rows.values()), rows
            daemons = sorted(r["where"].split()[0] for n, r in rows.items() if n.startswith("dlrt-infiniswap-"))
            assert daemons == sorted(h.addr for h in tb.hosts[1:]), rows
            assert rows["dlrt-autops-master"]["where"].startswith(h0.addr + " ")
            print(f"dlrt cluster up: {up_s:.1f} s")

            tiresias = [PY, "-m", "tiresias.cli"]
            st = ["--state", str(state / "tiresias")]
            until("the master sees each GPU node's daemon (--node-host)", lambda: sorted(
                n["name"] for n in run_json(h0, tiresias + ["nodes", *st, "--json", "-"])
                if n.get("memory_lendable_bytes")) == ["gpu1", "gpu2"], timeout=60)
            counters0 = {h.host_id: tb.counters(h) for h in tb.hosts}
            sub = run_json(h0, tiresias + ["submit", *st, "--json", "-", "--gpus", "2", "--autops-aggregators", "2",
                                           "--name", "digits", "--", str(ROOT / "examples/train_digits.py"),
                                           "--epochs", "400", "--mode", "server", "--optimizer", "adam"])
            job = str(sub["id"])

            def job_state() -> dict:
                return run_json(h0, tiresias + ["job", job, *st, "--json", "-"])

            def pool() -> dict:
                return run_json(h0, [PY, "-m", "autops.cli", "status", "--master",
                                     rows["dlrt-autops-master"]["endpoint"], "--json", "-"])
            until("the job runs and trains", lambda: step(job_state()) > 5, timeout=240)
            running_s = time.monotonic() - began
            print(f"from `dlrt cluster up` to the job training: {running_s:.1f} s")
            status = pool()
            mine = [a for a in status["aggregators"] if a.get("alive")]
            assert sorted(a["host"] for a in mine) == [tb.hosts[3].host_id, tb.hosts[4].host_id], mine
            moved = {hid: (lambda c, c0: (c.sent - c0.sent, c.received - c0.received))(tb.counters(h), counters0[hid])
                     for hid, h in hosts.items()}
            print("bytes each host moved while the job trained (sent, received): "
                  + ", ".join(f"{hid}: {s}/{r}" for hid, (s, r) in moved.items()))
            for h in tb.hosts[1:]:
                assert min(moved[h.host_id]) > 100_000, moved   # the job's pushes and pulls crossed every link

            seen |= {p for i in specs for p in rb.processes(i)}
            steps = step(job_state())
            dead_s = rb.kill_node(4)
            print(f"h4's Ray node killed: the GCS saw it dead in {dead_s:.1f} s")
            until("pMaster fails h4's aggregator over", lambda: not any(
                a["host"] == tb.hosts[4].host_id and a.get("alive") for a in pool()["aggregators"]), timeout=60)
            until("the job trains on", lambda: step(job_state()) > steps + 5, timeout=120)

            rb.kill_node(2)
            until("the job is requeued with its run lost on gpu2 (it waits for 2 GPUs again)",
                  lambda: job_state().get("status") in ("preempted", "waiting"), timeout=120)

            down = h0.run([PY, "-m", "dlrt.main", "cluster", "down", "--ray", address, "--config", str(config)],
                          capture_output=True, timeout=120)
            assert down.returncode == 0, down.stderr.decode()[-2000:]
            assert b"stopped dlrt-tiresias-master" in down.stdout
            seen |= {p for i in specs for p in rb.processes(i)}
        finally:
            rb.down()
        left = {p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        assert not left, f"Ray processes of the test still run: {sorted(left)}"
    until("no process of the setup is left", lambda: not [
        p for p in psutil.process_iter(["cmdline"]) if any(str(state) in a for a in p.info["cmdline"] or [])],
        timeout=30)
