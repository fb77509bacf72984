"""The ``tiresias`` command: ``simulate`` one policy on a trace, ``compare`` several, and the
live service (``master``, ``submit``, ``jobs``, ... in ``tiresias.service.cli``).

Follows the runtime's command-line convention (``dlrt.cli``): ``--json FILE`` (``-`` for
stdout), ``--log-level`` on every command, exit status 2 for usage errors (a bad trace
included), 1 for runtime errors.
"""
from __future__ import annotations

import argparse
import json
import sys

from dlrt import cli

from .cluster import parse_cluster
from .metrics import summarize, write_jobs_csv
from .placement import DEFAULT_PACKLIMIT
from .policies import POLICIES, make_policy
from .sim import PLACEMENTS, SimConfig, simulate
from .trace import CYCLE_MODELS, load_trace, with_models

__all__ = ["main", "CYCLE_MODELS"]


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
    jobs = with_models(report.jobs) if args.models == "cycle" else report.jobs
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
    if args.json:
        cli.write_json(args.json, summary)
    if args.json != "-":
        print(json.dumps(summary, indent=2))
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
    lines = [f"{'policy':<12} {'avg JCT (s)':>14} {'median JCT':>12} {'p95 JCT':>12} {'avg norm':>9} "
             f"{'median norm':>12} {'preempt':>8}"]
    for name, r in rows.items():
        lines.append(f"{name:<12} {r['avg_jct']:>14.0f} {r['median_jct']:>12.0f} {r['p95_jct']:>12.0f} "
                     f"{r['avg_jct'] / base['avg_jct']:>8.2f}x {r['median_jct'] / base['median_jct']:>11.2f}x "
                     f"{r['preemptions']:>8}")
    for r in rows.values():
        r["avg_jct_vs_las"] = r["avg_jct"] / base["avg_jct"]
        r["median_jct_vs_las"] = r["median_jct"] / base["median_jct"]
    cli.emit(args.json, list(rows.values()), "\n".join(lines))
    if args.plot:
        from .plots import plot_jct_cdf
        plot_jct_cdf(jct, args.plot, title=f"{len(jobs)} jobs on {args.cluster}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .service import cli as service_cli
    parser = cli.parser("tiresias", "Tiresias GPU cluster scheduler: simulator and live master")
    sub = cli.add_commands(parser)
    p = cli.add_command(sub, "simulate", "simulate one policy on a trace", log_level="WARNING",
                        json_help="write the summary as JSON to FILE ('-' for stdout; it is printed "
                                  "there anyway unless FILE is '-')")
    _common(p)
    p.add_argument("--policy", choices=sorted(POLICIES), default="las")
    p.add_argument("--jobs-csv", default=None, metavar="FILE", help="one row per job")
    p.add_argument("--plot", default=None, metavar="PNG", help="JCT CDF and GPUs in use over time")
    p.set_defaults(func=_cmd_simulate)
    p = cli.add_command(sub, "compare", "simulate several policies, normalized by las", log_level="WARNING",
                        json_help="write one summary per policy as JSON to FILE ('-' for stdout "
                                  "instead of the table)")
    _common(p)
    p.add_argument("--policies", default="fifo,best-effort,srtf,gandiva,gittins,las")
    p.add_argument("--plot", default=None, metavar="PNG", help="the policies' JCT CDFs (log x-axis)")
    p.set_defaults(func=_cmd_compare)
    service_cli.add_commands(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        return cli.no_subcommand(parser)
    cli.setup_logging(args.log_level)
    return cli.run_main(f"tiresias {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
