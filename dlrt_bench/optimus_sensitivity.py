"""Optimus's sensitivity to estimate errors (paper §6.3, Fig. 15) and what its parts contribute
(§6.4, Fig. 18-19) on the Pollux workloads 1-5 on 16x4 with AutoPS's aggregators
(``--sync pushpull``, the paper's 10-minute interval), JSON out.

* ``sensitivity``: ``optimus-noisy`` (``optimus-oracle`` whose remaining steps and speeds are the
  truth times ``1 ± e·(remaining fraction)``, a sign per job and estimate) for each error ``e``
  and seed; average JCT normalised by ``e = 0`` (the oracle itself) per workload.
* ``ablations``: one part replaced at a time. Allocation: eq. (9) against DRF's allocation with
  everything else Optimus (``optimus-drf-alloc``: the same pre-runs, rounds and placement), and
  the same with true estimates (``optimus-oracle`` against ``drf``). Placement: Optimus over the
  driver's placements (``tiresias``, the default; ``consolidate``; ``spread``); the paper's
  Theorem-1 placement (``tiresias.optimus.placement``) is not in the driver, so it is not among
  them. PAA is compared statically in ``bench/autops_paa.py``.

The policies are built here (the CLI cannot pass an error or a seed) and run as ``tiresias
compare --workload`` runs them (``tiresias.cli._run``).

    python bench/optimus_sensitivity.py --json bench/results/optimus_sensitivity.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Callable

from tiresias.apps import load_applications, load_workload
from tiresias.cluster import parse_cluster
from tiresias.metrics import summarize
from tiresias.policies.elastic import DRF, AllocationPolicy, Optimus, OptimusDRFAllocation, OptimusNoisy, \
    OptimusOracle
from tiresias.sim import SimConfig
from tiresias.sim.measured import simulate_workload

POLLUX = pathlib.Path("../shared/data/pollux")
ERRORS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
SEEDS = (0, 1, 2)
CLUSTER = "16x4"
PLACEMENT_VARIANTS = ("tiresias", "consolidate", "spread")


class WorkloadRunner:
    """Runs a policy on one Pollux workload as ``tiresias compare --workload`` does."""

    def __init__(self, workload: pathlib.Path, sync: str = "pushpull", cluster: str = CLUSTER,
                 apps_dir: str | None = None) -> None:
        self.jobs = load_workload(str(workload))
        self.apps = load_applications(apps_dir)
        self.cluster = parse_cluster(cluster)
        self.sync = sync

    def run(self, policy: AllocationPolicy, placement: str = "tiresias") -> dict:
        config = SimConfig(placement, overheads=True, slowdown=True)
        result = simulate_workload(self.jobs, self.apps, self.cluster, policy, config, self.sync)
        row = summarize(result)
        return {"avg_jct": row["avg_jct"], "makespan": row["makespan"], "p95_jct": row["p95_jct"],
                "preemptions": row["preemptions"]}


def sensitivity(runner: WorkloadRunner, errors: tuple[float, ...], seeds: tuple[int, ...]) -> dict:
    """error -> {"avg_jct" per seed, "normalised": mean over seeds / the error-free JCT}."""
    base = runner.run(OptimusNoisy(error=0.0))["avg_jct"]
    out = {}
    for e in errors:
        jcts = [base] if e == 0 else [runner.run(OptimusNoisy(error=e, seed=s))["avg_jct"] for s in seeds]
        out[str(e)] = {"avg_jct": jcts, "normalised": statistics.mean(jcts) / base,
                       "normalised_max": max(jcts) / base}
    return out


ABLATIONS: dict[str, tuple[Callable[[], AllocationPolicy], str]] = {
    "optimus": (Optimus, "tiresias"),
    "allocation=drf (learned)": (OptimusDRFAllocation, "tiresias"),
    "optimus-oracle": (OptimusOracle, "tiresias"),
    "allocation=drf (oracle)": (DRF, "tiresias"),
    "placement=consolidate": (Optimus, "consolidate"),
    "placement=spread": (Optimus, "spread"),
}


def ablations(runner: WorkloadRunner) -> dict:
    return {name: runner.run(make(), placement) for name, (make, placement) in ABLATIONS.items()}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pollux", default=str(POLLUX), help="the Pollux data folder (workloads/)")
    ap.add_argument("--workloads", default="1,2,3,4,5")
    ap.add_argument("--errors", default=",".join(str(e) for e in ERRORS))
    ap.add_argument("--seeds", default=",".join(str(s) for s in SEEDS))
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    numbers = [int(n) for n in args.workloads.split(",")]
    errors = _floats(args.errors)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    started = time.perf_counter()
    sens, abl = {}, {}
    for n in numbers:
        runner = WorkloadRunner(pathlib.Path(args.pollux) / "workloads" / f"workload-{n}.csv")
        sens[n] = sensitivity(runner, errors, seeds)
        abl[n] = ablations(runner)
    print(f"sensitivity (Fig. 15): optimus-oracle with estimate errors, avg JCT / error-free, mean of seeds "
          f"{','.join(map(str, seeds))} (worst seed)")
    print("  error  " + "  ".join(f"w{n:<11}" for n in numbers) + "  geomean")
    for e in errors:
        cells = [f"{sens[n][str(e)]['normalised']:.3f} ({sens[n][str(e)]['normalised_max']:.2f})" for n in numbers]
        geo = statistics.geometric_mean([sens[n][str(e)]["normalised"] for n in numbers])
        print(f"  {e:<5}  " + "  ".join(f"{c:<12}" for c in cells) + f"  {geo:.3f}")
    print("ablations (Fig. 18-19): avg JCT (s) / makespan (s); JCT over optimus's (oracle rows: over optimus-oracle's)")
    summary = {}
    for name in ABLATIONS:
        ref = "optimus-oracle" if "oracle" in name else "optimus"
        ratios = [abl[n][name]["avg_jct"] / abl[n][ref]["avg_jct"] for n in numbers]
        spans = [abl[n][name]["makespan"] / abl[n][ref]["makespan"] for n in numbers]
        summary[name] = {"reference": ref, "avg_jct_geomean_over_reference": statistics.geometric_mean(ratios),
                         "makespan_geomean_over_reference": statistics.geometric_mean(spans)}
        cells = " ".join(f"{abl[n][name]['avg_jct']:>6.0f}/{abl[n][name]['makespan']:<6.0f}" for n in numbers)
        print(f"  {name:<26} {cells}  JCT x{summary[name]['avg_jct_geomean_over_reference']:.2f}, "
              f"makespan x{summary[name]['makespan_geomean_over_reference']:.2f}")
    if args.json:
        result = {"setting": {"cluster": CLUSTER, "sync": "pushpull", "interval_s": 600, "errors": list(errors),
                              "seeds": list(seeds)},
                  "sensitivity": sens, "ablations": abl, "ablation_summary": summary,
                  "wall_s": time.perf_counter() - started}
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0
