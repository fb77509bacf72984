"""``autops bench pushpull``: AutoPS push+pull of a model's tensors against gloo all-reduce.

One training iteration's push+pull of every tensor, next to ``torch.distributed`` gloo
all-reduce of the same tensors in DDP-style 25 MB buckets, measured in the same run on the
same hosts.

Per configuration (model x workers x transport x mode x link) it starts a fresh site --
this machine (a local pool), or with ``--emulate-hosts`` one emulated host per aggregator
and per worker (``pushpull_sites``) -- and ``W`` AutoPS workers and ``W`` gloo workers
(``pushpull_workers``). After ``--warmup`` iterations of each, the two systems run in
alternating blocks (``--rounds``; ``--iters`` measured iterations each), so a change in the
background load hits both. It reports the median seconds per iteration (the slowest rank's),
gloo's median, their ratio, the CPU seconds both spend per iteration (workers, and for AutoPS
the aggregators), the aggregators' peak memory relative to the model's size, and on emulated
hosts the bytes that crossed the worker and aggregator hosts' links per iteration. When both
systems' processes would not fit in memory together, each runs alone (``interleaved``:
false). ``--curve off on`` runs each configuration twice, plaintext and with CURVE on every
tcp channel (a fresh cluster key directory, ``dlrt.keys.temporary_cluster``), and reports
``curve_cost``: AutoPS's time with CURVE over its time without. ``--tcp stream zeromq`` runs
each plaintext configuration with tcp over the aggregators' ``stream`` endpoints and over
ZeroMQ's (``AUTOPS_TCP_STREAM``), the second row with ``stream_gain``: ZeroMQ's time over the
stream's (and ``stream_cpu_gain``). ``--json FILE`` writes one
object per configuration (``-``: stdout). Model shapes come from ``autops.models``.
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import psutil

from autops.config import PARTITION_ENV, SECRET_ENV, TCP_STREAM_ENV
from autops.wire.jobauth import new_job_secret
from autops.wire.partition import DEFAULT_PARTITION_BYTES
from dlrt.keys import temporary_cluster
from autops.models import model_tensors
from dlrt import cli
from dlrt.procs import exit_on_sigterm

from .pushpull_sites import EmulatedSite, LocalSite, emulation_unavailable
from .answers import read_answers, stop_workers
from .pushpull_workers import seed_parameters
from .testbed import DEFAULT_CONGESTION, add_rps_option

__all__ = ["main", "seed_parameters", "owned_rss", "RssSampler"]

ANSWER_TIMEOUT = 600.0      # seconds a block of iterations may take
MEMORY_SHARE = 0.6          # run both systems at once only within this share of free memory


# --- memory of the aggregators ---------------------------------------------------------------
def _peak_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def owned_rss(pid: int) -> int:
    """Resident bytes of a process excluding peers' shared segments it maps (workers' staging
    buffers): private memory plus the aggregator's own shared buffers."""
    total, current_peer = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):
                    current_peer = "memfd:autops-agent" in line
                elif first == "Rss:" and not current_peer:
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


class RssSampler:
    """Samples ``owned_rss`` of some processes every ``period`` seconds; keeps the peak sum.

    Reading ``smaps`` walks the process's page tables under its memory map lock: every 50 ms
    for two aggregators it took 12% of this 2-core machine (perf, one-host resnet50 over ipc)
    and held up the aggregators' page faults, slowing the system it measured. A buffer, once
    allocated, stays for the whole run, so sampling twice a second still sees the peak."""

    def __init__(self, pids: list[int], period: float = 0.5) -> None:
        self.pids, self.period, self.peak = pids, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, sum(owned_rss(pid) for pid in self.pids))

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (all their threads): the
    aggregators' (workers measure their own, over their iterations only)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


