"""Tesserae's GPU sharing in the simulator: what packing gains at several loads, what its
migration rule saves, what profiling noise costs, and how long one round takes (JSON out).

1. Gain vs load, on 80 GPUs (20x4, the paper's cluster size): Shockwave-style workloads
   (``tiresias workload --kind shockwave``, the Tesserae authors' table) and Gavel-style ones
   (``--kind gavel``, Gavel's table at its v100 entry) of ``--jobs`` jobs at several arrival
   rates, each simulated with ``las`` (Tiresias, no sharing), ``tesserae-las`` and
   ``gavel-las`` (Gavel's greedy packing), all in rounds of 360 s, ``las`` at every event (the
   project's default) as a second peer, and ``tesserae-las --fresh-plans`` (each round planned
   from an empty cluster, as the paper does). Per rate: the offered load, per policy average
   JCT, makespan, migrations (and what the same plans would have cost without Tesserae's
   renaming), finish-time fairness, and the ratios to ``las`` in rounds. Seeds are averaged.
   Under Optimus's allocation: ``optimus`` against ``tesserae-optimus`` in its rounds of 600 s.
2. Profile noise (the paper's Fig. 16): ``tesserae-las`` on the Shockwave workload at 80
   jobs/hour deciding with every pair's speeds off by a factor uniform in [1-L, 1+L], with and
   without learning the speeds packed jobs run at; average JCT relative to an exact profile.
3. One round with N active jobs on 256 GPUs (32x8), N = 256 .. 4096 (``round_s_2048`` and
   ``round_s_3000`` are the paper's points: under 1.6 s and under 1 s; goal here 0.2 s): the
   policy's ordering (2D-LAS over every active job), the placement, packing by matching and
   migration by renaming, each timed; the peer is the round without packing.

    python bench/tesserae_scale.py --json bench/results/tesserae_scale.json
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiresias import cli  # noqa: E402
from tiresias.generate import generate, write_trace  # noqa: E402
from tiresias.load import offered_load  # noqa: E402
from tiresias.packing.profiles import load_profiles  # noqa: E402
from tiresias.packing.rounds import RoundJob, plan_round  # noqa: E402
from tiresias.policies.base import JobState  # noqa: E402
from tiresias.policies.las import DiscretizedLAS  # noqa: E402

CLUSTER = "20x4"
GPUS = 80
POLICIES = ("las", "tesserae-las", "gavel-las")
KEYS = ("avg_jct", "makespan", "migrations", "migrations_without_matching", "ftf_max", "ftf_mean", "preemptions")
GAVEL_TABLE = cli.DEFAULT_COLOCATION.with_name("gavel_simulation_throughputs.json")


def _tiresias(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):       # the table: the JSON is what we keep
        rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"tiresias {' '.join(argv)} failed")


def _compare(trace: pathlib.Path, table: pathlib.Path, out: pathlib.Path, policies, *extra: str) -> list[dict]:
    _tiresias(["compare", "--trace", str(trace), "--cluster", CLUSTER, "--no-progress", "--json", str(out),
               "--policies", ",".join(policies), "--colocation", str(table), *extra])
    return json.loads(out.read_text())


def gain_vs_load(kind: str, table: pathlib.Path, rates: list[float], jobs: int, seeds: list[int],
                 tmp: pathlib.Path) -> list[dict]:
    store = load_profiles(table)
    types = [(t.model, t.batch_size, t.gpus) for t in store.job_types()]
    rows = []
    for rate in rates:
        per: dict[str, dict[str, list[float]]] = {}
        loads = []
        for seed in seeds:
            trace = tmp / f"{kind}_{rate:g}_{seed}.csv"
            work = generate(kind, jobs, rate, seed, types)
            write_trace(work, trace)
            loads.append(offered_load(work, GPUS).overall)
            results = _compare(trace, table, tmp / "rounds.json", POLICIES, "--round", "360")
            results += [dict(r, policy="las-events") for r in _compare(trace, table, tmp / "events.json", ("las",))]
            results += [dict(r, policy="tesserae-las-fresh") for r in
                        _compare(trace, table, tmp / "fresh.json", ("tesserae-las",), "--round", "360", "--fresh-plans")]
            results += _compare(trace, table, tmp / "optimus.json", ("optimus", "tesserae-optimus"), "--round", "600")
            for r in results:
                for key in KEYS:
                    per.setdefault(r["policy"], {}).setdefault(key, []).append(r[key])
        mean = {p: {k: statistics.fmean(v) for k, v in d.items()} for p, d in per.items()}
        base = mean["las"]
        for d in mean.values():
            d["avg_jct_vs_las_rounds"] = d["avg_jct"] / base["avg_jct"]
            d["makespan_vs_las_rounds"] = d["makespan"] / base["makespan"]
        t, fresh, g = mean["tesserae-las"], mean["tesserae-las-fresh"], mean["gavel-las"]
        o, to = mean["optimus"], mean["tesserae-optimus"]
        rows.append({"kind": kind, "table": table.name, "rate_per_hour": rate, "offered_load": statistics.fmean(loads),
                     "seeds": seeds, "jobs": jobs, "cluster": CLUSTER, "policies": mean,
                     "las_over_tesserae_jct": base["avg_jct"] / t["avg_jct"],
                     "las_over_tesserae_makespan": base["makespan"] / t["makespan"],
                     "optimus_over_tesserae_optimus_jct": o["avg_jct"] / to["avg_jct"],
                     "optimus_over_tesserae_optimus_makespan": o["makespan"] / to["makespan"],
                     "migrations_vs_gavel": t["migrations"] / g["migrations"] if g["migrations"] else None,
                     "migrations_saved_by_renaming_fresh_plans":
                         1 - fresh["migrations"] / fresh["migrations_without_matching"]
                         if fresh["migrations_without_matching"] else None})
        print(f"{kind:>9} {rate:>5g}/h  load {rows[-1]['offered_load']:.2f}  tesserae-las/las JCT "
              f"{t['avg_jct_vs_las_rounds']:.2f}x makespan {t['makespan_vs_las_rounds']:.2f}x  gavel-las/las JCT "
              f"{g['avg_jct_vs_las_rounds']:.2f}x  migrations {t['migrations']:.0f}, gavel {g['migrations']:.0f}, "
              f"fresh plans {fresh['migrations']:.0f} (unrenamed {fresh['migrations_without_matching']:.0f}); "
              f"optimus/tesserae-optimus JCT {o['avg_jct'] / to['avg_jct']:.2f}x", flush=True)
    return rows


def noise_sensitivity(levels: list[float], rate: float, jobs: int, seeds: list[int], tmp: pathlib.Path) -> list[dict]:
    """Tesserae Fig. 16: decisions on a profile whose pairs are off by up to +-level, with and
    without learning the speeds packed jobs run at; jobs run at the true speeds."""
    store = load_profiles(cli.DEFAULT_COLOCATION)
    types = [(t.model, t.batch_size, t.gpus) for t in store.job_types()]
    rows = []
    for level in levels:
        row: dict = {"noise": level, "rate_per_hour": rate}
        for learn in (True, False):
            jct, span = [], []
            for seed in seeds:
                trace = tmp / f"noise_{seed}.csv"
                if not trace.exists():
                    write_trace(generate("shockwave", jobs, rate, seed, types), trace)
                out = tmp / "noise.json"
                _tiresias(["simulate", "--trace", str(trace), "--cluster", CLUSTER, "--policy", "tesserae-las",
                           "--no-progress", "--json", str(out), "--profile-noise", str(level), "--profile-seed",
                           str(seed), "--learn-profiles" if learn else "--no-learn-profiles"])
                got = json.loads(out.read_text())
                jct.append(got["avg_jct"])
                span.append(got["makespan"])
            key = "learning" if learn else "fixed"
            row[f"avg_jct_{key}"] = statistics.fmean(jct)
            row[f"makespan_{key}"] = statistics.fmean(span)
        rows.append(row)
    for row in rows:
        row["avg_jct_fixed_vs_exact"] = row["avg_jct_fixed"] / rows[0]["avg_jct_fixed"]
        row["avg_jct_learning_vs_exact"] = row["avg_jct_learning"] / rows[0]["avg_jct_fixed"]
        print(f"noise {row['noise']:.1f}: average JCT {row['avg_jct_fixed_vs_exact']:.3f}x of an exact profile "
              f"({row['avg_jct_learning_vs_exact']:.3f}x learning)", flush=True)
    return rows


def decision_time(sizes: list[int], repeats: int) -> list[dict]:
    store = load_profiles(cli.DEFAULT_COLOCATION)
    types = store.job_types()
    rows = []
    for n in sizes:
        rng = random.Random(n)
        policy = DiscretizedLAS()
        states, kinds = [], {}
        for i in range(n):
            t = rng.choice(types)
            job = JobState(i, t.gpus, float(i), 3600.0, service=rng.choice((0.0, 5000.0)),
                           first_start=float(i) if rng.random() < 0.5 else None, model=t.model, batch_size=t.batch_size)
            policy.add(job, float(n))
            states.append(job)
            kinds[i] = t
        jobs = [RoundJob(j.job_id, j.num_gpus, kinds[j.job_id], rng.random() > 0.05) for j in policy.ordered(float(n))]
        previous = plan_round(jobs, 32, 8, store.pair).plan     # last round: the same jobs
        row: dict = {"active_jobs": n, "gpus": 256}
        best: dict[str, float] = {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            ordered = list(policy.ordered(float(n)))              # the policy's order of every active job
            t1 = time.perf_counter()
            jobs = [RoundJob(j.job_id, j.num_gpus, kinds[j.job_id], True) for j in ordered]
            rng.shuffle(jobs)                                     # priorities moved since the last round
            phases: dict[str, float] = {}
            plan = plan_round(jobs, 32, 8, store.pair, previous, timings=phases)
            total = time.perf_counter() - t0
            t2 = time.perf_counter()
            plan_round(jobs, 32, 8, None, previous)
            peer = time.perf_counter() - t2
            for key, value in (("round_s", total), ("ordering_s", t1 - t0), ("placement_s", phases["placement"]),
                               ("packing_s", phases["packing"]), ("migration_s", phases["migration"]),
                               ("no_packing_round_s", peer + (t1 - t0))):
                best[key] = min(best.get(key, float("inf")), value)
        row.update(best)
        row["packed_pairs"] = len(plan.pairs)
        row["migrated"] = len(plan.migrated)
        print(f"{n:>5} active jobs on 256 GPUs: a round {row['round_s'] * 1e3:.0f} ms (ordering "
              f"{row['ordering_s'] * 1e3:.0f}, placement {row['placement_s'] * 1e3:.0f}, packing "
              f"{row['packing_s'] * 1e3:.0f}, migration {row['migration_s'] * 1e3:.0f}; without packing "
              f"{row['no_packing_round_s'] * 1e3:.0f} ms), {row['packed_pairs']} pairs", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--rates", default="20,40,80,120", help="Shockwave-style arrival rates, jobs per hour")
    p.add_argument("--gavel-rates", default="2.5,5", help="Gavel-style arrival rates (its jobs are ~17x longer)")
    p.add_argument("--jobs", type=int, default=900)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sizes", default="256,1024,2048,3000,4096", help="active jobs for the round's time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--noise", default="0,0.2,0.5,1.0", help="profile noise levels (the first is the reference)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        gain = gain_vs_load("shockwave", cli.DEFAULT_COLOCATION, [float(r) for r in args.rates.split(",")],
                            args.jobs, seeds, pathlib.Path(tmp))
        gavel = gain_vs_load("gavel", GAVEL_TABLE, [float(r) for r in args.gavel_rates.split(",")],
                             args.jobs, seeds, pathlib.Path(tmp)) if GAVEL_TABLE.exists() else []
        noise = noise_sensitivity([float(x) for x in args.noise.split(",")], 80.0, args.jobs, seeds, pathlib.Path(tmp))
    timing = decision_time([int(n) for n in args.sizes.split(",")], args.repeats)
    out = {"bench": "tesserae_scale", "host": platform.node(), "cpus": os.cpu_count(),
           "gain_vs_load": gain, "gavel_trace": gavel, "profile_noise": noise, "decision_time": timing}
    for row in timing:
        if row["active_jobs"] in (2048, 3000):
            out[f"round_s_{row['active_jobs']}"] = row["round_s"]
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
