"""``autops simulate``: the trace-driven pool simulation on tiny traces whose numbers are
derived by hand from the job model (keys of exactly 4 MiB are one task each; ``--agg-rate`` is
chosen so a key costs a round number of CPU seconds per worker)."""
from __future__ import annotations

import json
import math
import random

import pytest

from autops.master.assignment import final_moves, free_time, loss, pack_job, recycle
from autops.master.simulate import (Simulation, SimConfig, fitting_aggregators, main, merge_by_duration, must_open,
                                    recycle_is_futile, simulate)
from dlrt.trace import load_trace

MIB4 = 4 << 20                      # one key of exactly 4 MiB (not partitioned)
FLOATS_4MIB = [MIB4 // 4]


@pytest.fixture
def shapes(tmp_path):
    def tensors(n):
        return [[f"w{i}", FLOATS_4MIB] for i in range(n)]
    models = {"one": {"tensors": tensors(1)}, "two": {"tensors": tensors(2)},
              "five": {"tensors": tensors(5)},
              # a mixed model: a partitioned tensor (10 MiB -> 3 keys), a 1 MiB one and small ones
              "mix": {"tensors": [["big", [10 * 2**18]], ["mid", [2**18]], ["b1", [64]], ["b2", [300]]]}}
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(models))
    return str(path)


def _trace(tmp_path, rows, model=False):
    path = tmp_path / "trace.csv"
    head = "job_id,submit_time,num_gpus,duration" + (",model" if model else "")
    path.write_text(head + "\n" + "\n".join(",".join(str(v) for v in r) for r in rows) + "\n")
    return load_trace(path).jobs


def _config(shapes, key_cost, **kw):
    """Each 4 MiB key costs ``key_cost`` CPU seconds per worker per iteration."""
    base = dict(models=("one",), iter_seconds={"one": 1.0, "two": 1.0, "five": 1.0, "mix": 1.0},
                agg_rate=MIB4 / key_cost, shapes=shapes, profile_seconds=60, period=300, interval=60)
    base.update(kw)
    return SimConfig(**base)


def _at(result, t):
    """(allocated, requested) sampled at time ``t``."""
    ts, alloc, req = result["_samples"]
    i = list(ts).index(t)
    return alloc[i], req[i]


def test_two_overlapping_jobs_share_one_aggregator(tmp_path, shapes):
    # 1 GPU each -> W = 1, requested 1; one key of 0.25 s per 1 s iteration: both fit one aggregator.
    jobs = _trace(tmp_path, [(0, 0, 1, 1000), (1, 0, 1, 1000)])
    r = simulate(jobs, _config(shapes, 0.25))
    # [0, 60): two temporaries; [60, 1000): one aggregator -> 1 - (2*60 + 940) / 2000
    assert r["cpu_saving"] == pytest.approx(1 - 1060 / 2000)
    assert r["fluid_bound_saving"] == pytest.approx(1 - 0.5 * 1000 / 2000)
    assert _at(r, 0) == (2, 2) and _at(r, 60) == (1, 2) and _at(r, 960) == (1, 2)
    assert (r["peak_allocated"], r["peak_requested"]) == (2, 2)
    assert (r["aggregators_opened"], r["jobs_placed"], r["migrations"]) == (1, 2, 0)


def test_single_job_saves_only_what_its_packing_allows(tmp_path, shapes):
    # 16 GPUs -> W = 4, requested 4; five keys of 4 * 0.1 = 0.4 s: demand 2.0 aggregators but two
    # keys fill an aggregator (a third would need 1.2 s of a 1 s cycle) -> 3 aggregators.
    jobs = _trace(tmp_path, [(0, 0, 16, 1000)], model=False)
    r = simulate(jobs, _config(shapes, 0.1, models=("five",)))
    assert r["aggregators_opened"] == 3
    assert r["cpu_saving"] == pytest.approx(1 - (4 * 60 + 3 * 940) / 4000)
    assert r["fluid_bound_saving"] == pytest.approx(0.5)
    assert _at(r, 0) == (4, 4) and _at(r, 60) == (3, 4)