# --- the worker processes ----------------------------------------------------------------------
class WorkerGroup:
    """Worker processes (``pushpull_workers``) driven over their stdin and stdout."""

    def __init__(self, label: str, procs: list[subprocess.Popen]) -> None:
        self.label, self.procs = label, procs
        try:
            self.ready = self._answers()        # each worker's first line: its pid, what it set up
            self.pids = [answer["pid"] for answer in self.ready]
        except BaseException:
            self.close()
            raise

    def _answers(self) -> list[dict]:
        """One JSON line from every rank (``read_answers``)."""
        return read_answers(self.procs, ANSWER_TIMEOUT, self.label)

    def run(self, count: int) -> list[dict]:
        """``count`` iterations on every worker; their answers by rank."""
        for proc in self.procs:
            proc.stdin.write(f"run {count}\n".encode())
            proc.stdin.flush()
        return self._answers()

    def close(self, timeout: float = 30.0) -> None:
        """Ask the workers to leave their job, then stop whatever is still running."""
        stop_workers(self.procs, timeout)


def worker_argv(system: str, rank: int, world: int, model: str, shapes: str | None, extra: list[str]) -> list[str]:
    """The command line of one ``pushpull_workers`` process."""
    return [sys.executable, "-m", "dlrt_bench.pushpull_workers", system, "--model", model, "--rank", str(rank),
            "--world", str(world), *(["--shapes", shapes] if shapes else []), *extra]


