"""How long one Optimus scheduling pass takes at scale (paper Fig. 12: 5 s for 4,000 jobs on
16,000 nodes): ``allocate_marginal_gain`` over the cluster's aggregate capacity, then
``place_jobs`` over its nodes, timed apart and together (median of ``--repeats``).

The cluster: ``--nodes`` nodes of 4 GPUs + 8 CPUs, all free. The jobs (seeded): a worker takes
1 GPU + 1 CPU, an aggregator 1 CPU; half synchronous (eq. (4), batch 32..512), half asynchronous
(eq. (3)), with thetas drawn around the paper's Table 2 fits (seconds per step of the order of
0.1..10); remaining steps log-uniform in [1e3, 1e6]; at most 8..64 workers and aggregators;
a tenth of them young (the 0.95 factor). The pass is the peer of itself: the paper's figure is
the reference, nothing is asserted.

    python bench/optimus_scale.py --json bench/results/optimus_scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import time

from tiresias.optimus.allocation import AllocJob, Demand, allocate_marginal_gain
from tiresias.optimus.placement import place_jobs
from tiresias.optimus.speed import SpeedModel

NODE = {"gpu": 4.0, "cpu": 8.0}
WORKER = {"gpu": 1.0, "cpu": 1.0}
AGGREGATOR = {"cpu": 1.0}


def synthetic_jobs(count: int, seed: int = 0) -> list[AllocJob]:
    """``count`` jobs with plausible seeded speed models and remaining steps (module doc)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        if rng.random() < 0.5:
            batch = float(rng.choice([32, 64, 128, 256, 512]))
            theta = (rng.uniform(0.002, 0.02), rng.uniform(0.02, 0.3), rng.uniform(0.01, 0.5),
                     rng.uniform(0.0, 0.02), rng.uniform(0.0, 0.02))
            model = SpeedModel(True, theta, batch)
        else:
            theta = (rng.uniform(0.5, 4.0), rng.uniform(0.05, 1.0), rng.uniform(0.0, 0.05),
                     rng.uniform(0.0, 0.1))
            model = SpeedModel(False, theta, None)
        cap = rng.choice([8, 16, 32, 64])
        jobs.append(AllocJob(i, 10 ** rng.uniform(3, 6), model.speed, Demand(dict(WORKER), dict(AGGREGATOR)),
                             max_workers=cap, max_aggregators=cap, young=rng.random() < 0.1))
    return jobs


def one_pass(jobs: list[AllocJob], nodes: int) -> dict:
    capacity = {r: v * nodes for r, v in NODE.items()}
    free = [dict(NODE) for _ in range(nodes)]
    t0 = time.perf_counter()
    alloc = allocate_marginal_gain(jobs, capacity)
    t1 = time.perf_counter()
    placed = place_jobs(alloc, {j.job_id: j.demand for j in jobs}, free)
    t2 = time.perf_counter()
    workers = sum(w for w, _ in alloc.values())
    aggregators = sum(p for _, p in alloc.values())
    return {"allocation_s": t1 - t0, "placement_s": t2 - t1, "pass_s": t2 - t0,
            "jobs_allocated": sum(1 for w, _ in alloc.values() if w > 0), "jobs_placed": len(placed),
            "workers": workers, "aggregators": aggregators,
            "gpu_used": workers * WORKER["gpu"] / capacity["gpu"],
            "cpu_used": (workers * WORKER["cpu"] + aggregators * AGGREGATOR["cpu"]) / capacity["cpu"],
            "nodes_used": len({n for parts in placed.values() for n, _, _ in parts})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the results to FILE")
    ap.add_argument("--jobs", type=int, default=4000)
    ap.add_argument("--nodes", type=int, default=16000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    jobs = synthetic_jobs(args.jobs, args.seed)
    runs = []
    for r in range(args.repeats):
        row = one_pass(jobs, args.nodes)
        runs.append(row)
        print(f"  pass {r + 1}: allocation {row['allocation_s']:.3f} s + placement {row['placement_s']:.3f} s "
              f"= {row['pass_s']:.3f} s ({row['jobs_allocated']} jobs allocated, {row['jobs_placed']} placed, "
              f"{row['workers']} workers, {row['aggregators']} aggregators, GPUs {row['gpu_used']:.1%}, "
              f"CPUs {row['cpu_used']:.1%})", flush=True)
    out = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
           "jobs": args.jobs, "nodes": args.nodes, "node": NODE, "seed": args.seed, "repeats": args.repeats,
           "pass_s": statistics.median(r["pass_s"] for r in runs),
           "allocation_s": statistics.median(r["allocation_s"] for r in runs),
           "placement_s": statistics.median(r["placement_s"] for r in runs),
           "paper_pass_s": 5.0, "runs": runs}
    print(f"median pass {out['pass_s']:.3f} s (allocation {out['allocation_s']:.3f} s, "
          f"placement {out['placement_s']:.3f} s); the paper: about 5 s", flush=True)
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
