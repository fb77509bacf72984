"""What ``autops bench packing`` and ``autops bench migrate`` share: emulated training
workers, per-process CPU and page-fault counters, and the benchmarks' common options.

Worker compute is emulated: each iteration a worker sleeps (compute), then push_pulls every
tensor of the model (last layer first), waits for all handles, and records the times. The
sleep is calibrated in the dedicated run (target minus the median communication time of
iterations 3..``--calib-iters``) so that compute + communication matches the model's iteration
time; the shared run reuses each worker's calibrated sleep, so any extra communication time
there shows as a slowdown. ``ITERATION_S`` holds the targets, per iteration of a worker with
4 GPUs. They are plausible values chosen for this benchmark, not measurements; what matters
for packing is their order and ratio (a job's aggregation CPU per second of training is
``e / D``, and the thesis notes AlexNet's short iteration as the reason it packs worst):

=========  ========  ==============================================================
model      target    rationale
=========  ========  ==============================================================
vgg19      1.0 s     ~20 GFLOP/image forward, the heaviest image model here
bert-base  0.8 s     ~22 GFLOP per 128-token sequence forward, smaller batches
resnet50   0.6 s     ~4 GFLOP/image forward
alexnet    0.3 s     ~0.7 GFLOP/image: the shortest iteration (thesis §4.5.2.3)
=========  ========  ==============================================================

``--time-scale F`` multiplies all of them. Tensor sizes are scaled by ``--scale`` (default
0.1: every tensor keeps 10% of its elements, at least 1, as one flat tensor): 8 workers of
vgg19 at full size would need ~10 GB of RAM on this 2-core machine and make aggregation
CPU-bound.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import time
from typing import Any, Callable, Sequence, TextIO

import numpy as np

from autops.wire.jobauth import new_job_secret
from autops.models import model_tensors
from dlrt import cli
from dlrt.procs import join_or_kill

from .autops_pushpull import seed_parameters
from .sampler import read_text

ITERATION_S: dict[str, float] = {"vgg19": 1.0, "bert-base": 0.8, "resnet50": 0.6, "alexnet": 0.3,
                                 "bert-large": 1.6, "flat64m": 0.5}
Tensor = tuple[str, tuple[int, ...], str]
BIG = 1 << 30


def scaled_tensors(model: str, scale: float, shapes: str | None = None) -> list[Tensor]:
    """The model's tensors; with ``scale != 1`` each becomes a flat tensor of ``scale`` times its
    elements (at least 1)."""
    tensors = model_tensors(model, shapes)
    if scale == 1.0:
        return tensors
    return [(n, (max(1, int(round(math.prod(s) * scale))),), d) for n, s, d in tensors]


def tensor_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in tensors)


# --- worker process (both benchmarks) ------------------------------------------------------
def _worker(master: str, job: str, tag: int, rank: int, world: int, tensors: list[Tensor], mode: str,
            optimizer: str, compute_s: float, target_s: float | None, calib_iters: int,
            progress: Any, stop_at: Any, gate: Any, results: Any, timeout: float, transport: str,
            secret: str, place: tuple[str, str] | None = None) -> None:
    """One training worker: sleep (compute), push_pull all tensors, wait; until ``stop_at``.

    ``progress`` is -1 while starting, 0 once imports and buffers are ready (it then waits for
    ``gate`` before it registers), then the last iteration completed. With ``target_s`` set,
    the sleep is recalibrated after ``calib_iters`` iterations to ``target_s`` minus the median
    communication time of iterations 3..calib_iters.
    Puts ``("ok", tag, rank, {"records": [(it, begin, comm_start, comm_end)], "first_replies": [(it, when
    its first push_pull completed)], "compute_s", "redirects", "warmed"})``.
    """
    agent = None
    try:
        if place is not None:             # an emulated host's (network namespace, host id)
            from .testbed import enter_netns
            enter_netns(place[0])
            os.environ["DLRT_HOST_ID"] = place[1]
        from autops.worker.agent import Agent
        opts: dict = {"mode": mode, "average": True}
        if mode == "server":
            opts.update(optimizer=optimizer, hp={"lr": 1e-3})
        grads = {n: np.full(s, 1e-3 * (rank + 1), dtype=d) for n, s, d in tensors}
        outs = {n: np.zeros(s, dtype=d) for n, s, d in tensors}
        progress.value = 0
        while not gate.wait(0.5):
            if stop_at.value <= 0:
                return
        agent = Agent(master, job, rank, world, mode=mode, num_aggregators=2,
                      optimizer=optimizer if mode == "server" else None,
                      hp={"lr": 1e-3} if mode == "server" else None, timeout=timeout, transport=transport,
                      secret=secret)
        agent.declare([(n, s, d, opts) for n, s, d in tensors])
        if mode == "server":
            seed_parameters(agent, rank, tensors, outs)
        order = list(reversed(tensors))
        records: list[tuple[int, float, float, float]] = []
        first_replies: list[tuple[int, float]] = []      # iteration, when its first operation completed
        it = 0
        while it + 1 <= stop_at.value:
            it += 1
            begin = time.monotonic()
            if compute_s > 0:
                time.sleep(compute_s)
            start = time.monotonic()
            handles = [agent.push_pull(n, grads[n], outs[n], it) for n, _, _ in order]
            agent.flush()
            for h in handles:
                h.wait()
            end = time.monotonic()
            records.append((it, begin, start, end))
            first_replies.append((it, min((h.done_at for h in handles if h.done_at is not None), default=end)))
            progress.value = it
            if target_s is not None and it == calib_iters:
                comm = [r[3] - r[2] for r in records[2:]] or [r[3] - r[2] for r in records]
                compute_s = max(0.0, target_s - statistics.median(comm))
        results.put(("ok", tag, rank, {"records": records, "first_replies": first_replies,
                                         "compute_s": compute_s, "redirects": agent.redirects,
                                         "warmed": agent.warmed}))
    except BaseException as exc:  # report, never hang the parent
        results.put(("error", tag, rank, f"{exc.__class__.__name__}: {exc}"))
    finally:
        if agent is not None:
            try:
                agent.close()
            except Exception:
                pass


class Workers:
    """The worker processes of several jobs; always reaped (``close``)."""

    def __init__(self, master: str) -> None:
        self.master = master
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.procs: list = []
        self.progress: dict[tuple[int, int], Any] = {}
        self.stop: dict[int, Any] = {}
        self.gates: dict[int, Any] = {}
        self.jobs: dict[int, str] = {}
        self.world: dict[int, int] = {}
        self.got: dict[tuple[int, int], dict] = {}

    def start_job(self, tag: int, job: str, tensors: list[Tensor], world: int = 2, mode: str = "sum",
                  optimizer: str = "adam", compute_s: Sequence[float] | float = 0.0,
                  target_s: float | None = None, calib_iters: int = 4, timeout: float = 30.0,
                  go: bool = True, transport: str = "auto", hosts: Sequence[Any] | None = None) -> None:
        """Spawn the job's workers; they register when ``go`` (or ``open(tag)``). ``hosts``:
        rank ``r`` runs as emulated host ``hosts[r]`` (``dlrt_bench.testbed.Host``)."""
        self.jobs[tag], self.world[tag] = job, world
        secret = new_job_secret()          # the launcher's: the same for every rank of the job
        self.stop[tag] = self.ctx.Value("q", BIG)
        self.gates[tag] = self.ctx.Event()
        if go:
            self.gates[tag].set()
        for rank in range(world):
            self.progress[(tag, rank)] = self.ctx.Value("q", -1)
            c = compute_s[rank] if isinstance(compute_s, (list, tuple)) else float(compute_s)
            p = self.ctx.Process(target=_worker, name=f"{job}-r{rank}", daemon=True,
                                 args=(self.master, job, tag, rank, world, tensors, mode, optimizer, c, target_s,
                                       calib_iters, self.progress[(tag, rank)], self.stop[tag], self.gates[tag],
                                       self.results, timeout, transport, secret,
                                       (hosts[rank].netns, hosts[rank].host_id) if hosts else None))
            p.start()
            self.procs.append(p)

    def open(self, tag: int) -> None:
        self.gates[tag].set()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every spawned worker has its buffers and waits at its gate (or runs)."""
        deadline = time.monotonic() + timeout
        while min(v.value for v in self.progress.values()) < 0:
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not start within {timeout:.0f}s")
            time.sleep(0.1)

    def iteration(self, tag: int) -> int:
        """Iterations completed by the slowest rank of job ``tag``."""
        return min(self.progress[(tag, r)].value for r in range(self.world[tag]))

    def check(self) -> None:
        """Raise if a worker reported an error or died."""
        while True:
            try:
                item = self.results.get_nowait()
            except queue_mod.Empty:
                break
            self._take(item)
        for p in self.procs:
            if p.exitcode not in (None, 0):
                raise RuntimeError(f"worker {p.name} exited with {p.exitcode}")

    def _take(self, item: tuple) -> None:
        status, tag, rank, payload = item
        if status != "ok":
            raise RuntimeError(f"worker {rank} of job {self.jobs.get(tag)} failed: {payload}")
        self.got[(tag, rank)] = payload

    def finish(self, timeout: float = 120.0) -> dict[tuple[int, int], dict]:
        """Stop every job 2 iterations after its most advanced rank; gather all results."""
        for tag in self.stop:
            ahead = max(self.progress[(tag, r)].value for r in range(self.world[tag]))
            self.stop[tag].value = ahead + 2
        deadline = time.monotonic() + timeout
        want = {(t, r) for t in self.jobs for r in range(self.world[t])}
        while not want <= set(self.got):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers {sorted(want - set(self.got))} did not finish")
            try:
                self._take(self.results.get(timeout=min(left, 1.0)))
            except queue_mod.Empty:
                for p in self.procs:
                    if p.exitcode not in (None, 0):
                        raise RuntimeError(f"worker {p.name} exited with {p.exitcode}") from None
        return self.got

    def close(self) -> None:
        for v in self.stop.values():
            v.value = 0
        join_or_kill(self.procs, timeout=10)


