"""The ``tiresias`` command: ``simulate`` one policy on a trace, ``compare`` several, ``workload``
(write a synthetic trace, ``tiresias.generate``), and the live service (``master``, ``submit``,
``jobs``, ... in ``tiresias.service.cli``).

Follows the runtime's command-line convention (``dlrt.cli``): ``--json FILE`` (``-`` for
stdout), ``--log-level`` on every command, exit status 2 for usage errors (a bad trace
included), 1 for runtime errors (a trace with no valid job, a run in which no job makes
progress). Every result comes with the offered load of the trace on the cluster
(``tiresias.load``) and the queue configuration used (``tiresias.queues``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dlrt import cli
from dlrt.trace import ignored_message, skipped_message

from . import progress as guarantee
from .cluster import parse_cluster
from .load import offered_load
from .metrics import finish_time_fairness, summarize, write_jobs_csv
from .placement import DEFAULT_PACKLIMIT
from .packing.profiles import DEFAULT_COLOCATION
from .packing.rounds import ROUND_SECONDS, SHARING_POLICIES
from .policies import POLICIES as BASE_POLICIES
from .policies import make_policy
from .policies.elastic import ALLOCATION_POLICIES
from .policies.elastic import DEFAULT_INTERVAL as ALLOCATION_INTERVAL
from .policies.gandiva import SWITCH_SECONDS
from .queues import QueueConfig, queue_config
from .sim import PLACEMENTS, SimConfig, simulate
from .sim.progressbar import LINE_EVERY_S, ProgressLines
from .trace import CYCLE_MODELS, load_trace, with_models

__all__ = ["main", "CYCLE_MODELS", "DEFAULT_COLOCATION"]

# GPU sharing (tiresias.packing): Tesserae's matching and renaming, or Gavel's greedy rule, under
# a priority policy; the simulator runs them in rounds of ROUND_SECONDS unless --round says otherwise
POLICIES = (*BASE_POLICIES, *SHARING_POLICIES)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="a job trace (or --workload)")
    p.add_argument("--workload", default=None, metavar="FILE",
                   help="a Pollux-style workload CSV (name,time,application,num_replicas,batch_size): jobs "
                        "run at their applications' measured speeds (--apps) and report their loss curves")
    p.add_argument("--apps", default=None, metavar="DIR",
                   help="--workload: one folder per application as ../shared/data/pollux/traces/ (the default)")
    p.add_argument("--sync", choices=["pushpull", "measured"], default="pushpull",
                   help="--workload: a step's synchronization is AutoPS's push/pull cost at the job's aggregators "
                        "(pushpull) or the measured all-reduce time (measured; aggregators ignored)")
    p.add_argument("--format", choices=["philly", "tiresias", "generic"], default=None,
                   help="default: detected from the header")
    p.add_argument("--cluster", required=True, help="NODESxGPUS (e.g. 48x8) or a cluster spec CSV")
    p.add_argument("--on-bad", choices=["skip", "reject"], default="skip", help="bad trace rows")
    p.add_argument("--limit", type=cli.positive(int), default=None, help="first N jobs only")
    p.add_argument("--queues", default="2",
                   help="las/gittins: the number of queues K, or 'auto': thresholds doubling from the median "
                        "of the service distribution (--distribution, else the trace's jobs' GPU-seconds) "
                        "until past its largest")
    p.add_argument("--thresholds", default="3200",
                   help="queue thresholds in GPU-seconds, comma-separated (K - 1 of them; ignored with "
                        "--queues auto)")
    p.add_argument("--promote-knob", type=float, default=None,
                   help="las/gittins: a job that waited at least this many times its last run goes back to the "
                        "first queue (default: never)")
    p.add_argument("--continuous", action="store_true", help="continuous priorities (no queues)")
    p.add_argument("--interval", type=cli.positive(float), default=None,
                   help="--continuous: seconds between priority updates (default 1); optimus, optimus-oracle, "
                        "drf, tetris: seconds between allocation rounds (default 600)")
    p.add_argument("--distribution", default=None,
                   help="CSV of past job GPU-seconds for gittins and --queues auto (default: the trace's "
                        "own jobs)")
    p.add_argument("--switch", type=cli.positive(float), default=SWITCH_SECONDS,
                   help="gandiva: the time-slicing switching period (s)")
    p.add_argument("--quantum", type=cli.positive(float), default=1800.0,
                   help="gandiva-rr: the round-robin quantum (s)")
    p.add_argument("--placement", choices=PLACEMENTS, default="tiresias",
                   help="count: GPUs counted cluster-wide (the original simulator); tiresias: consolidate "
                        "jobs with skew > PACKLIMIT, others limit fragmentation; consolidate / spread: all jobs; "
                        "most-free: Pollux's simulator's (from the node with the most free GPUs first)")
    p.add_argument("--packlimit", type=float, default=DEFAULT_PACKLIMIT,
                   help="--placement tiresias: consolidate jobs whose skew is above this (0..1)")
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
    p.add_argument("--restart-cost", type=float, default=None, metavar="SECONDS",
                   help="with overheads: seconds a job loses at every restart (resume or resize) instead of the "
                        "overhead model's pause + resume")
    p.add_argument("--start-cost", type=float, default=0.0, metavar="SECONDS",
                   help="with overheads: seconds a job loses at its first start too (Pollux's simulator: 30)")
    p.add_argument("--decide-every", "--round", type=float, default=None, metavar="SECONDS", dest="decide_every",
                   help="schedule only at multiples of SECONDS, in rounds (Pollux's simulator: 60; Tesserae: "
                        f"360); default: {ROUND_SECONDS:g} for the GPU-sharing policies (tesserae-*, gavel-*), "
                        "else at every arrival, completion and policy change")
    p.add_argument("--colocation", default=None, metavar="FILE",
                   help="tesserae-*, gavel-*: the co-location throughput table (Tesserae's CSV or Gavel's "
                        "JSON; default the Tesserae authors' table); given, or with a GPU-sharing policy, "
                        "results carry the finish-time fairness ratio (ftf_*)")
    p.add_argument("--gpu-type", default=None,
                   help="a Gavel-format --colocation table's GPU type (default v100)")
    p.add_argument("--profile-noise", type=float, default=0.0, metavar="LEVEL",
                   help="tesserae-*, gavel-*: decide with every pair's speeds multiplied by a factor uniform in "
                        "[1-LEVEL, 1+LEVEL] (profiling error, Tesserae Fig. 16); jobs run at the true speeds")
    p.add_argument("--profile-seed", type=cli.non_negative(int), default=0, help="--profile-noise's seed")
    p.add_argument("--fresh-plans", action="store_true",
                   help="tesserae-*: plan every round from an empty cluster, as the paper does (by default a job "
                        "keeps its GPUs when they are still free, then the plan is renamed)")
    p.add_argument("--learn-profiles", action=argparse.BooleanOptionalAction, default=True,
                   help="with --profile-noise: the profile learns the speeds packed jobs run at (each measured "
                        "pair moves half way to its measurement per round)")
    guarantee.add_arguments(p)
    p.add_argument("--stall-limit", type=float, default=guarantee.DEFAULT_STALL_LIMIT, metavar="SECONDS",
                   help="stop with an error when no job makes progress for this much simulated time")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr: a bar on a terminal, else a line every "
                        f"{LINE_EVERY_S:g} s and one as each run ends (default: compare: on; simulate: "
                        "on a terminal)")


def _load(args):
    if (args.trace is None) == (args.workload is None):
        raise cli.UsageError("give one of --trace FILE or --workload FILE")
    cluster = parse_cluster(args.cluster)
    if args.workload is not None:
        return cluster, _measured_jobs(args, cluster)
    report = load_trace(args.trace, args.format, max_gpus=cluster.total_gpus, on_bad=args.on_bad, limit=args.limit)
    if report.ignored_columns:
        print(f"tiresias: {ignored_message(report, args.trace)}", file=sys.stderr)
    if report.skipped:
        print(f"tiresias: {skipped_message(report, args.trace)}", file=sys.stderr)
    jobs = with_models(report.jobs) if args.models == "cycle" else report.jobs
    return cluster, jobs


class _Workload(list):
    """The jobs of ``--workload`` (their trace items) with the applications they run."""

    def __init__(self, items, workload, apps):
        super().__init__(items)
        self.workload, self.apps = workload, apps


def _measured_jobs(args, cluster) -> _Workload:
    from .apps import load_applications, load_workload
    from .sim.measured import MeasuredWorkload
    apps = load_applications(args.apps)
    workload = load_workload(args.workload)
    if args.limit is not None:
        workload = workload[:args.limit]
    items = MeasuredWorkload(workload, apps, elastic=False, sync=args.sync,
                             gpus_per_node=cluster.gpus_per_node).trace     # checks every job
    for t in items:
        if t.num_gpus > cluster.total_gpus:
            raise ValueError(f"job {t.job_id} asks for {t.num_gpus} GPUs; the cluster has {cluster.total_gpus}")
    return _Workload(items, workload, apps)


def _config(args, packing: str | None = None, base: str = "") -> SimConfig:
    every = args.decide_every
    if every is None and packing is not None:       # an allocation policy's own rounds, else Tesserae's
        every = (args.interval or ALLOCATION_INTERVAL) if base in ALLOCATION_POLICIES else ROUND_SECONDS
    guard = {"min_run_factor": args.min_run_factor, "min_run": args.min_run, "preemption_cost": args.restart_cost,
             "start_cost": args.start_cost, "decide_every": every}
    if args.original:
        if packing is not None:
            raise cli.UsageError("GPU sharing places jobs on nodes: it cannot run with --original")
        return SimConfig("count", args.packlimit, overheads=False, slowdown=False, migrate=False, **guard)
    if not 0.0 <= args.packlimit <= 1.0:
        raise ValueError(f"--packlimit must be in [0, 1] (a skew), got {args.packlimit}")
    if packing is not None and (args.placement == "count" or args.migrate):
        raise cli.UsageError("GPU sharing plans GPUs on nodes every round: not with --placement count or --migrate")
    return SimConfig(args.placement, args.packlimit, overheads=args.overheads, slowdown=args.slowdown,
                     migrate=args.migrate, packing=packing, learn_profiles=packing is not None and args.learn_profiles,
                     fresh_plans=packing is not None and args.fresh_plans, **guard)


def _sharing(args, packing: str | None):
    """The profile store a GPU-sharing policy decides with (and the one jobs run at)."""
    if packing is None:
        return None, None
    import random

    from .packing.profiles import load_profiles
    from .packing.slots import ProfileSharing
    store = load_profiles(args.colocation or DEFAULT_COLOCATION, args.gpu_type)
    if not 0.0 <= args.profile_noise <= 1.0:
        raise cli.UsageError(f"--profile-noise must be in [0, 1], got {args.profile_noise}")
    seen = store.with_noise(args.profile_noise, random.Random(args.profile_seed)) if args.profile_noise else store
    return ProfileSharing(seen), ProfileSharing(store)


def _queues(args, jobs) -> QueueConfig:
    services = None
    if str(args.queues).strip().lower() == "auto":
        if args.distribution:
            from .gittins import ServiceDistribution
            services = ServiceDistribution.from_csv(args.distribution).samples
        else:
            services = _history(jobs)
    return queue_config(args.queues, args.thresholds, services)


def _history(jobs) -> list[float]:
    """The trace's jobs' GPU-seconds (a measured workload's are not known in seconds)."""
    if isinstance(jobs, _Workload):
        raise cli.UsageError("with --workload, gittins and --queues auto need --distribution "
                             "(the jobs' GPU-seconds are not known in advance)")
    return [j.num_gpus * j.duration for j in jobs]


def _progress(args, label: str) -> bool | ProgressLines:
    """What the simulator reports progress with: a bar on a terminal, lines elsewhere, or
    nothing (``--no-progress``; by default ``simulate`` reports only on a terminal)."""
    tty = sys.stderr.isatty()
    on = args.progress if args.progress is not None else (tty or args.command == "compare")
    if not on:
        return False
    return True if tty else ProgressLines(label)


def _run(name: str, args, cluster, jobs, queues: QueueConfig, record: bool = False):
    progress = _progress(args, f"tiresias {args.command}: {name}")
    label = name
    packing, name = SHARING_POLICIES.get(name, (None, name))
    config = _config(args, packing, name)
    decide, truth = _sharing(args, packing)
    target = cluster if config.placement != "count" else cluster.total_gpus
    policy = make_policy(name, thresholds=queues.thresholds, promote_knob=args.promote_knob,
                         continuous=args.continuous, interval=args.interval, distribution=args.distribution,
                         quantum=args.quantum, switch=args.switch, cluster=cluster,
                         history=_history(jobs) if name == "gittins" and not args.distribution else None)
    if isinstance(jobs, _Workload):
        from .sim.measured import simulate_workload
        result = simulate_workload(jobs.workload, jobs.apps, target, policy, config, args.sync, record=record,
                                   progress=progress, stall_limit=args.stall_limit, sharing=decide, true_sharing=truth)
    else:
        result = simulate(jobs, target, policy, record=record, progress=progress, config=config,
                          stall_limit=args.stall_limit, sharing=decide, true_sharing=truth)
    if packing is not None:
        result.policy = label            # the base policy's name says "las"
    return result


def _uses_queues(name: str, args) -> bool:
    return SHARING_POLICIES.get(name, (None, name))[1] in ("las", "gittins") and not args.continuous


def _context(args, cluster, jobs, queues: QueueConfig) -> tuple[dict, str]:
    """The offered load and the queue configuration: as JSON fields, and as text lines."""
    if isinstance(jobs, _Workload):
        return ({"workload": args.workload, "sync": args.sync, "jobs": len(jobs)},
                f"{len(jobs)} jobs of {args.workload} on {args.cluster} (sync: {args.sync})")
    load = offered_load(jobs, cluster.total_gpus)
    queue_line = f"queues (las, gittins): {queues.text()}" if not args.continuous else \
        f"queues: none (continuous priorities every {args.interval or 1.0:g} s)"
    return {"offered_load": load.as_dict()}, f"{load.text()}\n{queue_line}"


def _cmd_simulate(args) -> int:
    cluster, jobs = _load(args)
    queues = _queues(args, jobs)
    result = _run(args.policy, args, cluster, jobs, queues, record=bool(args.plot))
    summary = summarize(result)
    if _reports_fairness(args, [args.policy]):
        summary.update(finish_time_fairness(result))
    summary.update(_context(args, cluster, jobs, queues)[0])
    if _uses_queues(args.policy, args):
        summary["queues"] = queues.as_dict()
    if args.json:
        cli.write_json(args.json, summary)      # the file only ('-': stdout)
    else:
        print(json.dumps(summary, indent=2))
    if args.jobs_csv:
        write_jobs_csv(result, args.jobs_csv)
    if args.plot:
        from .plots import plot_run
        plot_run(result, args.plot)
    return 0


def _policy_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise cli.UsageError(f"--policies: no policy given (a comma-separated list of {', '.join(POLICIES)})")
    for name in names:
        if name not in POLICIES:
            raise cli.UsageError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
    if len(set(names)) != len(names):
        raise cli.UsageError(f"--policies: a policy is named twice in {text!r}")
    return names


def _cmd_compare(args) -> int:
    names = _policy_names(args.policies)
    cluster, jobs = _load(args)
    queues = _queues(args, jobs)
    context, header = _context(args, cluster, jobs, queues)
    rows, jct = {}, {}
    fair = _reports_fairness(args, names)
    for name in names:
        result = _run(name, args, cluster, jobs, queues)
        rows[name] = summarize(result)
        if fair:
            rows[name].update(finish_time_fairness(result))
        if args.plot:
            from .plots import jcts
            jct[name] = jcts(result)
    base_name = "las" if "las" in rows else names[-1]
    base = rows[base_name]
    lines = [header,
             f"{'policy':<16} {'avg JCT (s)':>14} {'median JCT':>12} {'p95 JCT':>12} {'avg/' + base_name:>14} "
             f"{'median/' + base_name:>15} {'preempt':>8}"]
    for name, r in rows.items():
        lines.append(f"{name:<16} {r['avg_jct']:>14.0f} {r['median_jct']:>12.0f} {r['p95_jct']:>12.0f} "
                     f"{_ratio(r['avg_jct'], base['avg_jct']):>13} {_ratio(r['median_jct'], base['median_jct']):>14} "
                     f"{r['preemptions']:>8}")
    if fair:
        lines.append(f"{'policy':<16} {'makespan (s)':>13} {'migrations':>11} {'renaming off':>13} {'FTF max':>8} "
                     f"{'FTF mean':>9}")
        for name, r in rows.items():
            lines.append(f"{name:<16} {r['makespan']:>13.0f} {r['migrations']:>11} "
                         f"{r['migrations_without_matching']:>13} {_num(r['ftf_max'])} {_num(r['ftf_mean'], 9)}")
    for name, r in rows.items():
        r["normalized_by"] = base_name
        r[f"avg_jct_vs_{base_name}"] = _div(r["avg_jct"], base["avg_jct"])
        r[f"median_jct_vs_{base_name}"] = _div(r["median_jct"], base["median_jct"])
        r.update(context)
        if _uses_queues(name, args):
            r["queues"] = queues.as_dict()
    cli.emit(args.json, list(rows.values()), "\n".join(lines))
    if args.plot:
        from .plots import plot_jct_cdf
        plot_jct_cdf(jct, args.plot, title=f"{len(jobs)} jobs on {args.cluster}")
    return 0


def _reports_fairness(args, names: list[str]) -> bool:
    return args.colocation is not None or any(n in SHARING_POLICIES for n in names)


def _num(x: float | None, width: int = 8) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.2f}"


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratio(a: float | None, b: float | None) -> str:
    r = _div(a, b)
    return "-" if r is None else f"{r:.2f}x"


