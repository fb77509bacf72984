"""The ``autops`` command: master, aggregator, local pool, status, migrate, secret, simulate, bench.

Follows the runtime's command-line convention (``dlrt.cli``): addresses as ``HOST:PORT`` or
``tcp://HOST:PORT``, services bind 127.0.0.1 unless ``--bind`` says otherwise, ``--json
FILE`` (``-`` for stdout), ``--log-level`` before or after the subcommand, exit status 2 for
usage errors and 1 for runtime errors. ``bench`` lists the benchmarks; ``bench NAME ...``
runs one from the ``dlrt_bench`` package, imported only then. ``secret`` prints a fresh job
secret (``export AUTOPS_JOB_SECRET=$(autops secret)`` before a torchrun launch); ``local``
makes one per job itself. ``migrate`` presents the operator token (``--token-file``).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import uuid

from dlrt import cli
from dlrt.endpoints import DEFAULT_BIND_HOST, host_port

from .config import (AGGREGATORS_ENV, DEFAULT_ORPHAN_TIMEOUT, JOB_ENV, MASTER_ENV, RESERVE_ENV, RESERVE_SHARED_ENV,
                     SECRET_ENV, TRANSPORT_ENV, AggregatorConfig, MasterConfig, log_level, master_address)
from .wire.jobauth import new_job_secret

# name -> (module, help); the module's ``main(argv)`` parses the benchmark's own options
BENCHMARKS = {
    "pushpull": ("dlrt_bench.autops_pushpull", "push+pull of whole models vs gloo all-reduce (--emulate-hosts: "
                                               "across emulated hosts)"),
    "packing": ("dlrt_bench.autops_packing", "aggregators and CPU of J jobs packed vs dedicated"),
    "migrate": ("dlrt_bench.autops_migrate", "pause a job sees when all its tensors migrate live"),
    "failover": ("dlrt_bench.autops_failover", "what surviving an aggregator's loss costs: replication, pause"),
}
DEFAULT_MASTER = "127.0.0.1:5555"


def _cmd_master(args: argparse.Namespace) -> int:
    from dlrt import statelock
    # one pMaster per state dir: the lock comes before anything there is read or written
    owner = statelock.acquire(args.state_dir, "autops master", hint="give this one another --state-dir")
    from .master.elastic import ElasticConfig
    from .master.pmaster import serve
    config = ElasticConfig(enabled=not args.static, loss_limit=args.loss_limit, warmup_iters=args.warmup_iters,
                           profile_iters=args.profile_iters, window=args.window, cluster_size=args.cluster_size,
                           period=args.period, threshold=args.threshold, spare=args.spare,
                           job_timeout=args.job_timeout, job_idle_timeout=args.job_idle_timeout)
    serve(MasterConfig(bind=args.bind, heartbeat_timeout=args.heartbeat_timeout, provider=args.provider,
                       ray_address=args.ray_address, ray_resource=args.ray_resource,
                       max_aggregators=args.max_aggregators, aggregator_transport=args.aggregator_transport,
                       aggregator_orphan_timeout=args.aggregator_orphan_timeout, report_bind=args.report_bind,
                       metrics_port=args.metrics_port, report_period=args.report_period, state_dir=args.state_dir,
                       log_level=args.log_level),
          config, on_listening=lambda address: owner.record(url=address))
    owner.release()             # (on an exception the process's exit drops it)
    return 0


def _aggregator_config(args: argparse.Namespace) -> AggregatorConfig:
    """The aggregator's settings: its options, and the environment's where an option was not
    given (``AggregatorConfig.from_env``; a bad value is a usage error naming the variable)."""
    if args.bind is not None:
        host, port = host_port(args.bind, bind=True)
    else:                                   # the older spelling: --bind-host HOST --port PORT
        host, port = args.bind_host or DEFAULT_BIND_HOST, args.port
    env = AggregatorConfig.from_env()
    return dataclasses.replace(
        env, bind_host=host.strip("[]"), port=port, advertise_host=args.advertise_host, ipc=not args.no_ipc,
        name=args.name, register_timeout=args.register_timeout, heartbeat_interval=args.heartbeat_interval,
        transport=args.transport, prefault_share=args.prefault_share,
        reserve=env.reserve if args.reserve is None else args.reserve,
        reserve_shared=env.reserve_shared if args.reserve_shared is None else args.reserve_shared,
        orphan_timeout=args.orphan_timeout, max_job_bytes=args.max_job_bytes, max_tenant_bytes=args.max_tenant_bytes)


def _cmd_aggregator(args: argparse.Namespace) -> int:
    from .aggregator.service import serve
    serve(args.master, _aggregator_config(args))
    return 0


def _cmd_local(args: argparse.Namespace) -> int:
    from .local import LocalPool
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        raise cli.UsageError("give the command to run after --, e.g. autops local -- torchrun ... train.py")
    master_args = ["--provider", "local", "--max-aggregators", str(args.aggregators)]
    if args.transport in ("rdma", "cma"):          # the aggregators must listen on it too
        master_args += ["--aggregator-transport", args.transport]
    with LocalPool(0, log_level=args.log_level, master_args=master_args) as pool:
        # the command's environment: the user's, and what makes it a job of this pool (the
        # variables ``AgentConfig.from_env`` reads in each of its ranks)
        env = {**os.environ, MASTER_ENV: pool.master}
        if args.transport is not None:
            env[TRANSPORT_ENV] = args.transport
        job = env.setdefault(JOB_ENV, f"job-{uuid.uuid4().hex[:8]}")
        env.setdefault(SECRET_ENV, new_job_secret())       # every rank of the job presents it
        env.setdefault(AGGREGATORS_ENV, str(args.aggregators))   # the job's standalone PS count
        print(f"autops local: master {pool.master}, up to {args.aggregators} aggregator(s) started on demand, "
              f"job {job}", file=sys.stderr)
        proc = subprocess.Popen(cmd, env=env)
        # SIGTERM to us goes to the command; the pool is torn down when it has exited
        signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            while True:
                try:
                    return proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pool.reap()             # a pMaster that died is no zombie meanwhile
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            return proc.wait()


def _cmd_status(args: argparse.Namespace) -> int:
    from .admin import query_status
    from .master.report import format_status
    status = query_status(args.master, timeout=args.timeout)
    cli.emit(args.json, status, format_status(status))
    return 0


def _cmd_migrate(args: argparse.Namespace) -> int:
    from .admin import AdminClient
    if args.count is not None and (args.keys or args.to):
        raise cli.UsageError("--count spreads every key of the job: give it without --keys or --to")
    with AdminClient(args.master, args.timeout, token_file=args.token_file) as admin:
        if args.count is not None:
            reply = admin.resize(args.job, args.count)
        else:
            reply = admin.migrate(args.job, keys=args.keys, to=args.to)
    over = f" over {reply['aggregators']} aggregator(s)" if reply.get("aggregators") else ""
    cli.emit(args.json, reply, f"migrating {reply['keys']} key(s) of {args.job}{over} in {reply['batches']} "
                               "batch(es); follow with `autops status`")
    return 0


def _cmd_secret(args: argparse.Namespace) -> int:
    print(new_job_secret())
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .master.simulate import run
    return run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    module, _ = BENCHMARKS[args.benchmark]
    return importlib.import_module(module).main(args.forward)


def _aggregator_bind(text: str) -> str:
    """argparse type of ``aggregator --bind``: ``HOST:PORT``, ``tcp://HOST:PORT`` or just ``HOST``
    (any free port)."""
    try:
        return cli.bind_address(text)
    except argparse.ArgumentTypeError:
        if ":" in text.strip():
            raise
        return cli.bind_address(f"{text.strip()}:0")


class _LegendFormatter(argparse.RawDescriptionHelpFormatter, cli.HelpFormatter):
    """The runtime's help format, with the description and epilog kept line by line."""


