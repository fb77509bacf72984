"""``--queues auto`` against the paper's K=2 / 3,200 GPU-s, SRTF, best-effort and Gandiva, on two
traces, as the original simulator (``--original``) and with the cost models on.

Traces (both built from ``/work/shared/data``; the auto rule was not tuned on either alone):

* ``philly-48x8``: ``traces/philly.csv`` (82,247 jobs) on 48 nodes x 8 GPUs, overloaded for
  weeks (DESIGN §5).
* ``yarn-32x4``: a trace built from the original simulator's ``tiresias/yarn-gput10000.csv``
  (9,999 job GPU-times sampled from Microsoft's YARN cluster, a heavier tail than Philly's):
  the samples in a seeded random order, each job's GPU count drawn from the original 60-job
  trace's mix (1 GPU for half the jobs, 2, 4 or 8 for a sixth each; duration = GPU-time /
  GPUs), Poisson arrivals at a nominal offered load of 1.2 on 32 nodes x 4 GPUs (its
  ``n32g4.csv``).

Every row runs the same jobs through ``tiresias.sim.simulate``; ``--original`` counts GPUs
cluster-wide and charges nothing, ``costs`` places jobs on nodes (``tiresias`` placement) and
charges pause/resume and the placement slowdown, with Table 3.3's models given to the jobs in
turn (``--models cycle``). The JSON keeps, per trace: its offered load, the auto queues, and
per mode the policies' figures plus ``las_auto_vs_srtf`` and friends — ratios measured in the
same run.

    python bench/tiresias_queues.py --json bench/results/tiresias_queues.json
"""
from __future__ import annotations

import pathlib
import platform
import sys
import time

import numpy as np

from dlrt import cli
from dlrt.trace import TraceJob, load_trace
from tiresias.cluster import ClusterSpec
from tiresias.load import offered_load
from tiresias.metrics import summarize
from tiresias.policies import make_policy
from tiresias.queues import queue_config
from tiresias.sim import SimConfig, simulate
from tiresias.trace import with_models

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
MODES = {"original": SimConfig("count", overheads=False, slowdown=False),
         "costs": SimConfig("tiresias", overheads=True, slowdown=True)}
# (row name, policy, queues)
ROWS = [("srtf", "srtf", None), ("best-effort", "best-effort", None), ("gandiva", "gandiva", None),
        ("las K=2", "las", "2"), ("las auto", "las", "auto")]
KEEP = ("avg_jct", "median_jct", "p95_jct", "preemptions", "gpu_utilization", "overhead_seconds", "events",
        "sim_wall_seconds")
SIXTY_JOB_MIX = (1, 1, 1, 2, 4, 8)


def yarn_trace(samples: pathlib.Path = DATA / "tiresias" / "yarn-gput10000.csv", load: float = 1.2,
               cluster: ClusterSpec = ClusterSpec(32, 4), seed: int = 0) -> list[TraceJob]:
    """The ``yarn-32x4`` trace (see the module docstring)."""
    gput = np.loadtxt(samples, skiprows=1, ndmin=1)
    rng = np.random.default_rng(seed)
    gput = rng.permutation(gput)
    gpus = rng.choice(SIXTY_JOB_MIX, size=len(gput))
    rate = load * cluster.total_gpus / gput.mean()
    submit = np.cumsum(rng.exponential(1.0 / rate, size=len(gput)))
    submit -= submit[0]
    return [TraceJob(i, float(submit[i]), int(gpus[i]), max(1.0, float(gput[i]) / int(gpus[i])))
            for i in range(len(gput))]


def traces(names: list[str]) -> dict[str, tuple[list[TraceJob], ClusterSpec]]:
    out = {}
    if "philly-48x8" in names:
        shape = ClusterSpec(48, 8)
        out["philly-48x8"] = (load_trace(DATA / "traces" / "philly.csv", max_gpus=shape.total_gpus).jobs, shape)
    if "yarn-32x4" in names:
        out["yarn-32x4"] = (yarn_trace(), ClusterSpec(32, 4))
    return out


def run_trace(jobs: list[TraceJob], shape: ClusterSpec, modes: list[str], log) -> dict:
    services = [j.num_gpus * j.duration for j in jobs]
    auto = queue_config("auto", None, services)
    load = offered_load(jobs, shape.total_gpus)
    print(f"  {load.text()}\n  auto queues: {auto.text()}", file=log, flush=True)
    result = {"cluster": f"{shape.nodes}x{shape.gpus_per_node}", "jobs": len(jobs),
              "offered_load": load.as_dict(), "queues_auto": auto.as_dict(), "modes": {}}
    for mode in modes:
        config = MODES[mode]
        run_jobs = with_models(jobs) if config.overheads else jobs
        target = shape if config.placement != "count" else shape.total_gpus
        rows = {}
        for row, name, queues in ROWS:
            thresholds = queue_config(queues, "3200", services).thresholds if queues else (3200.0,)
            policy = make_policy(name, thresholds=thresholds, history=services, cluster=shape)
            t0 = time.perf_counter()
            s = summarize(simulate(run_jobs, target, policy, config=config))
            rows[row] = {k: s[k] for k in KEEP}
            print(f"  {mode:8} {row:12} avg JCT {s['avg_jct']:>10.0f} s  median {s['median_jct']:>8.0f} s  "
                  f"preemptions {s['preemptions']:>8}  ({time.perf_counter() - t0:.0f} s)", file=log, flush=True)
        auto_avg = rows["las auto"]["avg_jct"]
        result["modes"][mode] = {"rows": rows, **{f"las_auto_vs_{other.replace(' ', '_').replace('=', '')}":
                                                   auto_avg / rows[other]["avg_jct"]
                                                   for other in ("srtf", "best-effort", "gandiva", "las K=2")}}
    return result


def table(results: dict) -> str:
    """The markdown table of docs/tiresias.md: average JCT (s) per trace, mode and policy."""
    lines = ["| trace (offered load) | mode | " + " | ".join(r for r, _, _ in ROWS) + " | las auto / srtf |",
             "|---|---|" + "---|" * (len(ROWS) + 1)]
    for name, res in results.items():
        for mode, m in res["modes"].items():
            cells = " | ".join(f"{m['rows'][r]['avg_jct']:,.0f}" for r, _, _ in ROWS)
            lines.append(f"| {name} ({res['offered_load']['overall']:.2f}) | {mode} | {cells} | "
                         f"{m['las_auto_vs_srtf']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("tiresias_queues", description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", default=["philly-48x8", "yarn-32x4"], choices=["philly-48x8", "yarn-32x4"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    cli.add_json(p)
    args = p.parse_args(argv)
    log = cli.text_out(args.json)
    results = {}
    for name, (jobs, shape) in traces(args.traces).items():
        print(f"{name}: {len(jobs)} jobs on {shape.nodes}x{shape.gpus_per_node}", file=log, flush=True)
        results[name] = run_trace(jobs, shape, args.modes, log)
    print(table(results), file=log, flush=True)
    if args.json:
        cli.write_json(args.json, {"bench": "tiresias_queues", "python": platform.python_version(),
                                   "argv": sys.argv[1:] if argv is None else argv, "traces": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