def _workload_arguments(p: argparse.ArgumentParser) -> None:
    from .generate import KINDS
    p.add_argument("--kind", choices=KINDS, default="shockwave",
                   help="shockwave: Tesserae's default trace (Shockwave's generator); gavel: Gavel's "
                        "(Tesserae sec. 7.2)")
    p.add_argument("--jobs", type=cli.positive(int), default=900, help="number of jobs")
    p.add_argument("--rate", type=cli.positive(float), default=80.0, metavar="JOBS_PER_HOUR",
                   help="Poisson arrival rate (the first job at 0)")
    p.add_argument("--seed", type=cli.non_negative(int), default=0,
                   help="the same seed gives the same trace (and more --jobs extend it)")
    p.add_argument("--colocation", default=str(DEFAULT_COLOCATION), metavar="FILE",
                   help="co-location profiles whose job types (model, batch size, GPUs) the jobs are drawn from")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the trace to write (generic format with model and batch_size)")
    p.add_argument("--gpus", type=cli.positive(int), default=80, help="cluster size the offered load is reported for")


def _cmd_workload(args) -> int:
    from .generate import generate, offered_load, write_trace
    if not Path(args.colocation).is_file():
        raise cli.UsageError(f"--colocation {args.colocation}: no such file")
    from .packing.profiles import load_profiles
    types = [(t.model, t.batch_size, t.gpus) for t in load_profiles(args.colocation).job_types()]
    jobs = generate(args.kind, args.jobs, args.rate, args.seed, types)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(jobs, out)
    span = jobs[-1].submit_time - jobs[0].submit_time
    asked = sum(j.num_gpus for j in jobs)
    load = offered_load(jobs, args.gpus)
    load_text = "undefined (one submission time)" if load is None else f"{load:.2f}"
    summary = {"kind": args.kind, "jobs": len(jobs), "rate": args.rate, "seed": args.seed,
               "colocation": str(args.colocation), "out": str(out), "span_seconds": span, "gpus_asked": asked,
               "gpus": args.gpus, "offered_load": load}
    cli.emit(args.json, summary, f"{len(jobs)} jobs asking {asked} GPUs over {span / 3600.0:.1f} h, "
                                 f"offered load {load_text} on {args.gpus} GPUs -> {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The ``tiresias`` parser: the simulator's commands and the live service's."""
    from .service import cli as service_cli
    parser = cli.parser("tiresias", "Tiresias GPU cluster scheduler: simulator and live master")
    sub = cli.add_commands(parser)
    p = cli.add_command(sub, "simulate", "simulate one policy on a trace", log_level="WARNING",
                        json_help="write the summary as JSON to FILE only ('-' for stdout; without "
                                  "--json it is printed)")
    _common(p)
    p.add_argument("--policy", choices=sorted(POLICIES), default="las", help="the scheduling policy")
    p.add_argument("--jobs-csv", default=None, metavar="FILE", help="one row per job")
    p.add_argument("--plot", default=None, metavar="PNG", help="JCT CDF and GPUs in use over time")
    p.set_defaults(func=_cmd_simulate)
    p = cli.add_command(sub, "compare", "simulate several policies, normalized by las (else by the last one)",
                        log_level="WARNING",
                        json_help="write one summary per policy as JSON to FILE ('-' for stdout "
                                  "instead of the table)")
    _common(p)
    p.add_argument("--policies", default="fifo,best-effort,srtf,gandiva,gittins,las",
                   help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--plot", default=None, metavar="PNG", help="the policies' JCT CDFs (log x-axis)")
    p.set_defaults(func=_cmd_compare)
    p = cli.add_command(sub, "workload", "write a synthetic trace (Tesserae's shockwave or gavel workload)",
                        log_level="WARNING", json_help="write the summary as JSON to FILE ('-' for stdout "
                                                       "instead of the line)")
    _workload_arguments(p)
    p.set_defaults(func=_cmd_workload)
    service_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        return cli.no_subcommand(parser)
    cli.setup_logging(args.log_level)
    return cli.run_main(f"tiresias {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