def test_recycling_after_exit_frees_an_aggregator(tmp_path, shapes):
    # four jobs of two 0.3 s keys, profiled at 60, 70, 80, 90 s:
    #   a0 = {J0 .6, J1 .3}, a1 = {J1 .3, J2 .6}, a2 = {J3 .6}
    # J0 exits at 500: a0 keeps J1's .3; recycle moves it to a2 (.9) and frees a0.
    rows = [(0, 0, 1, 500), (1, 10, 1, 2000), (2, 20, 1, 2000), (3, 30, 1, 2000)]
    r = simulate(_trace(tmp_path, rows), _config(shapes, 0.3, models=("two",)))
    assert _at(r, 480) == (3, 4)
    assert _at(r, 540) == (2, 3)
    assert (r["migrations"], r["recycled_aggregators"], r["aggregators_opened"]) == (1, 1, 3)
    alloc = 10 * 1 + 10 * 2 + 10 * 3 + 30 * 4 + 10 * 4 + 10 * 4 + 10 * 3 + 410 * 3 + 1510 * 2 + 10 * 2 + 10 * 1
    req = 10 * 1 + 10 * 2 + 10 * 3 + 470 * 4 + 1510 * 3 + 10 * 2 + 10 * 1
    assert r["allocated_aggregator_seconds"] == pytest.approx(alloc)
    assert r["requested_aggregator_seconds"] == pytest.approx(req)
    assert r["cpu_saving"] == pytest.approx(1 - alloc / req)


def test_release_at_period_keeps_idle_aggregators_and_reuses_them(tmp_path, shapes):
    rows = [(0, 0, 1, 400), (1, 500, 1, 400)]
    exit_mode = simulate(_trace(tmp_path, rows), _config(shapes, 0.25))
    period_mode = simulate(_trace(tmp_path, rows), _config(shapes, 0.25, release="period"))
    # exit: 60 + 340 (job 0), 60 + 340 (job 1) = 800 = requested -> nothing saved
    assert exit_mode["cpu_saving"] == pytest.approx(0.0)
    assert exit_mode["aggregators_opened"] == 2
    # period: job 0's aggregator idles from 400 until job 1, profiled at 560, reuses it
    assert period_mode["allocated_aggregator_seconds"] == pytest.approx(800 + 100 + 60)
    assert period_mode["aggregators_opened"] == 1
    assert _at(period_mode, 540) == (2, 1)                # a ratio of 2, as in Fig. 4.12's tail
    assert period_mode["ratio_percentiles"]["max"] == 2.0


def test_deferred_allocation_waits_on_temporaries_for_the_period(tmp_path, shapes):
    # 8 GPUs -> W = 2, requested 2, one key of 0.5 s -> 1 new aggregator; threshold 2 defers it to t=300
    rows = [(0, 0, 8, 1000)]
    now = simulate(_trace(tmp_path, rows), _config(shapes, 0.25))
    later = simulate(_trace(tmp_path, rows), _config(shapes, 0.25, threshold=2))
    assert now["cpu_saving"] == pytest.approx(1 - (2 * 60 + 940) / 2000)
    assert later["cpu_saving"] == pytest.approx(1 - (2 * 300 + 700) / 2000)
    assert (now["deferred_allocations"], later["deferred_allocations"]) == (0, 1)
    assert _at(later, 240) == (2, 2) and _at(later, 300) == (1, 2)


def test_job_shorter_than_profiling_never_packs(tmp_path, shapes):
    r = simulate(_trace(tmp_path, [(0, 0, 4, 30)]), _config(shapes, 0.25))
    assert r["cpu_saving"] == 0.0 and r["jobs_placed"] == 0 and r["jobs_exited_while_profiling"] == 1


def test_cluster_size_spills_to_the_next_cluster(tmp_path, shapes):
    # cluster_size 1. Job 0 ("five", D 1.0, 5 keys of 0.1 s) fills half of a0, so its cluster has
    # 0.5 aggregators of free CPU >= job 1's demand ("one", D 0.3: 0.1 / 0.3). But job 1 cannot
    # share a0 (a 1 s cycle would slow it by 10%), so it needs a new aggregator.
    rows = [(0, 0, 1, 1000, "five"), (1, 10, 1, 1000, "one")]
    cfg = dict(iter_seconds={"five": 1.0, "one": 0.3}, cluster_size=1)
    spill = simulate(_trace(tmp_path, rows, model=True), _config(shapes, 0.1, **cfg))
    assert (spill["clusters_opened"], spill["largest_cluster"], spill["spills"]) == (2, 1, 1)
    grow = simulate(_trace(tmp_path, rows, model=True), _config(shapes, 0.1, oversize="grow", **cfg))
    assert (grow["clusters_opened"], grow["largest_cluster"], grow["oversize_placements"]) == (1, 2, 1)
    assert spill["cpu_saving"] == grow["cpu_saving"] == pytest.approx(0.0)


