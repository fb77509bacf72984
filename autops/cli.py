"""The ``autops`` command: master, aggregator, local pool, status, benchmarks."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import uuid


def _cmd_master(args: argparse.Namespace) -> int:
    from .elastic import ElasticConfig
    from .master import serve
    config = ElasticConfig(enabled=not args.static, loss_limit=args.loss_limit, warmup_iters=args.warmup_iters,
                           profile_iters=args.profile_iters, window=args.window, cluster_size=args.cluster_size,
                           period=args.period, threshold=args.threshold, spare=args.spare,
                           job_timeout=args.job_timeout)
    serve(args.bind, provider=args.provider, max_aggregators=args.max_aggregators, log_level=args.log_level,
          heartbeat_timeout=args.heartbeat_timeout, elastic=config, report_bind=args.report_bind,
          metrics_port=args.metrics_port, report_period=args.report_period)
    return 0


def _cmd_aggregator(args: argparse.Namespace) -> int:
    from .aggregator import serve
    serve(args.master, bind_host=args.bind_host, port=args.port, advertise_host=args.advertise_host,
          ipc=not args.no_ipc, name=args.name, register_timeout=args.register_timeout)
    return 0


def _cmd_local(args: argparse.Namespace) -> int:
    from .local import LocalPool
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        print("autops local: give the command to run after --", file=sys.stderr)
        return 2
    master_args = ["--provider", "local", "--max-aggregators", str(args.aggregators)]
    with LocalPool(0, log_level=args.log_level, master_args=master_args) as pool:
        env = dict(os.environ, AUTOPS_MASTER=pool.master)
        env.setdefault("AUTOPS_JOB", f"job-{uuid.uuid4().hex[:8]}")
        env.setdefault("AUTOPS_AGGREGATORS", str(args.aggregators))   # the job's standalone PS count
        print(f"autops local: master {pool.master}, up to {args.aggregators} aggregator(s) started on demand, "
              f"job {env['AUTOPS_JOB']}", file=sys.stderr)
        proc = subprocess.Popen(cmd, env=env)
        # SIGTERM to us goes to the command; the pool is torn down when it has exited
        signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            return proc.wait()


def _cmd_status(args: argparse.Namespace) -> int:
    from .local import query_status
    from .report import format_status
    status = query_status(args.master, timeout=args.timeout)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    return 0


def _cmd_migrate(args: argparse.Namespace) -> int:
    from . import wire
    from .agent import MasterClient
    from .transport.zmq import make_context
    ctx = make_context()
    client = MasterClient(ctx, args.master, args.timeout)
    try:
        reply = client.call(wire.MIGRATE, job=args.job, keys=args.keys or None, to=args.to or None)
        print(f"migrating {reply['keys']} key(s) of {args.job} in {reply['batches']} batch(es); "
              "follow with `autops status`")
    finally:
        client.close()
        ctx.term()
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .simulate import run
    return run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    argv = list(args.bench_args)
    which = argv[0] if argv and not argv[0].startswith("-") else "pushpull"
    if which == "packing":
        from .bench_elastic import packing_main
        return packing_main(argv[1:])
    if which == "migrate":
        from .bench_elastic import migrate_main
        return migrate_main(argv[1:])
    if which != "pushpull":
        print(f"autops bench: unknown benchmark {which!r} (pushpull, packing, migrate)", file=sys.stderr)
        return 2
    from .benchmark import main as bench_main
    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autops", description="AutoPS: a shared parameter service")
    parser.add_argument("--log-level", default=os.environ.get("AUTOPS_LOG", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("master", help="run pMaster")
    p.add_argument("--bind", default="tcp://0.0.0.0:5555", help="ZeroMQ address to listen on")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--provider", choices=("standby", "local"), default="standby",
                   help="standby: use aggregators started with `autops aggregator`; local: also start "
                        "aggregator processes on this machine when needed")
    p.add_argument("--max-aggregators", type=int, default=None,
                   help="local provider: most aggregator processes it starts (default: CPU count)")
    p.add_argument("--static", action="store_true",
                   help="no elasticity: jobs keep the aggregators they registered on (no packing, no migration)")
    p.add_argument("--loss-limit", type=float, default=0.1, help="LossLimit: largest speed loss packing may cause")
    p.add_argument("--warmup-iters", type=int, default=3, help="iterations ignored before profiling")
    p.add_argument("--profile-iters", type=int, default=10, help="iterations profiled on temporary aggregators")
    p.add_argument("--window", type=int, default=100,
                   help="iterations below (1 - LossLimit) of standalone speed before a job is reverted")
    p.add_argument("--cluster-size", type=int, default=8, help="aggregators per cluster")
    p.add_argument("--period", type=float, default=10.0, help="seconds between periodic scaling passes")
    p.add_argument("--threshold", type=int, default=1,
                   help="allocations of at least this many aggregators happen at once, smaller ones at the next period")
    p.add_argument("--spare", type=int, default=0, help="idle aggregators the local provider keeps running")
    p.add_argument("--job-timeout", type=float, default=30.0,
                   help="release a job when none of its workers was heard from for this long")
    p.add_argument("--report-bind", default=None,
                   help="publish utilization reports (JSON) on this ZeroMQ PUB address, e.g. tcp://0.0.0.0:5557")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this HTTP port")
    p.add_argument("--report-period", type=float, default=1.0, help="seconds between reports")
    p.set_defaults(func=_cmd_master)

    p = sub.add_parser("aggregator", help="run one aggregator (one per machine)")
    p.add_argument("--master", required=True, help="pMaster address, e.g. tcp://10.0.0.1:5555")
    p.add_argument("--bind-host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=0, help="tcp port for workers (0: any free port)")
    p.add_argument("--advertise-host", default=None, help="address workers use to reach this machine")
    p.add_argument("--no-ipc", action="store_true", help="do not offer a unix-socket endpoint")
    p.add_argument("--name", default=None)
    p.add_argument("--register-timeout", type=float, default=30.0)
    p.set_defaults(func=_cmd_aggregator)

    p = sub.add_parser("local", help="run CMD against a master that starts aggregators on this machine")
    p.add_argument("--aggregators", type=int, default=2, help="most aggregator processes to start")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_local)

    p = sub.add_parser("status", help="print the pool: aggregators, load and jobs")
    p.add_argument("--master", default=os.environ.get("AUTOPS_MASTER", "tcp://127.0.0.1:5555"))
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("migrate", help="move a job's keys (all by default) to other aggregators, live")
    p.add_argument("--master", default=os.environ.get("AUTOPS_MASTER", "tcp://127.0.0.1:5555"))
    p.add_argument("--job", required=True)
    p.add_argument("--keys", nargs="*", default=None, help="keys to move (default: every key of the job)")
    p.add_argument("--to", nargs="*", default=None, help="aggregators to move to (default: all others)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=_cmd_migrate)

    p = sub.add_parser("simulate", help="trace-driven simulation of the aggregator pool (CPU saving)")
    try:
        from .simulate import add_arguments
        add_arguments(p)
    except ImportError:
        pass
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("bench", help="benchmarks (pushpull, packing, migrate)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (TimeoutError, RuntimeError, ValueError, OSError) as exc:
        print(f"autops {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
