"""The live-service commands of ``tiresias``: ``master`` and its clients.

``tiresias master --state DIR --bind HOST:PORT --executor local|ray --nodes NxG --policy ...``
runs a master, the only one on its state dir (``dlrt.statelock``: a second exits 1 naming the
owner, before it reads anything); ``submit``, ``jobs``, ``job``, ``cancel``, ``nodes``,
``drain``, ``undrain``, ``logs`` and ``events`` talk to one, found through ``--state DIR`` (its address and token
files) or ``--master URL --token-file FILE`` (defaults: ``$TIRESIAS_MASTER``,
``$TIRESIAS_TOKEN_FILE``; a token file with ``--state`` replaces ``STATE/token``: a user's
token). ``tiresias master users add|list|revoke`` manages the users (``user_commands``).
The command-line convention is ``dlrt.cli``'s;
exit status: 0 done, 1 the master refused (the reason is printed) or could not be reached,
2 a usage error. ``tiresias.cli.main`` parses and runs these commands.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

from dlrt import cli, sizes, statelock
from dlrt.cli import UsageError
from dlrt.endpoints import host_port

from .. import progress
from .client import Client, read_token
from .user_commands import add_user_commands

DEFAULT_STATE = os.environ.get("TIRESIAS_STATE") or os.path.expanduser("~/.tiresias")
def parse_size(text: str) -> int:
    """``4G``, ``512MiB``, ``1000000`` -> bytes (binary units; ``dlrt.sizes``), at least one."""
    try:
        value = sizes.parse_size(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if value < 1:
        raise UsageError(f"size {text!r} must be at least one byte")
    return value


def size_or_zero(text: str) -> int:
    """argparse type: a size (``64M``, ``1G``, bytes), 0 allowed (off)."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """argparse type: ``30d``, ``12h``, ``90m``, ``45s`` or seconds -> seconds (0 allowed)."""
    m = _DURATION.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a duration such as 30d, 12h, 90m or seconds, got {text!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def parse_bind(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``tcp://HOST:PORT`` (port 0: any free port) -> ``(host, port)``."""
    try:
        host, port = host_port(text, bind=True)
    except ValueError as exc:
        raise UsageError(f"--bind: {exc}") from None
    return host.strip("[]"), port


