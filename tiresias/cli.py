"""The ``tiresias`` command: ``simulate`` one policy on a trace, ``compare`` several, and the
live service (``master``, ``submit``, ``jobs``, ... in ``tiresias.service.cli``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .cluster import parse_cluster
from .metrics import summarize, write_jobs_csv
from .placement import DEFAULT_PACKLIMIT
from .policies import POLICIES, make_policy
from .sim import PLACEMENTS, SimConfig, simulate
from .trace import TraceError, load_trace

# Table 3.3's models, assigned in turn by ``--models cycle`` (as the thesis' testbed workload did)
CYCLE_MODELS = ("vgg19", "vgg16", "vgg11", "alexnet", "resnet152", "resnet101", "resnet50",
                "inception4", "inception3", "googlenet")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True)
    p.add_argument("--format", choices=["philly", "tiresias", "generic"], default=None,
                   help="default: detected from the header")
    p.add_argument("--cluster", required=True, help="NODESxGPUS (e.g. 48x8) or a cluster spec CSV")
    p.add_argument("--on-bad", choices=["skip", "reject"], default="skip", help="bad trace rows")
    p.add_argument("--limit", type=int, default=None, help="first N jobs only")
    p.add_argument("--queues", type=int, default=2)
    p.add_argument("--thresholds", default="3200", help="queue thresholds in GPU-seconds, comma-separated")
    p.add_argument("--promote-knob", type=float, default=None)
    p.add_argument("--continuous", action="store_true", help="continuous priorities (no queues)")
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--distribution", default=None,
                   help="CSV of past job GPU-seconds for gittins (default: the trace's own jobs)")
    p.add_argument("--quantum", type=float, default=1800.0, help="gandiva time-sharing quantum (s)")
    p.add_argument("--placement", choices=PLACEMENTS, default="tiresias",
                   help="count: GPUs counted cluster-wide (the original simulator); tiresias: consolidate "
                        "jobs with skew > PACKLIMIT, others limit fragmentation; consolidate / spread: all jobs")
    p.add_argument("--packlimit", type=float, default=DEFAULT_PACKLIMIT)
    p.add_argument("--migrate", action="store_true",
                   help="when consolidation is blocked by fragmentation, repack and rename nodes with the "
                        "migration-minimizing (Hungarian) matching")
    p.add_argument("--overheads", action=argparse.BooleanOptionalAction, default=True,
                   help="charge pause + resume time when a preempted job resumes")
    p.add_argument("--slowdown", action=argparse.BooleanOptionalAction, default=True,
                   help="slow down skewed jobs placed on more nodes than they need")
    p.add_argument("--original", action="store_true",
                   help="as the original Tiresias simulator: --placement count --no-overheads --no-slowdown")
    p.add_argument("--models", choices=["trace", "cycle"], default="trace",
                   help="cycle: give jobs without a model Table 3.3's models in turn (for skew and sizes)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")


def _load(args):
    cluster = parse_cluster(args.cluster)
    report = load_trace(args.trace, args.format, max_gpus=cluster.total_gpus, on_bad=args.on_bad, limit=args.limit)
    if report.skipped:
        print(f"tiresias: skipped {report.skipped} bad rows of {args.trace}; first: {report.problems[0]}",
              file=sys.stderr)
    jobs = report.jobs
    if args.models == "cycle":
        jobs = [j if j.model else dataclasses.replace(j, model=CYCLE_MODELS[j.job_id % len(CYCLE_MODELS)])
                for j in jobs]
    return cluster, jobs


def _config(args) -> SimConfig:
    if args.original:
        return SimConfig("count", args.packlimit, overheads=False, slowdown=False, migrate=False)
    if not 0.0 <= args.packlimit <= 1.0:
        raise ValueError(f"--packlimit must be in [0, 1] (a skew), got {args.packlimit}")
    return SimConfig(args.placement, args.packlimit, overheads=args.overheads, slowdown=args.slowdown,
                     migrate=args.migrate)


def _run(name: str, args, cluster, jobs, record: bool = False):
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    config = _config(args)
    target = cluster if config.placement != "count" else cluster.total_gpus
    return simulate(jobs, target, _policy(name, args, jobs), record=record, progress=progress, config=config)


def _policy(name: str, args, jobs):
    thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    if len(thresholds) != args.queues - 1:
        raise ValueError(f"--queues {args.queues} needs {args.queues - 1} thresholds, got {thresholds}")
    return make_policy(name, thresholds=thresholds, promote_knob=args.promote_knob, continuous=args.continuous,
                       interval=args.interval, distribution=args.distribution, quantum=args.quantum,
                       history=[j.num_gpus * j.duration for j in jobs])


def _cmd_simulate(args) -> int:
    cluster, jobs = _load(args)
    result = _run(args.policy, args, cluster, jobs, record=bool(args.plot))
    summary = summarize(result)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.jobs_csv:
        write_jobs_csv(result, args.jobs_csv)
    if args.plot:
        from .plots import plot_run
        plot_run(result, args.plot)
    return 0


def _cmd_compare(args) -> int:
    cluster, jobs = _load(args)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
    rows, jct = {}, {}
    for name in names:
        result = _run(name, args, cluster, jobs)
        rows[name] = summarize(result)
        if args.plot:
            from .plots import jcts
            jct[name] = jcts(result)
    base = rows.get("las") or rows[names[-1]]
    print(f"{'policy':<12} {'avg JCT (s)':>14} {'median JCT':>12} {'p95 JCT':>12} {'avg norm':>9} "
          f"{'median norm':>12} {'preempt':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['avg_jct']:>14.0f} {r['median_jct']:>12.0f} {r['p95_jct']:>12.0f} "
              f"{r['avg_jct'] / base['avg_jct']:>8.2f}x {r['median_jct'] / base['median_jct']:>11.2f}x "
              f"{r['preemptions']:>8}")
    for r in rows.values():
        r["avg_jct_vs_las"] = r["avg_jct"] / base["avg_jct"]
        r["median_jct_vs_las"] = r["median_jct"] / base["median_jct"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(list(rows.values()), f, indent=2)
    if args.plot:
        from .plots import plot_jct_cdf
        plot_jct_cdf(jct, args.plot, title=f"{len(jobs)} jobs on {args.cluster}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .service import cli as service_cli
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="tiresias", description="Tiresias GPU cluster scheduler: simulator "
                                     "and live master")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("simulate", help="simulate one policy on a trace")
    _common(p)
    p.add_argument("--policy", choices=sorted(POLICIES), default="las")
    p.add_argument("--json", default=None)
    p.add_argument("--jobs-csv", default=None)
    p.add_argument("--plot", default=None, help="PNG: JCT CDF and GPUs in use over time")
    p.set_defaults(func=_cmd_simulate)
    p = sub.add_parser("compare", help="simulate several policies, normalized by las")
    _common(p)
    p.add_argument("--policies", default="fifo,best-effort,srtf,gandiva,gittins,las")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: the policies' JCT CDFs (log x-axis)")
    p.set_defaults(func=_cmd_compare)
    service_cli.add_commands(sub, fmt)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command not in ("simulate", "compare"):
        try:
            return service_cli.run(args)
        except (ValueError, RuntimeError, OSError) as exc:
            print(f"tiresias {args.command}: {exc}", file=sys.stderr)
            return 1
    try:
        return args.func(args)
    except (TraceError, ValueError, RuntimeError, OSError) as exc:
        print(f"tiresias {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
