"""Every scheduling policy on the Pollux workloads 1-5 on 16x4, through ``tiresias compare
--workload`` (the command a user runs), JSON out.

Two settings per workload:

* ``calibration``: ``--sync measured --interval 60`` and 2D-LAS with Pollux's Tiresias settings
  (two queues, a threshold of 16 GPU-hours, no promotion), decided as Pollux's simulator does
  (every 60 s for every policy, 30 s lost at every allocation, GPUs from the node with the
  most free first: ``--decide-every 60 --start-cost 30 --restart-cost 30 --placement
  most-free``) - the mode that compares with the published figures in
  ``../shared/data/pollux/RESULTS.md`` (read from that file): our ``optimus-oracle`` and
  ``las`` against Pollux's Optimus+Oracle and Tiresias;
* ``aggregators``: the runtime's own setting - a step's synchronization is AutoPS's push/pull
  cost at the job's aggregators, the paper's 10-minute interval, every policy
  (optimus, optimus-oracle, drf, tetris, fifo, las), with the paper's claim alongside
  (Optimus 2.39x better average JCT and 1.63x better makespan than DRF on its testbed).

    python bench/optimus_workloads.py --json bench/results/optimus_workloads.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import tempfile
import time

from tiresias.cli import main as tiresias

POLLUX = pathlib.Path("../shared/data/pollux")
POLICIES = ("optimus", "optimus-oracle", "drf", "tetris", "fifo", "las")
PAPER_VS_DRF = {"avg_jct": 2.39, "makespan": 1.63}
TIRESIAS_THRESHOLD = 16 * 3600.0        # Pollux's Tiresias: 16 GPU-hours, two queues
WITHIN = 0.15
POLLUX_SIMULATOR = ("--decide-every", "60", "--start-cost", "30", "--restart-cost", "30", "--placement", "most-free")


def published(results_md: pathlib.Path) -> dict[int, dict[str, float]]:
    """RESULTS.md's table: workload -> {"optimus-oracle", "las", "pollux"} mean JCT (s)."""
    rows = {}
    for line in results_md.read_text().splitlines():
        m = re.match(r"\|\s*workload-(\d+)\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|", line)
        if m:
            oracle, tiresias_jct, pollux = (float(v.replace(",", "")) for v in m.groups()[1:])
            rows[int(m.group(1))] = {"optimus-oracle": oracle, "las": tiresias_jct, "pollux": pollux}
    if not rows:
        raise ValueError(f"{results_md}: no 'workload-N' rows in its table")
    return rows


def compare(workload: pathlib.Path, policies: tuple[str, ...], extra: list[str]) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "rows.json"
        rc = tiresias(["compare", "--workload", str(workload), "--cluster", "16x4", "--policies",
                       ",".join(policies), "--no-progress", "--json", str(out), *extra])
        if rc != 0:
            raise RuntimeError(f"tiresias compare on {workload} exited {rc}")
        return {r["policy"]: r for r in json.loads(out.read_text())}


def _brief(row: dict) -> dict:
    return {"avg_jct": row["avg_jct"], "makespan": row["makespan"], "median_jct": row["median_jct"],
            "preemptions": row["preemptions"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pollux", default=str(POLLUX), help="the Pollux data folder (workloads/, RESULTS.md)")
    ap.add_argument("--workloads", default="1,2,3,4,5")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    root = pathlib.Path(args.pollux)
    paper = published(root / "RESULTS.md")
    numbers = [int(n) for n in args.workloads.split(",")]
    started = time.perf_counter()
    calibration, own = {}, {}
    for n in numbers:
        workload = root / "workloads" / f"workload-{n}.csv"
        rows = compare(workload, ("optimus-oracle", "las"),
                       ["--sync", "measured", "--interval", "60", "--thresholds", str(TIRESIAS_THRESHOLD),
                        *POLLUX_SIMULATOR])
        calibration[n] = {}
        for name, row in rows.items():
            ref = paper[n][name]
            calibration[n][name] = {**_brief(row), "published_avg_jct": ref,
                                    "vs_published": row["avg_jct"] / ref,
                                    "within_15pct": abs(row["avg_jct"] / ref - 1) <= WITHIN}
        rows = compare(workload, POLICIES, [])
        drf = rows["drf"]
        own[n] = {name: {**_brief(row), "drf_over_this_avg_jct": drf["avg_jct"] / row["avg_jct"],
                         "drf_over_this_makespan": drf["makespan"] / row["makespan"]}
                  for name, row in rows.items()}
    print("calibration (--sync measured --interval 60, Pollux's Tiresias settings and decision times): "
          "avg JCT, ours / published")
    for n in numbers:
        cells = [f"{name} {r['avg_jct']:.0f} / {r['published_avg_jct']:.0f} = {r['vs_published']:.2f}x"
                 for name, r in calibration[n].items()]
        print(f"  workload-{n}: " + "; ".join(cells))
    print("with aggregators (--sync pushpull, interval 600): avg JCT (s) / makespan (s); DRF / policy")
    for n in numbers:
        print(f"  workload-{n}:")
        for name, r in own[n].items():
            print(f"    {name:<15} {r['avg_jct']:>8.0f} {r['makespan']:>9.0f}   "
                  f"DRF/this {r['drf_over_this_avg_jct']:.2f}x JCT, {r['drf_over_this_makespan']:.2f}x makespan")
    summary = {name: {"avg_jct_geomean_drf_over_this": statistics.geometric_mean(
                          [own[n][name]["drf_over_this_avg_jct"] for n in numbers]),
                      "makespan_geomean_drf_over_this": statistics.geometric_mean(
                          [own[n][name]["drf_over_this_makespan"] for n in numbers])}
               for name in POLICIES}
    within = sum(r["within_15pct"] for n in numbers for r in calibration[n].values())
    print(f"calibration rows within 15% of the published: {within} of {2 * len(numbers)}")
    for name, s in summary.items():
        print(f"  {name:<15} DRF/this, geometric mean over workloads: {s['avg_jct_geomean_drf_over_this']:.2f}x "
              f"JCT, {s['makespan_geomean_drf_over_this']:.2f}x makespan (paper, optimus: "
              f"{PAPER_VS_DRF['avg_jct']}x, {PAPER_VS_DRF['makespan']}x)")
    if args.json:
        result = {"calibration": calibration, "aggregators": own, "summary": summary,
                  "calibration_within_15pct": within, "calibration_rows": 2 * len(numbers),
                  "paper_optimus_vs_drf": PAPER_VS_DRF, "wall_s": time.perf_counter() - started}
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0