def _master_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", type=cli.address, default=master_address() or DEFAULT_MASTER,
                   metavar="ADDR", help="pMaster address ($AUTOPS_MASTER when set)")


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``autops`` parser and its ``bench`` group."""
    parser = cli.parser("autops", "AutoPS: a shared parameter service")
    parser.add_argument("--log-level", type=cli.log_level, choices=cli.LOG_LEVELS, metavar="LEVEL",
                        default=log_level(),
                        help="DEBUG, INFO, WARNING or ERROR, also accepted after the command "
                             "($AUTOPS_LOG when set)")
    sub = cli.add_commands(parser)

    m = MasterConfig.from_env()              # the defaults, and the environment's state directory
    p = cli.add_command(sub, "master", "run pMaster", log_level=None)
    p.add_argument("--bind", type=cli.address, default=f"{DEFAULT_BIND_HOST}:5555", metavar="ADDR",
                   help="address to listen on (HOST:PORT or tcp://HOST:PORT; 0.0.0.0:PORT for every interface)")
    p.add_argument("--heartbeat-timeout", type=cli.positive(float), default=m.heartbeat_timeout,
                   help="seconds without a heartbeat after which an aggregator counts as lost")
    p.add_argument("--provider", choices=("standby", "local", "ray"), default=m.provider,
                   help="standby: use aggregators started with `autops aggregator`; local: also start "
                        "aggregator processes on this machine when needed; ray: also start them as Ray "
                        "actors on the Ray cluster's nodes with free CPUs")
    p.add_argument("--ray-address", default=m.ray_address, metavar="HOST:PORT",
                   help="ray provider: the Ray cluster's address (what `ray start --head` printed; "
                        "default: the cluster this machine runs)")
    p.add_argument("--ray-resource", default=m.ray_resource, metavar="NAME",
                   help="ray provider: start aggregators only on nodes with this custom resource (`ray start "
                        "--resources '{\"NAME\": N}'`: at most N aggregators there), each taking one unit and one "
                        "CPU (default: any node with free CPUs)")
    p.add_argument("--max-aggregators", type=cli.positive(int), default=m.max_aggregators,
                   help="local provider: most aggregator processes it starts (default: CPU count)")
    p.add_argument("--aggregator-transport", choices=("auto", "tcp", "rdma", "cma"), default=m.aggregator_transport,
                   help="local provider: the --transport of the aggregators it starts")
    p.add_argument("--aggregator-orphan-timeout", type=cli.non_negative(float), default=m.aggregator_orphan_timeout,
                   metavar="SECONDS",
                   help="local provider: the aggregators it starts exit after this long without a pMaster "
                        f"(their --orphan-timeout; default {DEFAULT_ORPHAN_TIMEOUT:.0f}; 0: never)")
    p.add_argument("--static", action="store_true",
                   help="no elasticity: jobs keep the aggregators they registered on (no packing, no migration)")
    p.add_argument("--loss-limit", type=cli.non_negative(float), default=0.1,
                   help="LossLimit: largest speed loss packing may cause")
    p.add_argument("--warmup-iters", type=cli.non_negative(int), default=3, help="iterations ignored before profiling")
    p.add_argument("--profile-iters", type=cli.positive(int), default=10,
                   help="iterations profiled on temporary aggregators")
    p.add_argument("--window", type=cli.positive(int), default=100,
                   help="iterations below (1 - LossLimit) of standalone speed before a job is reverted")
    p.add_argument("--cluster-size", type=cli.positive(int), default=8, help="aggregators per cluster")
    p.add_argument("--period", type=cli.positive(float), default=10.0, help="seconds between periodic scaling passes")
    p.add_argument("--threshold", type=cli.positive(int), default=1,
                   help="allocations of at least this many aggregators happen at once, smaller ones at the next period")
    p.add_argument("--spare", type=cli.non_negative(int), default=0,
                   help="idle aggregators the local provider keeps running")
    p.add_argument("--job-timeout", type=cli.positive(float), default=30.0,
                   help="release a job when none of its workers was heard from for this long")
    p.add_argument("--job-idle-timeout", type=cli.positive(float), default=1800.0, metavar="SECONDS",
                   help="release a job that made no progress (pushes and pulls, new iterations) for this long, "
                        "whatever else it sends (a job id held without training); long enough for a job's "
                        "evaluation or checkpoint phases (default 1800)")
    p.add_argument("--report-bind", type=cli.bind_address, default=m.report_bind, metavar="ADDR",
                   help="publish utilization reports (JSON) on this ZeroMQ PUB address, e.g. 127.0.0.1:5557")
    p.add_argument("--metrics-port", type=cli.port, default=m.metrics_port,
                   help="serve Prometheus metrics on this HTTP port (127.0.0.1)")
    p.add_argument("--report-period", type=cli.positive(float), default=m.report_period,
                   help="seconds between reports")
    p.add_argument("--state-dir", default=m.state_dir, metavar="DIR",
                   help="where pMaster keeps the hashes of its live jobs' secrets across restarts "
                        "($AUTOPS_STATE_DIR when set)")
    p.set_defaults(func=_cmd_master)

    a = AggregatorConfig()      # the defaults (the environment's are read when it runs)
    p = cli.add_command(sub, "aggregator", "run one aggregator (one per machine)", log_level=None)
    p.add_argument("--master", type=cli.address, required=True, metavar="ADDR",
                   help="pMaster address, e.g. 10.0.0.1:5555")
    p.add_argument("--bind", type=_aggregator_bind, default=None, metavar="HOST[:PORT]",
                   help="where workers reach this aggregator over TCP (no port or port 0: any free "
                        f"port; default {DEFAULT_BIND_HOST}; 0.0.0.0 for every interface). Without CURVE it "
                        "also listens on PORT+1 (a free port for 0), its plaintext stream endpoint, which "
                        "peers prefer ($AUTOPS_TCP_STREAM=0: ZeroMQ's only)")
    p.add_argument("--bind-host", default=None, help=argparse.SUPPRESS)       # older spelling of --bind
    p.add_argument("--port", type=cli.port, default=0, help=argparse.SUPPRESS)     # older spelling of --bind
    p.add_argument("--advertise-host", default=None,
                   help="address workers use to reach this machine (default: the --bind host; this "
                        "machine's address for 0.0.0.0)")
    p.add_argument("--no-ipc", action="store_true", help="do not offer a unix-socket endpoint")
    p.add_argument("--transport", choices=("auto", "tcp", "rdma", "cma"), default=a.transport,
                   help="rdma: also listen on rdma and reach peer aggregators over it (needs an RDMA "
                        "device; not run on hardware yet, see docs/rdma.md); cma: the same protocol "
                        "between processes of this host, reads by process_vm_readv")
    p.add_argument("--name", default=a.name, help="aggregator id (default: pMaster gives agg-N)")
    p.add_argument("--register-timeout", type=cli.positive(float), default=a.register_timeout,
                   help="seconds to wait for pMaster to take its registration")
    p.add_argument("--heartbeat-interval", type=cli.positive(float), default=a.heartbeat_interval,
                   help="seconds between heartbeats (keep it well below pMaster's --heartbeat-timeout)")
    p.add_argument("--orphan-timeout", type=cli.non_negative(float), default=a.orphan_timeout, metavar="SECONDS",
                   help="exit after this long without hearing from any pMaster (it answers every heartbeat); "
                        "meanwhile it serves its jobs and registers again with a pMaster restarted at the "
                        "same address; 0 (default, for an aggregator an operator runs as a service): never; "
                        "pMaster's local provider starts its aggregators with --aggregator-orphan-timeout "
                        f"(default {DEFAULT_ORPHAN_TIMEOUT:.0f})")
    p.add_argument("--prefault-share", type=cli.share, default=a.prefault_share, metavar="SHARE",
                   help="memory for keys migrating in is populated on this host's idle CPU; a host busy "
                        "for over a second gets it at this share of a core, so that the job's and its "
                        "neighbours' CPU is not taken (1: at once, without waiting for idle CPU)")
    p.add_argument("--reserve", type=cli.size, default=None, metavar="SIZE",
                   help="populate this much memory when the aggregator starts (at the same pace) and keep it, "
                        "so that jobs arriving and keys migrating in later find their server-mode state and "
                        "received pushes' memory ready: their first moves do not wait for it (e.g. 3G; "
                        f"default: ${RESERVE_ENV}, which the aggregators pMaster starts inherit, or {a.reserve})")
    p.add_argument("--reserve-shared", type=cli.share, metavar="SHARE", default=None,
                   help="the share of --reserve made as shared memory, which the keys' published buffers come "
                        "from where workers on this host read them in place; the rest is heap, for server-mode "
                        f"state and received pushes (default: ${RESERVE_SHARED_ENV} or {a.reserve_shared}, for "
                        "server mode with Adam; 0.67 suits sum mode)")
    p.add_argument("--max-job-bytes", type=cli.size, default=a.max_job_bytes, metavar="SIZE",
                   help="the most one job's declared keys may take on this aggregator (e.g. 8G; default: half of "
                        "what it can give when it starts: the least of the host's MemAvailable and its memory "
                        "cgroup's limit less usage); a declaration past it, or past what it can give, is refused")
    p.add_argument("--max-tenant-bytes", type=cli.size, default=a.max_tenant_bytes, metavar="SIZE",
                   help="with CURVE: the most all jobs of one tenant (the name its CURVE key is authorized under, "
                        "`dlrt keys tenant NAME`) may take on this aggregator together, keys moved here included "
                        "(default: the per-job default, half of what it can give when it starts, but at least "
                        "--max-job-bytes); the cluster's own `member` key is not a tenant. A declaration or move "
                        "past it is refused; a job whose tenant it learns from its first request and that takes "
                        "the tenant past it is dropped here")
    p.set_defaults(func=_cmd_aggregator)

    p = cli.add_command(sub, "local", "run CMD against a master that starts aggregators on this machine",
                        log_level=None)
    p.add_argument("--aggregators", type=cli.positive(int), default=2, help="most aggregator processes to start")
    p.add_argument("--transport", choices=("auto", "tcp", "ipc", "shm", "rdma", "cma"), default=None,
                   help="AUTOPS_TRANSPORT for the command (default: as in the environment, else auto); "
                        "with rdma or cma the aggregators are started with it too")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                   help="the command to run, e.g. torchrun ... train.py (it gets $AUTOPS_MASTER, $AUTOPS_JOB, "
                        "$AUTOPS_JOB_SECRET and $AUTOPS_AGGREGATORS)")
    p.set_defaults(func=_cmd_local)

    from .master.report import STATUS_LEGEND
    p = cli.add_command(sub, "status", "print the pool: aggregators, load and jobs", log_level=None,
                        json_help="write the status as JSON to FILE ('-' for stdout instead of the table)",
                        epilog=STATUS_LEGEND)
    p.formatter_class = _LegendFormatter         # the legend keeps its lines
    _master_arg(p)
    p.add_argument("--timeout", type=cli.positive(float), default=5.0, help="seconds to wait for pMaster's answer")
    p.set_defaults(func=_cmd_status)

    p = cli.add_command(sub, "migrate", "move a job's keys (all by default) to other aggregators, live",
                        log_level=None, json_help="write pMaster's answer as JSON to FILE ('-' for stdout)")
    _master_arg(p)
    p.add_argument("--job", required=True, help="the job whose keys move (its AutoPS job id)")
    p.add_argument("--keys", nargs="*", default=None, help="keys to move (default: every key of the job)")
    p.add_argument("--to", nargs="*", default=None, help="aggregators to move to (default: all others)")
    p.add_argument("--count", type=cli.positive(int), default=None, metavar="N",
                   help="spread every key of the job over N aggregators with few moves (those it uses first)")
    p.add_argument("--timeout", type=cli.positive(float), default=5.0, help="seconds to wait for pMaster's answer")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="the operator token (default: operator.token in the key directory, $DLRT_KEYS)")
    p.set_defaults(func=_cmd_migrate)

    p = cli.add_command(sub, "secret", "print a fresh job secret: export AUTOPS_JOB_SECRET=$(autops secret)",
                        log_level=None)
    p.set_defaults(func=_cmd_secret)

    from .master.simulate import JSON_HELP, add_arguments
    p = cli.add_command(sub, "simulate", "trace-driven simulation of the aggregator pool (CPU saving)",
                        log_level=None, json_help=JSON_HELP)
    add_arguments(p)
    p.set_defaults(func=_cmd_simulate)

    bench = cli.add_command(sub, "bench", "benchmarks: " + ", ".join(BENCHMARKS), log_level=None,
                            description="Benchmarks that run AutoPS next to its peer on this machine and "
                                        "print JSON; `autops bench NAME --help` shows a benchmark's options.")
    names = cli.add_commands(bench, dest="benchmark")
    for name, (_, text) in BENCHMARKS.items():
        b = names.add_parser(name, help=text, add_help=False)    # its own parser reads the rest
        b.set_defaults(func=_cmd_bench)
    return parser, bench


def main(argv: list[str] | None = None) -> int:
    parser, bench = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.log_level not in cli.LOG_LEVELS:     # a bad $AUTOPS_LOG: argparse checks no default
        parser.error(f"$AUTOPS_LOG: invalid log level {args.log_level!r} (one of {', '.join(cli.LOG_LEVELS)})")
    if args.command is None:
        return cli.no_subcommand(parser)
    if args.command == "bench":
        if args.benchmark is None:
            return cli.no_subcommand(bench)
        args.forward = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    cli.setup_logging(args.log_level)
    return cli.run_main(f"autops {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