def test_model_column_is_used_when_known_else_drawn(tmp_path, shapes):
    jobs = _trace(tmp_path, [(0, 0, 1, 100, "two"), (1, 0, 1, 100, "nosuch"), (2, 0, 1, 100, "five")],
                  model=True)
    r = simulate(jobs, _config(shapes, 0.1, models=("one",)))
    assert r["model_counts"] == {"five": 1, "one": 1, "two": 1}


class _Checked(Simulation):
    """Checks the pool's invariants after every placement, exit and period."""

    def check(self):
        total = 0
        placed_demand = 0.0
        for cl in self.clusters.values():
            assert cl.loads.keys() == cl.tasks.keys()
            for agg, jobs in cl.loads.items():
                sums = {}
                for task, (jid, cost) in cl.tasks[agg].items():
                    assert self.jobs[jid].where[task] == agg
                    sums[jid] = sums.get(jid, 0.0) + cost
                assert set(sums) == set(jobs)
                for jid, (d, e) in jobs.items():
                    assert e == pytest.approx(sums[jid])
                if jobs:
                    cycle = max(d for d, _ in jobs.values())
                    assert free_time(cycle, jobs) > -1e-6
                    assert all(loss(d, cycle) < self.cfg.loss_limit for d, _ in jobs.values())
            total += len(cl.loads)
        for job in self.jobs.values():
            if job.state == "placed":
                assert len(job.where) == len(job.tasks)
                placed_demand += job.demand
        assert total == self.n_aggs
        assert self.n_aggs >= math.ceil(placed_demand - 1e-6)    # never below what packing needs
        assert self.temp == sum(j.requested for j in self.jobs.values() if j.state != "placed")

    def _place(self, job, force):
        super()._place(job, force)
        self.check()

    def _exit(self, job):
        super()._exit(job)
        self.check()

    def _period(self):
        super()._period()
        self.check()


@pytest.mark.parametrize("release", ["exit", "period"])
def test_random_trace_keeps_the_pool_consistent(tmp_path, shapes, release):
    rng = random.Random(7)
    rows = sorted(((i, rng.uniform(0, 4000), rng.choice([1, 1, 2, 4, 8, 16]), rng.uniform(10, 3000),
                    rng.choice(["mix", "two", "five", "one"])) for i in range(80)), key=lambda r: r[1])
    cfg = _config(shapes, 0.07, release=release, cluster_size=3,
                  iter_seconds={"mix": 1.0, "two": 0.5, "five": 0.3, "one": 1.0})
    r = _Checked(cfg).run(_trace(tmp_path, rows, model=True))
    assert r["jobs_placed"] > 50 and r["migrations"] > 0
    assert 0 < r["cpu_saving"] < r["fluid_bound_saving"] < 1
    assert r["peak_allocated"] <= r["peak_requested"] or release == "period"


def test_fitting_aggregators_leaves_pack_job_unchanged_and_must_open_is_a_lower_bound():
    rng = random.Random(3)
    bounded = 0
    for _ in range(200):
        loads = {}
        for n in range(rng.randint(0, 6)):
            jobs = {}
            for j in range(rng.randint(1, 3)):
                jobs[f"J{rng.randint(0, 9)}"] = (rng.choice([1.0, 0.5, 0.3, 0.9]), rng.uniform(0.0, 0.3))
            loads[f"a{n}"] = jobs
        d = rng.choice([1.0, 0.5, 0.3, 0.9])
        tasks = [(f"t{i}", rng.choice([0.01, 0.05, 0.1, 0.2])) for i in range(rng.randint(1, 12))]
        min_cost = min(c for _, c in tasks)
        name = lambda i: f"new{i}"                                # noqa: E731
        full = pack_job("X", d, tasks, loads, name)
        cand = fitting_aggregators(loads, "X", d, min_cost)
        assert pack_job("X", d, tasks, cand, name) == full
        lower = must_open(cand, "X", d, sum(c for _, c in tasks))
        assert lower <= len(full[1])
        bounded += lower > 0
    assert bounded > 20


