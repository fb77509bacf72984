"""AutoPS across emulated hosts: a W=2 job whose aggregators sit on other hosts, and the
benchmark that compares it with gloo there.

pMaster and aggregator 0 on host 0, aggregator 1 on host 1, the workers on hosts 2 and 3
(``dlrt_bench.testbed``, 1 Gbit/s links). The results must be bit-identical to the same job on
loopback (the mean of two pushes does not depend on their order), and the links' byte
counters must show that the pushes and the results crossed the bridge: with ``auto``
transports, ipc or shared memory between the namespaces (which share unix sockets and
``/dev/shm``) would have bypassed it. Needs root; skips with the reason otherwise.
"""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from autops.local import LocalPool
from dlrt_bench.testbed import available, cleanup, leftovers
from dlrt_bench.autops_hosts import HostPool
from dlrt_bench.autops_pushpull import main as pushpull_main
from testbed_fixture import prefix_for, testbed  # noqa: F401 (fixture)

WORKER = str(pathlib.Path(__file__).with_name("autops_hosts_worker.py"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from autops_hosts_worker import ITERATIONS, TENSORS  # noqa: E402

MODEL_BYTES = sum(math.prod(shape) * 4 for _, shape, _ in TENSORS)


def run_workers(start, master: str, job: str, out_dir: pathlib.Path) -> list[dict]:
    """Start both ranks (``start(rank, argv)`` gives the process) and wait for them."""
    procs = [start(rank, [sys.executable, WORKER, master, job, str(rank), "2", str(out_dir / f"{job}-{rank}.npz")])
             for rank in range(2)]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
        answers.append(json.loads(out))
    return answers


def test_a_job_across_hosts_matches_loopback_and_crosses_the_links(testbed, tmp_path):  # noqa: F811
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with LocalPool(2, master_args=["--static"]) as pool:
        run_workers(lambda rank, argv: subprocess.Popen(argv, env=pool.env, **pipes), pool.master, "loop", tmp_path)

    tb = testbed(hosts=4, link="1gbit")
    with HostPool(tb, tb.hosts[:2]) as pool:
        before = [tb.counters(host) for host in tb.hosts]
        answers = run_workers(lambda rank, argv: tb.hosts[2 + rank].popen(argv, **pipes), pool.master, "hosts",
                              tmp_path)
        after = [tb.counters(host) for host in tb.hosts]
        security = pool.status()["security"]
    assert security["curve"], security                # beyond loopback the testbed runs with CURVE
    assert set(answers[0]["placement"]) == {"agg-0", "agg-1"}       # both aggregator hosts serve keys

    for rank in range(2):
        here, there = np.load(tmp_path / f"loop-{rank}.npz"), np.load(tmp_path / f"hosts-{rank}.npz")
        assert sorted(here.files) == sorted(there.files) and len(here.files) == len(TENSORS) * ITERATIONS
        for name in here.files:
            assert here[name].tobytes() == there[name].tobytes(), name

    sent = [a.sent - b.sent for a, b in zip(after, before)]
    received = [a.received - b.received for a, b in zip(after, before)]
    pushed = ITERATIONS * MODEL_BYTES                     # each worker pushes its model, pulls it back
    for worker in (2, 3):
        assert sent[worker] >= pushed and received[worker] >= pushed, (sent, received)
    assert sum(sent[:2]) >= 2 * pushed and sum(received[:2]) >= 2 * pushed, (sent, received)


def test_the_benchmark_across_emulated_hosts_writes_the_contracted_fields(tmp_path):
    reason = available()
    if reason:
        pytest.skip(f"emulated hosts unavailable: {reason}")
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"tiny": {"tensors": [["w", [262_144]], ["b", [1000]]]}}))
    out = tmp_path / "rows.json"
    prefix = prefix_for(__name__, 9)
    cleanup(prefix)
    assert pushpull_main(["--emulate-hosts", "--workers", "2", "--aggregators", "same", "--link", "10gbit",
                          "--model", "tiny", "--shapes", str(shapes), "--iters", "2", "--rounds", "2",
                          "--warmup", "1", "--prefix", prefix, "--json", str(out)]) == 0
    assert not leftovers(prefix)
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["model"], row["workers"], row["aggregators"], row["link"], row["site"]) == ("tiny", 2, 2, "10gbit",
                                                                                            "emulated")
    assert row["autops_s"] > 0 and row["gloo_s"] > 0 and row["ratio"] == row["autops_s"] / row["gloo_s"]
    model = (262_144 + 1000) * 4
    # each worker's push left its host over its link, and gloo ran over the same worker links
    assert row["autops_link_bytes"]["workers_sent"] >= 2 * model and row["autops_workers_sent_over_model"] >= 1
    assert row["gloo_link_bytes"]["workers_sent"] >= 2 * model        # a ring moves (W-1)/W x 2 x model each


