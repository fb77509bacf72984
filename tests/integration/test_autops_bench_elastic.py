"""Smoke test of ``autops bench packing`` (through the ``autops`` command, which imports the
benchmark lazily) and ``autops bench migrate`` (``dlrt_bench`` directly) in tiny configurations.

Real pMaster, aggregator and worker processes on loopback; alexnet with 1% of its elements
and half its iteration time, so both benchmarks finish in well under a minute together.
"""
from __future__ import annotations

import json

import pytest

from autops.cli import main as autops_main
from dlrt_bench.autops_migrate import main as migrate_main

pytestmark = pytest.mark.timeout(180)


def test_packing_shares_aggregators_and_reports_every_figure(tmp_path):
    out = tmp_path / "packing.json"
    rc = autops_main(["bench", "packing", "--jobs", "2", "--model", "alexnet", "--scale", "0.01", "--time-scale", "0.5",
                       "--measure-iters", "10", "--min-window", "2", "--settle-iters", "2", "--stagger", "0.5",
                       "--calib-iters", "4", "--warmup-iters", "2", "--profile-iters", "3", "--period", "2",
                       "--steady-timeout", "40", "--json", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    for key in ("aggregators_shared", "aggregators_dedicated", "cpu_s_per_iter_shared", "cpu_s_per_iter_dedicated",
                "max_slowdown", "aggregator_reduction", "job_detail", "scale", "iteration_target_s", "params"):
        assert key in row, key
    assert row["model"] == "alexnet" and row["jobs"] == 2 and row["scale"] == 0.01
    assert row["aggregators_dedicated"] == 4
    assert 1 <= row["aggregators_shared"] <= row["aggregators_dedicated"]
    assert row["all_packed"], row["shared"]["timeline"][-1]
    assert row["cpu_s_per_iter_shared"] > 0 and row["cpu_s_per_iter_dedicated"] > 0
    assert len(row["job_detail"]) == 2
    for job in row["job_detail"]:
        assert job["state"] in ("packed", "dedicated")
        assert job["dedicated_it_s"] > 0 and job["shared_it_s"] > 0
    assert row["shared"]["migrations_total"]["failed"] == 0


def test_migrate_moves_every_key_and_reports_the_pause(tmp_path):
    out = tmp_path / "migrate.json"
    rc = migrate_main(["--model", "alexnet", "--scale", "0.01", "--time-scale", "0.5", "--repeats", "1",
                       "--warmup", "3", "--gap", "3", "--thread-cpu", "--json", str(out)])
    assert rc == 0
    row = json.loads(out.read_text().splitlines()[0])
    for key in ("model", "mode", "max_pause_ms", "median_pause_ms", "migration_s", "keys_moved", "baseline_comm_ms",
                "worker_end_skew_ms_median"):
        assert key in row, key
    assert row["model"] == "alexnet" and row["mode"] == "sum"
    assert row["all_completed"] and row["migrations_failed"] == 0
    assert row["keys_moved"] > 0 and row["migrations_completed_keys"] >= row["keys_moved"]
    rep = row["per_repeat"][0]
    assert rep["done"] and set(rep["to"]).isdisjoint(rep["from"])
    assert len(row["migration_s"]) == 1 and row["migration_s"][0] > 0
    assert row["max_pause_ms"] is not None and row["baseline_comm_ms"] > 0
    # the first reply of an iteration comes after both workers started it
    assert rep["first_reply_ms"] is not None and rep["first_reply_ms"] > 0
    assert row["first_reply_ms_quiet_median"] > 0
    # every aggregator's cyclic execution at the end: its cycle and the aggregations put off
    assert len(row["cycles"]) == row["aggregators"]
    assert all(c["late"] >= 0 and c["postponed"] >= 0 for c in row["cycles"].values())
    # each worker's iterations on the monotonic clock, as comm_ms has them
    assert [len(t) for t in row["timeline"]] == [len(c) for c in row["comm_ms"]]
    assert all(b <= s <= e for t in row["timeline"] for _, b, s, e in t)
    # the hand-overs each aggregator sent as an old owner (as its last heartbeat counted them)
    assert set(row["handovers"]) == set(row["cycles"])
    assert all(set(h) == {"messages", "cpu_s", "keys"} for h in row["handovers"].values())
    # the machine's CPU time over the switch and per iteration without a migration
    assert set(rep["cpu_switch"]) == {"steal_ms", "idle_ms", "busy_ms", "by_process", "by_thread", "over_after_ms",
                                      "over_after_by_thread_ms"}
    # per thread (--thread-cpu), named process/thread: the workers' main threads and their
    # agents' I/O threads, compared with the iterations after the move where they used CPU
    threads = rep["cpu_switch"]["by_thread"]
    assert set(threads) == set(rep["cpu_switch"]["by_process"])
    assert all(ms > 0 for ts in threads.values() for ms in ts.values())
    assert all(name.split("/", 1)[0] in threads for name in rep["cpu_switch"]["over_after_by_thread_ms"])
    # every aggregator and worker process is followed, and compared with its CPU after the move
    assert {"r0", "r1", "pmaster", "bench"} <= set(rep["cpu_switch"]["by_process"])
    assert set(rep["cpu_switch"]["over_after_ms"]) == set(rep["cpu_switch"]["by_process"])
    # the old owners' last iteration, each process against the iterations before the move
    assert {"steal_ms", "idle_ms", "busy_ms", "by_process", "over_before_ms", "by_thread"} <= set(rep["cpu_cutover"])
    assert set(rep["cpu_cutover"]["over_before_ms"]) == set(rep["cpu_cutover"]["by_process"])
    assert rep["cutover_ms"] is not None and rep["cutover_end_skew_ms"] >= 0
    assert row["cutover_ms_per_repeat"] == [rep["cutover_ms"]]
    assert row["cpu_quiet"]["iterations"] > 0 and row["cpu_quiet"]["steal_ms_median"] >= 0
    assert len(row["cpu_quiet"]["per_iteration"]) >= row["cpu_quiet"]["iterations"]
    # the new owner's view of the switch: the first push and the hand-over came before the
    # keys' first iteration there was complete
    assert len(rep["new_owner_ms"]) == rep["batches"]
    for batch in rep["new_owner_ms"]:
        assert batch["first_push"] <= batch["done"] and batch["handover"] <= batch["done"], batch