def test_a_chained_recycle_plan_is_applied_whole():
    # a (20% busy) is freed onto b (its best fit); then b, with a's task, is freed onto c.
    loads = {"a": {"J0": (0.5, 0.1)}, "b": {"J1": (0.5, 0.15)}, "c": {"J2": (1.0, 0.3)}}
    tasks = {"a": [("J0", "t", 0.1)], "b": [("J1", "u1", 0.05), ("J1", "u2", 0.1)],
             "c": [("J2", "v1", 0.1), ("J2", "v2", 0.2)]}
    plan = recycle(loads, tasks, {"J0": 0.5, "J1": 0.5, "J2": 1.0})
    assert plan == [("a", {"t": "b"}), ("b", {"t": "c", "u2": "c", "u1": "c"})]
    assert final_moves(plan) == {"t": "c", "u1": "c", "u2": "c"}       # t moves once, a -> c


def test_cli_writes_json_and_png(tmp_path, shapes, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time,num_gpus,duration\n0,0,1,1000\n1,0,1,1000\n2,100,8,500\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["--trace", str(trace), "--shapes", shapes, "--models", "one", "--iter-seconds", "one=1.0",
               "--agg-rate", str(MIB4 / 0.25), "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    for key in ("cpu_saving", "jobs", "samples", "ratio_percentiles", "share_of_time_ratio_below_1",
                "peak_allocated", "peak_requested", "migrations", "clusters_peak", "wall_seconds",
                "parameters", "assumptions", "series"):
        assert key in data
    assert data["jobs"] == 3 and data["assumptions"]["iteration_seconds"]["one"] == 1.0
    assert set(data["ratio_percentiles"]) == {"p50", "p90", "p99", "max"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out)["cpu_saving"] == data["cpu_saving"]


def test_cli_rejects_unknown_model(tmp_path, shapes, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time,num_gpus,duration\n0,0,1,10\n")
    assert main(["--trace", str(trace), "--shapes", shapes, "--models", "nosuch", "--no-progress"]) == 2
    assert "nosuch" in capsys.readouterr().err


def _random_loads(rng, durations, grains=64):
    """Aggregators with e values on a 1/64 grid, so sums are exact in any order."""
    loads, tasks = {}, {}
    job_d = {}
    for n in range(rng.randint(1, 7)):
        name = f"a{n}"
        loads[name], tasks[name] = {}, []
        for _ in range(rng.randint(1, 3)):
            job = f"j{rng.randint(0, 11)}"
            d = job_d.setdefault(job, rng.choice(durations))
            parts = [rng.randint(1, 8) / grains for _ in range(rng.randint(1, 4))]
            if sum(parts) + sum(e for _, e in loads[name].values()) > 0.9 * d:
                continue
            old = loads[name].get(job, (d, 0.0))[1]
            loads[name][job] = (d, old + sum(parts))
            tasks[name] += [(job, f"{job}/{name}/{i}/{len(tasks[name])}", p) for i, p in enumerate(parts)]
        if not loads[name]:
            del loads[name], tasks[name]
    return loads, tasks, job_d


def test_merged_view_gives_pack_job_and_recycle_the_same_answers():
    rng = random.Random(11)
    for _ in range(300):
        loads, tasks, job_d = _random_loads(rng, [1.0, 0.5, 0.25, 0.75])
        merged = {n: merge_by_duration(j) for n, j in loads.items()}
        assert recycle(merged, tasks, job_d) == recycle(loads, tasks, job_d)
        d = rng.choice([1.0, 0.5, 0.25, 0.75])
        new = [(f"t{i}", rng.randint(1, 16) / 64) for i in range(rng.randint(1, 10))]
        name = lambda i: f"new{i}"                                # noqa: E731
        assert pack_job("X", d, new, merged, name) == pack_job("X", d, new, loads, name)


def test_recycle_is_futile_only_when_recycle_returns_nothing():
    rng = random.Random(5)
    futile = 0
    for _ in range(1500):
        loads, tasks, job_d = _random_loads(rng, rng.choice([[1.0], [1.0, 0.5], [1.0, 0.3]]))
        if recycle_is_futile(loads, tasks, job_d):
            futile += 1
            assert recycle(loads, tasks, job_d) == []
    assert futile > 100           # the check does cut work