# --- one configuration --------------------------------------------------------------------------
class Measurement:
    """Iteration times, CPU seconds and link bytes of one system, block by block."""

    def __init__(self) -> None:
        self.iters: list[float] = []
        self.reduce_only: list[float] = []
        self.cpu = 0.0
        self.traffic: dict[str, int] = {}

    def add(self, answers: list[dict], cpu: float, traffic: dict | None) -> None:
        count = len(answers[0]["times"])
        self.iters += [max(a["times"][i] for a in answers) for i in range(count)]
        if "reduce_only" in answers[0]:
            self.reduce_only += [max(a["reduce_only"][i] for a in answers) for i in range(count)]
        self.cpu += cpu
        for name, nbytes in (traffic or {}).items():
            self.traffic[name] = self.traffic.get(name, 0) + nbytes

    def per_iteration(self) -> dict:
        """Medians and means per iteration (link bytes: bare all-reduces count as iterations)."""
        n = max(1, len(self.iters))
        moved = max(1, len(self.iters) + len(self.reduce_only))
        return {"median_s": statistics.median(self.iters) if self.iters else None,
                "cpu_s": self.cpu / n,
                "traffic": {name: nbytes // moved for name, nbytes in self.traffic.items()} or None}


def _delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None or before is None:
        return None
    return {name: after[name] - before[name] for name in after}


def fits_together(model_bytes: int, world: int) -> bool:
    """Whether AutoPS (gradients, results, two kept copies per worker, the aggregators' buffers)
    and gloo (gradients, buckets, receive buffers) fit in free memory at the same time."""
    need = model_bytes * (world * 7 + 3)
    return need < MEMORY_SHARE * psutil.virtual_memory().available


def run_config(site: Any, args: Any, model: str, world: int, aggregators: int, transport: str,
               mode: str, model_bytes: int, tensors: int) -> dict:
    """Measure one configuration on an up ``site``."""
    systems = ["gloo", "autops"] if args.compare == "gloo" else ["autops"]
    interleaved = len(systems) > 1 and fits_together(model_bytes, world)
    if interleaved:
        schedule = [s for r in range(args.rounds) for s in (systems if r % 2 == 0 else systems[::-1])]
    else:
        schedule = [s for s in systems for _ in range(args.rounds)]
    job = f"bench-{uuid.uuid4().hex[:6]}"
    extra = {"autops": ["--master", site.master, "--job", job, "--aggregators", str(aggregators),
                        "--transport", transport, "--mode", mode, "--optimizer", args.optimizer,
                        "--device", args.device],
             "gloo": ["--init", site.gloo_init(), "--device", args.device]}
    job_env = {"autops": {SECRET_ENV: new_job_secret()}, "gloo": {}}      # as a launcher gives every rank
    services = site.service_pids()
    idle_rss = sum(_peak_rss(pid) for pid in services)
    idle_owned = sum(owned_rss(pid) for pid in services)
    per_block = max(1, math.ceil(args.iters / args.rounds))
    groups: dict[str, WorkerGroup] = {}
    measured = {s: Measurement() for s in systems}
    partition = None
    try:
        with RssSampler(services) as sampler:
            for i, system in enumerate(schedule):
                if system not in groups:
                    procs = [site.start_worker(r, worker_argv(system, r, world, model, args.shapes, extra[system]),
                                               job_env[system]) for r in range(world)]
                    groups[system] = WorkerGroup("AutoPS" if system == "autops" else "gloo", procs)
                    partition = groups[system].ready[0].get("partition_bytes") or partition
                    if args.warmup:
                        groups[system].run(args.warmup)
                group = groups[system]
                pids = services if system == "autops" else []
                cpu0, traffic0 = cpu_seconds(pids), site.traffic()
                answers = group.run(per_block)
                cpu = cpu_seconds(pids) - cpu0 + sum(a["cpu"] for a in answers)
                measured[system].add(answers, cpu, _delta(site.traffic(), traffic0))
                if system not in schedule[i + 1:]:
                    groups.pop(system).close()
        peak_rss = sum(_peak_rss(pid) for pid in services)
    finally:
        for group in groups.values():
            group.close()
    return {"model": model, "workers": world, "aggregators": aggregators, "transport": transport, "mode": mode,
            "optimizer": args.optimizer if mode == "server" else None, "device": args.device,
            "site": site.kind, "link": site.link, "delay": site.delay, "congestion": site.congestion,
            "rps": site.rps,
            "partition_bytes": partition,       # set, or pMaster's choice
            "tensors": tensors, "model_bytes": model_bytes,
            **results(measured, world, model_bytes),
            "agg_peak_rss_bytes": peak_rss, "agg_peak_rss_over_model": peak_rss / model_bytes,
            "agg_idle_rss_bytes": idle_rss, "agg_peak_owned_bytes": sampler.peak,
            "agg_owned_over_model": (sampler.peak - idle_owned) / model_bytes,
            "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds, "interleaved": interleaved}


def results(measured: dict[str, Measurement], world: int, model_bytes: int) -> dict:
    """The JSON fields of both systems' measurements (gloo's ``None`` without it)."""
    autops = measured["autops"].per_iteration()
    gloo_measured = measured.get("gloo")
    gloo = gloo_measured.per_iteration() if gloo_measured else {}
    row = {"autops_s": autops["median_s"], "gloo_s": gloo.get("median_s"),
           "ratio": autops["median_s"] / gloo["median_s"] if gloo else None,
           "gloo_allreduce_only_s": (statistics.median(gloo_measured.reduce_only)
                                     if gloo_measured and gloo_measured.reduce_only else None),
           "autops_cpu_s": autops["cpu_s"], "gloo_cpu_s": gloo.get("cpu_s"),
           "autops_iters_s": measured["autops"].iters, "gloo_iters_s": gloo_measured.iters if gloo_measured else None}
    if autops["traffic"] is not None:
        row["autops_link_bytes"] = autops["traffic"]
        row["gloo_link_bytes"] = gloo.get("traffic")
        # every worker's push (its model) left its host over its shaped link: ~1.0 when it did
        row["autops_workers_sent_over_model"] = autops["traffic"]["workers_sent"] / (world * model_bytes)
    return row


def summary(row: dict) -> str:
    ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
    gloo_ms = f"{row['gloo_s'] * 1e3:8.1f}" if row["gloo_s"] else "       -"
    where = f"{row['site']} {row['link'] or ''}{' curve' if row.get('curve') else ''}".strip()
    if row.get("device") == "cuda":
        where += " cuda"
    if row.get("tcp") == "zeromq" and not row.get("curve"):
        where += " zeromq"
    text = (f"{row['model']:>9} W={row['workers']} A={row['aggregators']} {row['transport']:<4} {row['mode']:<6} "
            f"[{where}] autops {row['autops_s'] * 1e3:8.1f} ms  gloo {gloo_ms} ms  ratio {ratio}  "
            f"cpu/iter {row['autops_cpu_s'] * 1e3:.0f}"
            + (f" vs {row['gloo_cpu_s'] * 1e3:.0f} ms" if row["gloo_cpu_s"] is not None else " ms"))
    if "stream_gain" in row:
        text += f"  ZeroMQ tcp takes {row['stream_gain']:.2f}x the stream's time, {row['stream_cpu_gain']:.2f}x CPU"
    if "curve_cost" in row:
        text += f"  CURVE costs {row['curve_cost']:.2f}x time, {row['curve_cpu_cost']:.2f}x CPU"
    if "autops_workers_sent_over_model" in row:
        text += f"  workers sent {row['autops_workers_sent_over_model']:.2f}x model over their links"
    else:
        text += f"  aggregator memory {row['agg_owned_over_model']:.2f}x model"
    return text


def aggregator_count(text: str) -> int | str:
    """``--aggregators``: a count, or ``same`` (as many as workers)."""
    if text == "same":
        return text
    return cli.positive(int)(text)


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("autops bench pushpull", __doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", nargs="+", default=["flat64m", "resnet50", "bert-base", "vgg19"])
    parser.add_argument("--transport", nargs="+", default=None, choices=["auto", "ipc", "tcp", "shm", "rdma", "cma"],
                        help="default: ipc tcp on this machine, auto (which picks tcp) on emulated hosts")
    parser.add_argument("--mode", nargs="+", default=["sum"], choices=["sum", "server"])
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"],
                        help="server-side optimizer in server mode")
    parser.add_argument("--aggregators", type=aggregator_count, default=2, metavar="N|same",
                        help="aggregators of the pool (same: as many as workers)")
    parser.add_argument("--compare", choices=["gloo", "none"], default="gloo")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the workers' gradients live (cuda: staged through pinned host buffers "
                             "as autops.torch does; gloo all-reduces the CUDA tensors)")
    parser.add_argument("--iters", type=int, default=12, help="measured iterations of each system")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=cli.positive(int), default=3,
                        help="blocks each system's iterations are split into, alternating with the other's")
    parser.add_argument("--emulate-hosts", action="store_true",
                        help="each aggregator and each worker on an emulated host of its own (root; "
                             "network namespaces with shaped links, see dlrt_bench.testbed)")
    parser.add_argument("--link", nargs="+", default=["1gbit"],
                        help="emulated hosts: link rates (e.g. 1gbit 10gbit; none: unshaped)")
    parser.add_argument("--delay", default=None, help="emulated hosts: one-way delay between hosts, e.g. 50us")
    parser.add_argument("--prefix", default="apsb", help="emulated hosts: name prefix of the testbed")
    parser.add_argument("--partition-bytes", type=cli.positive(int), default=None, metavar="N",
                        help=f"AutoPS partition size (sets ${PARTITION_ENV} for the workers; default: "
                             f"${PARTITION_ENV}, else pMaster's choice: 1 to {DEFAULT_PARTITION_BYTES >> 20} MiB, "
                             "at least 8 partitions per aggregator)")
    parser.add_argument("--congestion", default=DEFAULT_CONGESTION, metavar="CC",
                        help="emulated hosts: their TCP congestion control (cubic, bbr, reno)")
    add_rps_option(parser, "emulated hosts: ")
    parser.add_argument("--shapes", default=None,
                        help="tensor shapes JSON (default: $AUTOPS_TENSOR_SHAPES, else shared/data/models)")
    parser.add_argument("--curve", nargs="+", default=["off"], choices=["off", "on"],
                        help="CURVE on the ZeroMQ tcp channels (a fresh cluster key directory per "
                             "configuration); 'off on' measures both, one after the other, and reports "
                             "curve_cost = AutoPS time with / without")
    parser.add_argument("--tcp", nargs="+", default=["stream"], choices=["stream", "zeromq"],
                        help="plaintext tcp over the aggregators' stream endpoints (stream.py) or over "
                             "ZeroMQ; 'stream zeromq' measures both and reports stream_gain = ZeroMQ's time "
                             "over the stream's (CURVE always runs over ZeroMQ)")
    cli.add_log_level(parser, "WARNING")
    cli.add_json(parser, "write JSON lines, one per configuration, to FILE ('-' for stdout; the "
                         "progress lines then go to stderr)")
    args = parser.parse_args(argv)
    cli.setup_logging(args.log_level)
    exit_on_sigterm()                 # stopped by SIGTERM: the sites still stop their processes
    if args.partition_bytes is not None:
        os.environ[PARTITION_ENV] = str(args.partition_bytes)     # the workers inherit it
    transports = args.transport = args.transport or (["auto"] if args.emulate_hosts else ["ipc", "tcp"])
    if args.emulate_hosts:
        if any(t in ("ipc", "shm") for t in transports):
            parser.error("--emulate-hosts: ipc and shm cannot reach another host; use auto or tcp")
        reason = emulation_unavailable()
        if reason:
            raise RuntimeError(f"--emulate-hosts: emulated hosts unavailable here: {reason}")
    if "rdma" in transports:
        from autops.transport.rdma_verbs import require_device
        require_device()          # no RDMA device: one line and exit 1, before any process starts
    if "cma" in transports:
        from autops.transport.cma import require_cma
        require_cma()
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    out = cli.text_out(args.json)
    try:
        shapes = {model: model_tensors(model, args.shapes) for model in args.model}
    except ValueError as exc:
        parser.error(str(exc))

    saved_framing = os.environ.get(TCP_STREAM_ENV)
    try:
        rows = measure_all(args, shapes, out)
    finally:
        if saved_framing is None:
            os.environ.pop(TCP_STREAM_ENV, None)
        else:
            os.environ[TCP_STREAM_ENV] = saved_framing
    if args.json == "-":
        cli.write_json(args.json, rows, lines=True)
    elif args.json:
        print(f"wrote {len(rows)} configurations to {args.json}")
    return 0


def measure_all(args: Any, shapes: dict, out: Any) -> list[dict]:
    """Every configuration the arguments ask for, each printed (and written) as it ends."""
    rows = []
    links = [None if link == "none" else link for link in args.link] if args.emulate_hosts else [None]
    for model in args.model:
        model_bytes = sum(math.prod(s) * 4 for _, s, _ in shapes[model])
        for world in args.workers:
            aggregators = world if args.aggregators == "same" else args.aggregators
            for link in links:
                for transport in args.transport:
                    for mode in args.mode:
                        plain = streamed = None
                        for framing, curve in [(f, c) for f in args.tcp for c in args.curve
                                               if not (c == "on" and f == "stream" and "zeromq" in args.tcp)]:
                            os.environ[TCP_STREAM_ENV] = "1" if framing == "stream" else "0"   # before the site
                            with temporary_cluster(curve=curve == "on"):     # before the site: its env
                                if args.emulate_hosts:
                                    site = EmulatedSite(world, aggregators, link, args.delay, args.prefix,
                                                        args.log_level, args.congestion, args.rps)
                                else:
                                    # with rdma (cma), the aggregators offer it too
                                    site = LocalSite(aggregators, args.log_level,
                                                     ["--transport", transport] if transport in ("rdma", "cma")
                                                     else None)
                                with site:
                                    row = run_config(site, args, model, world, aggregators, transport, mode,
                                                     model_bytes, len(shapes[model]))
                            row["curve"] = curve == "on"
                            row["tcp"] = "zeromq" if curve == "on" else framing
                            if curve == "off" and framing == "stream":
                                streamed = row
                            elif curve == "off" and streamed is not None:
                                row["stream_gain"] = row["autops_s"] / streamed["autops_s"]
                                row["stream_cpu_gain"] = row["autops_cpu_s"] / streamed["autops_cpu_s"]
                            if curve == "off":
                                plain = plain or row
                            elif plain is not None:
                                row["curve_cost"] = row["autops_s"] / plain["autops_s"]
                                row["curve_cpu_cost"] = row["autops_cpu_s"] / plain["autops_cpu_s"]
                            rows.append(row)
                            print(summary(row), file=out, flush=True)
                        if args.json and args.json != "-":
                            cli.write_json(args.json, rows, lines=True)   # kept if a later one fails
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
