"""Our own elastic policy, ``elastic-srpt`` (``tiresias.policies.elastic.ElasticSRPT``), against
DRF, 2D-LAS, Optimus and Optimus+Oracle on the Pollux workloads 1-5 on 16x4, JSON out.

* ``aggregators``: AutoPS's aggregators (``--sync pushpull``, interval 600), through ``tiresias
  compare --workload ... --policies elastic-srpt,drf,las,optimus,optimus-oracle``;
* ``calibration``: ``--sync measured --interval 60``, 2D-LAS with Pollux's Tiresias settings
  (two queues, 16 GPU-hours), as ``bench/optimus_workloads.py``;
* ``parts``: what each of its ideas contributes, with aggregators: rounds only every interval
  (``event_rounds=False``) and no churn guard (a horizon of 10^9 s, so a resize costs ~nothing).

    python bench/optimus_own.py --json bench/results/optimus_own.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from dlrt_bench.optimus_sensitivity import WorkloadRunner
from dlrt_bench.optimus_workloads import TIRESIAS_THRESHOLD, compare
from tiresias.policies.elastic import ElasticSRPT

POLLUX = pathlib.Path("../shared/data/pollux")
OURS = "elastic-srpt"
POLICIES = (OURS, "drf", "las", "optimus", "optimus-oracle")
SETTINGS = {"aggregators": [], "calibration": ["--sync", "measured", "--interval", "60",
                                               "--thresholds", str(TIRESIAS_THRESHOLD)]}
PARTS = {"elastic-srpt": {}, "without event rounds": {"event_rounds": False},
         "without churn guard": {"horizon": 1e9}}


def _row(row: dict, ours: dict) -> dict:
    return {"avg_jct": row["avg_jct"], "makespan": row["makespan"], "p95_jct": row["p95_jct"],
            "preemptions": row["preemptions"], "this_over_ours_avg_jct": row["avg_jct"] / ours["avg_jct"],
            "this_over_ours_makespan": row["makespan"] / ours["makespan"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pollux", default=str(POLLUX), help="the Pollux data folder (workloads/)")
    ap.add_argument("--workloads", default="1,2,3,4,5")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    numbers = [int(n) for n in args.workloads.split(",")]
    started = time.perf_counter()
    tables: dict[str, dict[int, dict]] = {s: {} for s in SETTINGS}
    parts: dict[int, dict] = {}
    for n in numbers:
        workload = pathlib.Path(args.pollux) / "workloads" / f"workload-{n}.csv"
        for setting, extra in SETTINGS.items():
            rows = compare(workload, POLICIES, extra)
            tables[setting][n] = {name: _row(row, rows[OURS]) for name, row in rows.items()}
        runner = WorkloadRunner(workload)
        parts[n] = {name: runner.run(ElasticSRPT(**kw)) for name, kw in PARTS.items()}
    summary = {}
    for setting in SETTINGS:
        print(f"{setting}: avg JCT (s) / makespan (s) per workload; other / {OURS}")
        summary[setting] = {}
        for name in POLICIES:
            jct = statistics.geometric_mean([tables[setting][n][name]["this_over_ours_avg_jct"] for n in numbers])
            span = statistics.geometric_mean([tables[setting][n][name]["this_over_ours_makespan"] for n in numbers])
            wins = sum(tables[setting][n][name]["this_over_ours_avg_jct"] > 1 for n in numbers)
            summary[setting][name] = {"avg_jct_geomean_over_ours": jct, "makespan_geomean_over_ours": span,
                                      "workloads_ours_better_avg_jct": wins}
            cells = " ".join(f"{tables[setting][n][name]['avg_jct']:>6.0f}/{tables[setting][n][name]['makespan']:<6.0f}"
                             for n in numbers)
            print(f"  {name:<15} {cells}  JCT x{jct:.2f}, makespan x{span:.2f}, ours better on {wins}/{len(numbers)}")
    print(f"parts of {OURS} (aggregators): avg JCT (s) per workload, preemptions; over the full policy")
    summary["parts"] = {}
    for name in PARTS:
        ratio = statistics.geometric_mean([parts[n][name]["avg_jct"] / parts[n][OURS]["avg_jct"] for n in numbers])
        summary["parts"][name] = {"avg_jct_geomean_over_full": ratio}
        cells = " ".join(f"{parts[n][name]['avg_jct']:>6.0f}/{parts[n][name]['preemptions']:<4}" for n in numbers)
        print(f"  {name:<22} {cells}  JCT x{ratio:.2f}")
    if args.json:
        result = {"tables": tables, "parts": parts, "summary": summary, "wall_s": time.perf_counter() - started}
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0