# --- measurement helpers -------------------------------------------------------------------
def stat_counters(text: str) -> tuple[int, int]:
    """(CPU clock ticks user+system, minor page faults) from a ``/proc/PID/stat`` or
    ``/proc/PID/task/TID/stat`` text (the fields after the name, which may hold spaces)."""
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]), int(fields[7])


def proc_counters(pids: dict[str, int], read: Callable[[str], str] = read_text) -> dict[str, tuple[float, int]]:
    """name -> (CPU seconds user+system, minor page faults) from /proc/PID/stat (``read``:
    how a file's text is read, a sampler's ``ProcFiles.read``)."""
    tick = 100.0
    try:
        tick = float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        pass
    out = {}
    for name, pid in pids.items():
        try:
            ticks, faults = stat_counters(read(f"/proc/{pid}/stat"))
            out[name] = (ticks / tick, faults)
        except (OSError, IndexError, ValueError):
            pass
    return out


def counter_delta(a: dict, b: dict, per: float = 1.0) -> dict[str, list]:
    return {k: [round((b[k][0] - a[k][0]) / per, 3), int((b[k][1] - a[k][1]) / per)] for k in a if k in b}


def all_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds) of every process on the machine."""
    import psutil
    out = {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        try:
            t = proc.info["cpu_times"]
            out[proc.pid] = (" ".join(proc.info["cmdline"] or [])[:120], t.user + t.system)
        except (psutil.Error, TypeError, AttributeError):
            pass
    return out


def background_cpu(before: dict[int, tuple[str, float]], wall: float) -> dict[str, float]:
    """Other processes' CPU use during a measurement, in cores, when above 5% of one core (ours
    are gone by then; processes that ended during the measurement are missed)."""
    after = all_cpu()
    out = {}
    for pid, (cmd, cpu) in after.items():
        if pid != os.getpid() and wall > 0:
            # ours have exited by now; a process that is new started during the measurement
            share = (cpu - (before[pid][1] if pid in before else 0.0)) / wall
            if share > 0.05:
                out[f"{pid} {cmd}"] = round(share, 3)
    return out


def write_rows(rows: list[dict], path: str | None, append: bool) -> None:
    """JSON lines to ``--json`` FILE (``-``: stdout), replacing it unless ``append``."""
    if not path:
        return
    cli.write_json(path, rows, lines=True, append=append)
    if path != "-":
        print(f"wrote {len(rows)} configuration(s) to {path}", flush=True)


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options both benchmarks take: transport, logging, shapes, JSON output."""
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "ipc", "tcp"],
                   help="agents' transport (auto: shared memory on this host)")
    cli.add_log_level(p, "WARNING")
    p.add_argument("--shapes", default=None,
                   help="tensor shapes JSON (default: $AUTOPS_TENSOR_SHAPES, else shared/data/models)")
    cli.add_json(p, "write JSON lines, one per configuration, to FILE ('-' for stdout; the progress "
                    "lines then go to stderr)")
    p.add_argument("--append", action="store_true", help="append to --json FILE instead of replacing it")


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, set up logging and check that every ``--model`` has shapes (a usage error if not)."""
    args = p.parse_args(argv)
    cli.setup_logging(args.log_level)
    try:
        for model in args.model:
            model_tensors(model, args.shapes)
    except ValueError as exc:
        p.error(str(exc))
    return args


def warn_background(row: dict, out: TextIO) -> None:
    busy = {k: v for k, v in row["background_cpu_cores"].items() if v > 0.3}
    if busy:
        print(f"      NOTE: other processes used CPU during this measurement (cores): {busy}", file=out,
              flush=True)


def sleep_checking(workers: Workers, seconds: float) -> None:
    end = time.monotonic() + seconds
    while True:
        workers.check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.5, left))