def test_the_migration_benchmark_across_emulated_hosts_moves_the_job_and_reports_its_pauses(tmp_path):
    reason = available()
    if reason:
        pytest.skip(f"emulated hosts unavailable: {reason}")
    from dlrt_bench.autops_migrate import main as migrate_main
    out = tmp_path / "migrate.json"
    prefix = prefix_for(__name__, 8)
    cleanup(prefix)
    assert migrate_main(["--emulate-hosts", "--link", "10gbit", "--model", "alexnet", "--scale", "0.02",
                         "--other", "none", "--repeats", "1", "--warmup", "2", "--gap", "3", "--skip", "1",
                         "--time-scale", "0.1", "--prefix", prefix, "--json", str(out)]) == 0
    assert not leftovers(prefix)
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["site"], row["link"], row["all_completed"]) == ("emulated", "10gbit", True)
    assert row["keys_moved"] > 0 and row["per_repeat"][0]["switch_iterations"]
    assert set(row["per_repeat"][0]["to"]).isdisjoint(row["per_repeat"][0]["from"])
    assert row["max_pause_ms"] is not None and row["median_pause_ms"] is not None
    assert row["pause_baseline"] == "job" and row["max_pause_vs_worker_ms"] is not None
    # each worker warmed its connection to each new owner before the switch, and had it back
    assert row["warm_bytes"] == 32 << 20
    assert row["warmed_connections"] == 2 * len(row["per_repeat"][0]["to"]), row["warmed_connections"]
    # every host's TCP counters were sampled: the switch iteration's pushes and pulls crossed them
    assert row["tcp_quiet"]["iterations"] > 0
    assert row["per_repeat"][0]["tcp_switch"]["OutSegs"] > 0


def test_the_tail_loss_benchmark_blacks_out_a_link_and_each_arm_keeps_its_floor(tmp_path):
    """``bench/autops_tail_loss.py``: both arms deliver the message through the blackout, the
    links' arm runs with the lowered floor and the kernel's with 200 ms (read from the sender's
    TCP_INFO: its timer), and the testbed is gone afterwards."""
    reason = available()
    if reason:
        pytest.skip(f"emulated hosts unavailable: {reason}")
    from autops.transport import tcpopts
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
    from autops_tail_loss import main as tail_loss_main
    out = tmp_path / "tail.json"
    prefix = prefix_for(__name__, 2)
    cleanup(prefix)
    assert tail_loss_main(["--trials", "1", "--size", "128M", "--prefix", prefix, "--json", str(out)]) == 0
    assert not leftovers(prefix)
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"kernel", "links"}
    assert rows["kernel"]["rto_min_us_taken"] is None
    assert rows["kernel"]["sender_rto_us_median"] >= tcpopts.KERNEL_RTO_MIN_US
    if rows["links"]["rto_min_us_taken"] is not None:          # None: a kernel before 6.15
        assert tcpopts.RTO_MIN_US <= rows["links"]["rto_min_us_taken"] < 2 * tcpopts.RTO_MIN_US
        assert rows["links"]["sender_rto_us_median"] < tcpopts.KERNEL_RTO_MIN_US
    for row in rows.values():                                  # the blackout lost segments
        assert row["retransmitted_segments_median"] > 0 and row["blackout_transfer_ms"] > 0
