"""Tesserae's GPU sharing in the simulator: what packing gains at several loads, what its
migration rule saves, and how long one round's decision takes (JSON out).

1. Gain vs load: Shockwave-style workloads (``tiresias workload --kind shockwave``, the
   Tesserae authors' co-location table) of ``--jobs`` jobs at several arrival rates on 80
   GPUs (10x8), each simulated with ``las`` (Tiresias, no sharing), ``tesserae-las`` and
   ``gavel-las`` (Gavel's greedy packing), all in rounds of 360 s, and ``las`` at every event
   (the project's default) as a second peer, and ``tesserae-las --fresh-plans`` (each round
   planned from an empty cluster, as the paper does). Per rate: the offered load, per policy
   average JCT, makespan, migrations (and what the same plans would have cost without
   Tesserae's renaming), finish-time fairness, and the ratios to ``las`` in rounds. Seeds are
   averaged.
2. Decision time: one round (``plan_round``: placement by priority, packing by matching,
   migration by renaming) with N active jobs on 256 GPUs (32x8), N = 256 .. 4096, against
   the previous round's plan; the peer is the round without packing (placement and renaming
   only). The paper reports under 1.6 s for 2,048 jobs on 256 GPUs.
3. Profile noise (the paper's Fig. 16): ``tesserae-las`` at 80 jobs/hour deciding with every
   pair's speeds off by a factor uniform in [1-L, 1+L], with and without learning the speeds
   packed jobs run at; average JCT relative to an exact profile.

    python bench/tesserae_scale.py --json bench/results/tesserae_scale.json
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import platform
import random
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiresias import cli  # noqa: E402
from tiresias.generate import generate, write_trace  # noqa: E402
from tiresias.load import offered_load  # noqa: E402
from tiresias.packing.profiles import load_profiles  # noqa: E402
from tiresias.packing.rounds import RoundJob, plan_round  # noqa: E402

POLICIES = ("las", "tesserae-las", "gavel-las")
KEYS = ("avg_jct", "makespan", "migrations", "migrations_without_matching", "ftf_max", "ftf_mean", "preemptions")


def _compare(trace: pathlib.Path, out: pathlib.Path, rounds: bool, policies=POLICIES, *extra: str) -> list[dict]:
    argv = ["compare", "--trace", str(trace), "--cluster", "10x8", "--no-progress", "--json", str(out),
            "--policies", ",".join(policies if rounds else ("las",)), "--colocation", str(cli.DEFAULT_COLOCATION),
            *extra]
    if rounds:
        argv += ["--round", "360"]
    with contextlib.redirect_stdout(io.StringIO()):       # the table: the JSON is what we keep
        rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"tiresias {' '.join(argv)} failed")
    return json.loads(out.read_text())


def gain_vs_load(rates: list[float], jobs: int, seeds: list[int], tmp: pathlib.Path) -> list[dict]:
    store = load_profiles(cli.DEFAULT_COLOCATION)
    types = [(t.model, t.batch_size, t.gpus) for t in store.job_types()]
    rows = []
    for rate in rates:
        per: dict[str, dict[str, list[float]]] = {}
        loads = []
        for seed in seeds:
            trace = tmp / f"shockwave_{rate:g}_{seed}.csv"
            work = generate("shockwave", jobs, rate, seed, types)
            write_trace(work, trace)
            loads.append(offered_load(work, 80).overall)
            results = _compare(trace, tmp / "rounds.json", True)
            results += [dict(r, policy="las-events") for r in _compare(trace, tmp / "events.json", False)]
            results += [dict(r, policy="tesserae-las-fresh")
                        for r in _compare(trace, tmp / "fresh.json", True, ("tesserae-las",), "--fresh-plans")]
            for r in results:
                for key in KEYS:
                    per.setdefault(r["policy"], {}).setdefault(key, []).append(r[key])
        mean = {p: {k: statistics.fmean(v) for k, v in d.items()} for p, d in per.items()}
        base = mean["las"]
        for p, d in mean.items():
            d["avg_jct_vs_las_rounds"] = d["avg_jct"] / base["avg_jct"]
            d["makespan_vs_las_rounds"] = d["makespan"] / base["makespan"]
        t, fresh = mean["tesserae-las"], mean["tesserae-las-fresh"]
        rows.append({"rate_per_hour": rate, "offered_load": statistics.fmean(loads), "seeds": seeds, "jobs": jobs,
                     "policies": mean,
                     "migrations_saved_by_renaming_fresh_plans":
                         1 - fresh["migrations"] / fresh["migrations_without_matching"]
                         if fresh["migrations_without_matching"] else None})
        print(f"rate {rate:>4g}/h  load {rows[-1]['offered_load']:.2f}  tesserae-las/las JCT "
              f"{t['avg_jct_vs_las_rounds']:.2f}x makespan {t['makespan_vs_las_rounds']:.2f}x  gavel-las/las JCT "
              f"{mean['gavel-las']['avg_jct_vs_las_rounds']:.2f}x  migrations {t['migrations']:.0f}, gavel "
              f"{mean['gavel-las']['migrations']:.0f}, fresh plans {fresh['migrations']:.0f} (unrenamed "
              f"{fresh['migrations_without_matching']:.0f}, JCT {fresh['avg_jct_vs_las_rounds']:.2f}x)",
              flush=True)
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
                argv = ["simulate", "--trace", str(trace), "--cluster", "10x8", "--policy", "tesserae-las",
                        "--no-progress", "--json", str(out), "--profile-noise", str(level), "--profile-seed", str(seed),
                        "--learn-profiles" if learn else "--no-learn-profiles"]
                with contextlib.redirect_stdout(io.StringIO()):
                    if cli.main(argv) != 0:
                        raise RuntimeError(f"tiresias {' '.join(argv)} failed")
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
        jobs = []
        for i in range(n):
            t = rng.choice(types)
            jobs.append(RoundJob(i, t.gpus, t, rng.random() > 0.05, False))
        previous = plan_round(jobs, 32, 8, store.pair).plan     # last round: the same jobs
        rng.shuffle(jobs)                                      # priorities moved since
        row = {"active_jobs": n, "gpus": 256}
        for label, speeds in (("tesserae_round_s", store.pair), ("no_packing_round_s", None)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = plan_round(jobs, 32, 8, speeds, previous)
                times.append(time.perf_counter() - t0)
            row[label] = min(times)
            if speeds is not None:
                row["packed_pairs"] = len(plan.pairs)
                row["migrated"] = len(plan.migrated)
        row["packing_share"] = 1 - row["no_packing_round_s"] / row["tesserae_round_s"]
        print(f"{n:>5} active jobs on 256 GPUs: a round {row['tesserae_round_s'] * 1e3:.0f} ms "
              f"(without packing {row['no_packing_round_s'] * 1e3:.0f} ms), {row['packed_pairs']} pairs", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--rates", default="20,40,80,120", help="arrival rates, jobs per hour")
    p.add_argument("--jobs", type=int, default=900)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sizes", default="256,1024,2048,4096", help="active jobs for the decision time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--noise", default="0,0.2,0.5,1.0", help="profile noise levels (the first is the reference)")
    args = p.parse_args(argv)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        seeds = [int(s) for s in args.seeds.split(",")]
        gain = gain_vs_load([float(r) for r in args.rates.split(",")], args.jobs, seeds, pathlib.Path(tmp))
        noise = noise_sensitivity([float(x) for x in args.noise.split(",")], 80.0, args.jobs, seeds, pathlib.Path(tmp))
    timing = decision_time([int(n) for n in args.sizes.split(",")], args.repeats)
    out = {"bench": "tesserae_scale", "host": platform.node(), "cpus": __import__("os").cpu_count(),
           "gain_vs_load": gain, "profile_noise": noise, "decision_time": timing}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