def _skew(text: str) -> float:
    """argparse type: a skew, a number in [0, 1]."""
    value = cli.non_negative(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``master`` and the client commands to ``tiresias``'s subcommands."""
    p = cli.add_command(sub, "master", "run a live master (scheduler + HTTP API)")
    _master_args(p)
    p.set_defaults(func=cmd_master)
    add_user_commands(p)

    p = _client(sub, "submit", "submit a job: tiresias submit --gpus N [options] -- CMD ...")
    p.add_argument("--gpus", type=gpu_range, required=True,
                   help="GPUs the job needs: N (fixed), or LO-HI for an elastic job (an allocation policy "
                        "picks the count; the others run it at HI)")
    p.add_argument("--name", default=None, help="the job's name (default: the command's file name)")
    p.add_argument("--memory", default=None, help="memory the job needs per node (e.g. 4G): placed where it "
                                                  "fits, enforced by a memory cgroup")
    p.add_argument("--autops-aggregators", type=cli.positive(int), default=None,
                   help="run on the shared AutoPS pool, asking for K aggregators")
    p.add_argument("--duration", type=cli.positive(float), default=None,
                   help="declared duration in seconds (srtf/srsf)")
    p.add_argument("--launcher", choices=["torchrun", "plain"], default=None,
                   help="torchrun: one worker per GPU (default for a .py script); plain: the command once per node")
    p.add_argument("--model", default=None, help="model name, for its skew until AutoPS measures it, and with "
                                                 "--batch-size its row of the co-location table (GPU sharing)")
    p.add_argument("--batch-size", default=None, help="GPU sharing: the batch size as the co-location table writes "
                                                      "it (e.g. 64, 256/16)")
    p.add_argument("--no-share", dest="share", action="store_false",
                   help="GPU sharing: never pack this job with another on the same GPUs")
    p.add_argument("--converge", type=float, default=None, metavar="DELTA",
                   help="elastic: the job counts as converged within DELTA of its loss's total improvement "
                        "(an allocation policy's estimate of its remaining steps; default 0.05)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="a variable of the job's environment (repeat for more)")
    p.add_argument("--workdir", default=None, help="the job's working directory (default: the current one)")
    p.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the job's command")
    p.set_defaults(func=cmd_submit)

    p = _client(sub, "jobs", "list jobs")
    p.add_argument("--status", default=None, help="comma-separated statuses to show")
    p.add_argument("--limit", type=cli.positive(int), default=None, metavar="N",
                   help="the newest N jobs (default: the master's, 1000; at most 10000)")
    p.set_defaults(func=cmd_jobs)
    p = _client(sub, "job", "show one job")
    p.add_argument("id", type=int, help="the job's id")
    p.set_defaults(func=cmd_job)
    p = _client(sub, "cancel", "cancel a job")
    p.add_argument("id", type=int, help="the job's id")
    p.set_defaults(func=cmd_cancel)
    p = _client(sub, "nodes", "show nodes: GPUs, jobs, memory")
    p.set_defaults(func=cmd_nodes)
    for name, online in (("drain", False), ("undrain", True)):
        p = _client(sub, name, "return a node to service" if online else "take a node out of service")
        p.add_argument("node", help="the node's name (as `tiresias nodes` shows it)")
        p.set_defaults(func=cmd_drain, online=online)
    p = _client(sub, "logs", "print a job's output")
    p.add_argument("id", type=int, help="the job's id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)
    p = _client(sub, "events", "recent events")
    p.add_argument("--job", type=int, default=None, help="only this job's events (default: every job's)")
    p.add_argument("--limit", type=cli.positive(int), default=50, help="the newest N events")
    p.set_defaults(func=cmd_events)


def _client(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    p = cli.add_command(sub, name, help_text, log_level="WARNING",
                        json_help="write the answer as JSON to FILE ('-' for stdout instead of the text)")
    p.add_argument("--state", default=DEFAULT_STATE, help="the master's state dir (address and token)")
    p.add_argument("--master", default=os.environ.get("TIRESIAS_MASTER") or None,
                   help="the master's URL (instead of --state's address; default: $TIRESIAS_MASTER)")
    p.add_argument("--token-file", default=os.environ.get("TIRESIAS_TOKEN_FILE") or None,
                   help="the token file (needed with --master; default: $TIRESIAS_TOKEN_FILE, else STATE/token)")
    return p


def _master_args(p: argparse.ArgumentParser) -> None:
    from ..placement import DEFAULT_PACKLIMIT
    from .master import LIVE_POLICIES
    p.add_argument("--state", default=DEFAULT_STATE, help="state dir (SQLite, token, logs, checkpoints)")
    p.add_argument("--bind", default="127.0.0.1:8470",
                   help="HOST:PORT or tcp://HOST:PORT of the HTTP API (port 0: any)")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: jobs run on this machine, on emulated nodes (--nodes); ray: on a Ray cluster")
    p.add_argument("--nodes", default="2x4", help="local executor: NODESxGPUS emulated on this machine")
    p.add_argument("--ray-address", default=None, help="ray executor: the Ray cluster's address")
    p.add_argument("--policy", choices=LIVE_POLICIES, default="las", help="the scheduling policy")
    p.add_argument("--queues", type=cli.positive(int), default=2, help="las/gittins: the number of queues")
    p.add_argument("--thresholds", default="3200", help="queue thresholds in GPU-seconds, comma-separated")
    p.add_argument("--promote-knob", type=cli.positive(float), default=None,
                   help="las/gittins: a job that waited at least this many times its last run goes back to the "
                        "first queue (default: never)")
    p.add_argument("--distribution", default=None, help="gittins: CSV of past jobs' GPU-seconds")
    p.add_argument("--packlimit", type=_skew, default=DEFAULT_PACKLIMIT,
                   help="consolidate jobs whose skew is above this (0..1)")
    p.add_argument("--interval", type=cli.positive(float), default=5.0, help="seconds between scheduling passes")
    p.add_argument("--round-interval", type=cli.positive(float), default=None, metavar="SECONDS",
                   help="seconds between the rounds of an allocation policy (optimus, drf, tetris, elastic-srpt, "
                        "tesserae-optimus; default 600, Optimus's 10 minutes) or of GPU sharing (the other "
                        "tesserae-*, gavel-las; default 360, Tesserae's 6 minutes)")
    p.add_argument("--colocation", default=None, metavar="FILE",
                   help="tesserae-*, gavel-las: the co-location throughput table (Tesserae's CSV or Gavel's JSON; "
                        "default the Tesserae authors' table in ../shared/data/colocation)")
    p.add_argument("--gpu-type", default=None, help="a Gavel-format --colocation table's GPU type (default v100)")
    p.add_argument("--profile-settle", type=cli.non_negative(float), default=60.0, metavar="SECONDS",
                   help="GPU sharing: a job's speed alone or beside its partner counts toward the co-location "
                        "profile once that pairing has held this long (default 60)")
    p.add_argument("--stop-grace", type=cli.non_negative(float), default=30.0,
                   help="seconds a job has to checkpoint and exit before SIGTERM (SIGKILL 5 s later)")
    p.add_argument("--max-lost-runs", type=cli.positive(int), default=3, metavar="N",
                   help="a job whose last N runs were all lost (node gone, master restarted) fails instead of "
                        "being started again (default 3)")
    p.add_argument("--max-log-bytes", type=size_or_zero, default=64 << 20, metavar="SIZE",
                   help="rotate a job's log (STATE/jobs/ID/job.log) to job.log.1 at this size, keeping one "
                        "previous file: a job's logs take at most about twice this; 64M by default (0: no cap)")
    p.add_argument("--min-free-bytes", type=size_or_zero, default=None, metavar="SIZE",
                   help="refuse submits (HTTP 507) while the state dir's filesystem has less than this free "
                        "(default: the smaller of 256M and 5%% of the filesystem; 0: never refuse)")
    p.add_argument("--max-queued-per-user", type=cli.non_negative(int), default=1000, metavar="N",
                   help="a user's jobs not yet ended (queued or running) before submits get HTTP 429 "
                        "(0: no cap; the operator's token is exempt)")
    p.add_argument("--submit-rate-per-user", type=cli.non_negative(float), default=600.0, metavar="N",
                   help="a user's submits per minute (token bucket) before HTTP 429 with Retry-After "
                        "(0: no limit; the operator's token is exempt)")
    p.add_argument("--submit-burst", type=cli.positive(int), default=100, metavar="N",
                   help="submits a user may make at once before --submit-rate-per-user applies")
    p.add_argument("--retention", type=duration, default=30 * 86400.0, metavar="DURATION",
                   help="prune finished, failed and cancelled jobs (rows, events, logs, checkpoints) this long "
                        "after they ended, e.g. 30d, 12h; 30 days by default (0: keep forever); pruned jobs answer 404")
    p.add_argument("--backup-interval", type=cli.non_negative(float), default=600.0,
                   help="seconds between backups of STATE/state.db to STATE/state.db.bak (also made at start "
                        "and at a clean stop; 0: only then)")
    p.add_argument("--checkpoint-root", default=None,
                   help="where checkpoints live, a path every node sees (default: STATE/checkpoints)")
    p.add_argument("--autops-master", type=cli.address, default=None, metavar="ADDR",
                   help="pMaster address given to jobs with --autops-aggregators")
    p.add_argument("--autops-reports", type=cli.address, nargs="*", default=[], metavar="ADDR",
                   help="pMaster utilization PUB address(es)")
    p.add_argument("--infiniswap-reports", type=cli.address, nargs="*", default=[], metavar="ADDR",
                   help="Infiniswap daemons' utilization PUB addresses")
    p.add_argument("--node-host", action="append", default=[], metavar="NODE=HOST",
                   help="the host name a node's Infiniswap reports carry (default: the node's name)")
    p.add_argument("--report-max-age", type=cli.positive(float), default=10.0,
                   help="older reports are ignored and flagged")
    p.add_argument("--run-as-owner", action="store_true",
                   help="local executor, master as root: run each job as the OS user named like its owner "
                        "(it must exist), its checkpoint dir and log that user's, mode 0700/0600")
    p.add_argument("--user-map", action="append", default=[], metavar="OWNER=OSUSER",
                   help="with --run-as-owner: the OS user an owner's jobs run as (default: the owner's name; "
                        "the operator's jobs: the master's user unless mapped)")
    progress.add_arguments(p, live=True)


def cmd_master(args) -> int:
    from ..cluster import parse_cluster
    from ..queues import queue_config
    from .master import Master, MasterConfig
    from .reports import ReportFeed
    from .server import serve
    host, port = parse_bind(args.bind)
    thresholds = tuple(queue_config(args.queues, args.thresholds).thresholds)   # ValueError: exit 2
    node_hosts = _pairs("--node-host", args.node_host, "NODE=HOST")
    config = MasterConfig(args.state, args.policy, thresholds, args.promote_knob, args.distribution,
                          args.packlimit, args.interval, args.stop_grace, args.checkpoint_root,
                          args.autops_master, node_hosts, args.min_run_factor, args.min_run,
                          args.run_as_owner, _user_map(args), max_lost_runs=args.max_lost_runs,
                          max_log_bytes=args.max_log_bytes, min_free_bytes=args.min_free_bytes,
                          max_queued_per_user=args.max_queued_per_user,
                          submit_rate_per_user=args.submit_rate_per_user, submit_burst=args.submit_burst,
                          retention_s=args.retention, round_interval=args.round_interval,
                          colocation=args.colocation, gpu_type=args.gpu_type, profile_settle_s=args.profile_settle)
    shape = None
    if args.executor == "local":
        shape = parse_cluster(args.nodes) if re.match(r"^\s*\d+\s*[xX]\s*\d+\s*$", args.nodes) else None
        if shape is None:
            raise UsageError(f"--nodes {args.nodes!r}: expected NODESxGPUS, e.g. 2x4")
    # one master per state dir: the lock comes before anything there is read or written
    owner = statelock.acquire(args.state, "tiresias master", hint="give this one another --state")
    try:
        if shape is not None:
            from .local import LocalExecutor
            executor = LocalExecutor(shape.nodes, shape.gpus_per_node)
        else:
            from .ray_executor import RayExecutor
            executor = RayExecutor(args.ray_address)
        reports = ReportFeed(args.autops_reports, args.infiniswap_reports, max_age=args.report_max_age)
        master = Master(config, executor, reports=reports)
        master.store.start_backups(args.backup_interval)     # the database passed its check
        return serve(master, host, port, ready=lambda url: owner.record(url=url))
    finally:
        owner.release()


def _pairs(option: str, items: list[str], form: str) -> dict[str, str]:
    """``KEY=VALUE`` items of ``option`` as a dict; ``UsageError`` naming a malformed one."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise UsageError(f"{option} {item!r}: expected {form}")
        pairs[key] = value
    return pairs


def _user_map(args) -> dict[str, str]:
    """``--user-map OWNER=OSUSER`` items; checks ``--run-as-owner``'s conditions."""
    mapping = _pairs("--user-map", args.user_map, "OWNER=OSUSER")
    if mapping and not args.run_as_owner:
        raise UsageError("--user-map needs --run-as-owner")
    if args.run_as_owner and args.executor != "local":
        raise UsageError("--run-as-owner works with the local executor only")
    if args.run_as_owner and os.geteuid() != 0:
        raise UsageError("--run-as-owner needs the master to run as root (it switches each job to its owner)")
    return mapping


def _connect(args) -> Client:
    if args.master:
        if not args.token_file:
            raise UsageError("--master needs --token-file (or $TIRESIAS_TOKEN_FILE)")
        return Client(args.master, read_token(args.token_file))
    return Client.from_state(args.state, args.token_file)


def _emit(args, data: Any, text: str) -> None:
    cli.emit(args.json, data, text)


def gpu_range(text: str) -> tuple[int, int]:
    """``N`` -> (N, N); ``LO-HI`` -> (LO, HI) with 1 <= LO <= HI."""
    if "-" not in text.lstrip("-"):                   # one number (perhaps negative)
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number above 0 or LO-HI (e.g. 4 or 1-8), "
                                             f"got {text!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return n, n
    lo, _, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 0 or LO-HI (e.g. 4 or 1-8), got {text!r}") \
            from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return low, high


def cmd_submit(args) -> int:
    command = list(args.job_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command: tiresias submit --gpus N [options] -- CMD ...")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    low, high = args.gpus
    spec = {"gpus": high, "min_gpus": low if low < high else None, "command": command, "name": args.name, "env": env,
            "workdir": os.path.abspath(args.workdir or os.getcwd()), "launcher": args.launcher,
            "autops_aggregators": args.autops_aggregators, "duration": args.duration, "model": args.model,
            "memory": parse_size(args.memory) if args.memory else None, "converge": args.converge,
            "batch_size": args.batch_size, "share": None if args.share else False}
    job = _connect(args).post("/api/v1/jobs", {k: v for k, v in spec.items() if v is not None})
    gpus = f"{job['min_gpus']}-{job['gpus']}" if job.get("min_gpus") else f"{job['gpus']}"
    _emit(args, job, f"submitted job {job['id']} ({job['name']}, {gpus} GPU(s)): {job['status']}")
    return 0


def _ts(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _placement(p: dict[str, list[int]]) -> str:
    return " ".join(f"{n}[{','.join(map(str, g))}]" for n, g in p.items()) or "-"


def _gpus(j: dict[str, Any]) -> str:
    """``4``; an elastic job ``1-4``, running at 2 of them ``2/1-4``."""
    asked = f"{j['min_gpus']}-{j['gpus']}" if j.get("min_gpus") else f"{j['gpus']}"
    alloc = j.get("allocation")
    return f"{alloc['gpus']}/{asked}" if alloc and j.get("min_gpus") else asked


def _elastic_note(j: dict[str, Any]) -> str:
    """An allocation policy's view of a running job: its aggregators and predicted time left."""
    alloc, model = j.get("allocation") or {}, j.get("model") or {}
    parts = [f"{alloc['aggregators']} agg"] if alloc.get("aggregators") else []
    if model.get("predicted_remaining_s") is not None:
        parts.append(f"~{model['predicted_remaining_s']:.0f} s left")
    return f" ({', '.join(parts)})" if parts else ""


def jobs_table(jobs: list[dict[str, Any]]) -> str:
    lines = [f"{'id':>4} {'name':<18} {'status':<10} {'gpus':>7} {'queue':>5} {'preempt':>7} "
             f"{'service':>9} {'submitted':>9} {'jct':>8}  placement / reason"]
    for j in jobs:
        where = _placement(j["placement"]) + _elastic_note(j) if j["status"] in ("running", "stopping") else \
            (j.get("reason") or "")
        if j["status"] == "failed" and j.get("detail"):
            where = j["detail"].splitlines()[0]
        jct = f"{j['jct']:.1f}" if j.get("jct") is not None else "-"
        lines.append(f"{j['id']:>4} {j['name'][:18]:<18} {j['status']:<10} {_gpus(j):>7} {j['queue']:>5} "
                     f"{j['preemptions']:>7} {j['attained_service']:>9.1f} {_ts(j['submitted']):>9} {jct:>8}  {where}")
    return "\n".join(lines)


def cmd_jobs(args) -> int:
    query = [f"status={args.status}"] if args.status else []
    query += [f"limit={args.limit}"] if args.limit else []
    path = "/api/v1/jobs" + ("?" + "&".join(query) if query else "")
    jobs = _connect(args).get(path)
    _emit(args, jobs, jobs_table(jobs))
    return 0


def cmd_job(args) -> int:
    job = _connect(args).get(f"/api/v1/jobs/{args.id}")
    runs = "\n".join(f"  run {r['run']}: {_placement({n: g for n, g in r['nodes']})} from {_ts(r['started'])} "
                     f"to {_ts(r['ended'])} ({r['outcome'] or 'running'})" +
                     (f", {r['aggregators']} aggregator(s)" if r.get("aggregators") else "")
                     for r in job.get("runs", []))
    text = jobs_table([job]) + f"\ncommand: {' '.join(job['command'])}\ncheckpoints: {job['checkpoint_dir']}\n"
    text += f"skew: {job['skew']:.3f} ({'measured by AutoPS' if job['skew_measured'] else 'declared'})\n"
    text += f"owner: {job.get('owner', 'operator')}\n"
    progress = job.get("progress")
    if progress:
        speed = progress["steps_per_s"]
        text += (f"progress: step {progress['step']:g}" +
                 (f", loss {progress['loss']:.4g}" if progress["loss"] is not None else "") +
                 (f", {speed:.3g} steps/s" if speed is not None else "") +
                 f" (tiresias.job.report; {progress['loss_points']} loss points)\n")
    model = job.get("model")
    if model:
        left = model.get("predicted_remaining_s")
        text += (f"model: {model['loss_points']} loss points, {model['speed_samples']} speed sample(s), "
                 f"{model['remaining_steps']:.0f} steps to convergence (within {model['delta']:g})" +
                 (f", ~{left:.0f} s at its allocation" if left is not None else "") +
                 (" (young: fewer than 3 loss points)" if model.get("young") else "") + "\n")
    if job.get("detail"):
        text += f"detail: {job['detail']}\n"
    _emit(args, job, text + (f"runs:\n{runs}" if runs else "runs: none yet"))
    return 0


def cmd_cancel(args) -> int:
    job = _connect(args).post(f"/api/v1/jobs/{args.id}/cancel")
    _emit(args, job, f"job {job['id']}: {job['status']}")
    return 0


def _mib(v: Any) -> str:
    return f"{v / 2**20:.0f} MiB" if isinstance(v, (int, float)) else "-"


def cmd_nodes(args) -> int:
    nodes = _connect(args).get("/api/v1/nodes")
    lines = [f"{'node':<10} {'state':<8} {'gpus':>4} {'free':>4}  {'mem free':>10} {'lent':>10} "
             f"{'lendable':>10}  jobs"]
    for n in nodes:
        state = "drained" if n["drained"] else ("online" if n["online"] else "offline")
        jobs = " ".join(f"{j}[{','.join(map(str, g))}]" for j, g in n["jobs"].items()) or "-"
        shared = n.get("shared_gpus") or {}
        if shared:
            jobs += "; shared: " + " ".join(f"GPU {g} by jobs {'+'.join(map(str, js))}" for g, js in shared.items())
        lines.append(f"{n['name']:<10} {state:<8} {n['gpus']:>4} {n['free_gpus']:>4}  "
                     f"{_mib(n['memory_free_bytes']):>10} {_mib(n['memory_lent_bytes']):>10} "
                     f"{_mib(n['memory_lendable_bytes']):>10}  {jobs}")
    _emit(args, nodes, "\n".join(lines))
    return 0


def cmd_drain(args) -> int:
    verb = "undrain" if args.online else "drain"
    out = _connect(args).post(f"/api/v1/nodes/{args.node}/{verb}")
    _emit(args, out, f"node {out['node']}: {'online' if out['online'] else 'drained'}"
                     + (f"; preempting jobs {out['preempted']}" if out["preempted"] else ""))
    return 0


def cmd_logs(args) -> int:
    client = _connect(args)
    offset = 0
    while True:
        out = client.get(f"/api/v1/jobs/{args.id}/logs?offset={offset}")
        if out["data"]:
            sys.stdout.write(out["data"])
            sys.stdout.flush()
        offset = out["offset"]
        if not args.follow or (out["status"] in ("finished", "failed", "cancelled") and not out["data"]):
            return 0
        if not out["data"]:
            time.sleep(0.5)


def cmd_events(args) -> int:
    path = f"/api/v1/events?limit={args.limit}" + (f"&job={args.job}" if args.job else "")
    events = _connect(args).get(path)
    text = "\n".join(f"{_ts(e['time'])} {('job ' + str(e['job_id'])) if e['job_id'] else '':<8} "
                     f"{e['kind']:<10} {e['detail']}" for e in events)
    _emit(args, events, text)
    return 0
