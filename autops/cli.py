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
    from .master import serve
    serve(args.bind, heartbeat_timeout=args.heartbeat_timeout)
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
    with LocalPool(args.aggregators, log_level=args.log_level) as pool:
        env = dict(os.environ, AUTOPS_MASTER=pool.master)
        env.setdefault("AUTOPS_JOB", f"job-{uuid.uuid4().hex[:8]}")
        print(f"autops local: master {pool.master}, {args.aggregators} aggregator(s), job {env['AUTOPS_JOB']}",
              file=sys.stderr)
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
    status = query_status(args.master, timeout=args.timeout)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"{'aggregator':<12} {'alive':<6} {'cpu%':>6} {'assigned MiB':>13} {'jobs'}")
    for a in status["aggregators"]:
        print(f"{a['id']:<12} {str(a['alive']):<6} {a.get('cpu_percent', 0):>6.1f} "
              f"{a['assigned_bytes'] / 2**20:>13.1f} {','.join(a.get('jobs', []))}")
    for j in status["jobs"]:
        spread = ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in j["bytes_per_aggregator"].items())
        print(f"job {j['job']}: W={j['world_size']} mode={j['mode']} tensors={j['tensors']} "
              f"keys={j['keys']} [{spread}]")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .benchmark import main as bench_main
    return bench_main(args.bench_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autops", description="AutoPS: a shared parameter service")
    parser.add_argument("--log-level", default=os.environ.get("AUTOPS_LOG", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("master", help="run pMaster")
    p.add_argument("--bind", default="tcp://0.0.0.0:5555", help="ZeroMQ address to listen on")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
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

    p = sub.add_parser("local", help="run CMD against a master and N aggregators on this machine")
    p.add_argument("--aggregators", type=int, default=2)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_local)

    p = sub.add_parser("status", help="print the pool: aggregators, load and jobs")
    p.add_argument("--master", default=os.environ.get("AUTOPS_MASTER", "tcp://127.0.0.1:5555"))
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("bench", help="benchmarks (pushpull)")
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
