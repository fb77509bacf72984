"""``autops bench packing`` and ``autops bench migrate``: AutoPS elasticity measured on this machine.

**packing** (thesis §4.5.2.3, Fig. 4.9/4.10): ``J`` concurrent "2s-2w" jobs (2 workers each,
``num_aggregators=2``) of one model run twice in the same invocation:

(a) *dedicated*: a ``--static`` pool with ``2J`` standby aggregators; every job keeps the 2
    aggregators it registered on (the ps-lite baseline, ``2J`` parameter servers);
(b) *shared*: an elastic pool with ``2J`` standby aggregators (so admission control lets every
    job in); jobs start ``--stagger`` seconds apart, each is profiled on 2 temporary
    aggregators, then pMaster packs its keys (Pseudocode 3), live-migrates them and releases the
    emptied aggregators.

Once every job is ``packed``/``dedicated`` with no migration active (and after a settle time),
a steady window (measured again, ``--window-restarts`` times at most, if a migration such as a
revert ran in it) of ``--measure-iters`` iterations (at least ``--min-window`` seconds) is
measured: aggregators in use (alive, state != idle; sampled every 0.5 s, max and median),
aggregator CPU seconds (psutil user+system of every aggregator process of the pool, pids from
``status``) per job-iteration, and each job's speed (iterations/s between its first and last
iteration end inside the window; slower rank) relative to the same job index in the dedicated
run, next to AutoPS's own ``speed_vs_standalone``.

``max_slowdown`` is ``1 - min_j(shared it/s / dedicated it/s)`` (0.07: the worst job ran 7%
slower than dedicated; negative: every job ran faster); with ``--rounds R`` the dedicated and
shared runs alternate R times and each job's ratio is its median over the rounds. Jobs let go
``--stagger`` seconds apart in both runs (all worker processes are spawned and have their
buffers before the first job registers, so process start-up does not disturb profiling).

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
CPU-bound. ``--json FILE`` writes one JSON object per (model, jobs).

**migrate** (thesis §4.5.2.2, Table 4.3): one job (2 workers, ``num_aggregators=2``, ``sum``
mode or ``server`` mode with adam) on a ``--static`` pool of 4 aggregators trains with the
model's real tensors (``--scale 1.0``) and sleep-emulated compute; after a warm-up the admin
``MIGRATE`` moves every key of the job to the two aggregators not serving it and the
benchmark waits until no migration is active and every key is there; ``--repeats`` times,
back and forth. A worker's pause in an iteration is its communication time (push_pull start
to all handles done) minus the median communication time of iterations without a migration in
flight; ``max_pause_ms`` is the largest over workers and migration iterations (the iterations
overlapping [MIGRATE, done] and the first one after done), ``median_pause_ms`` the median over
repeats of that per-repeat maximum. The migration duration is MIGRATE call to done (status
polled every 20 ms). Each repeat also records, per aggregator and worker process, CPU seconds
and minor page faults during the migration and per iteration before and after it.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import pathlib
import queue as queue_mod
import statistics
import sys
import time
import uuid
from typing import Any, Sequence

import numpy as np

from .benchmark import model_tensors

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


class Admin:
    """One connection to pMaster for status polls and MIGRATE calls."""

    def __init__(self, master: str, timeout: float = 10.0) -> None:
        from .agent import MasterClient
        from .transport.zmq import make_context
        self.ctx = make_context()
        self.client = MasterClient(self.ctx, master, timeout)

    def status(self) -> dict:
        from . import wire
        return self.client.call(wire.STATUS)["status"]

    def migrate(self, job: str, to: list[str], keys: list[str] | None = None) -> dict:
        from . import wire
        reply = self.client.call(wire.MIGRATE, job=job, keys=keys, to=to)
        return {"keys": reply.get("keys"), "batches": reply.get("batches")}

    def close(self) -> None:
        self.client.close()
        self.ctx.term()

    def __enter__(self) -> "Admin":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- worker process (both benchmarks) ------------------------------------------------------
def _worker(master: str, job: str, tag: int, rank: int, world: int, tensors: list[Tensor], mode: str,
            optimizer: str, compute_s: float, target_s: float | None, calib_iters: int,
            progress: Any, stop_at: Any, gate: Any, results: Any, timeout: float, transport: str) -> None:
    """One training worker: sleep (compute), push_pull all tensors, wait; until ``stop_at``.

    ``progress`` is -1 while starting, 0 once imports and buffers are ready (it then waits for
    ``gate`` before it registers), then the last iteration completed. With ``target_s`` set,
    the sleep is recalibrated after ``calib_iters`` iterations to ``target_s`` minus the median
    communication time of iterations 3..calib_iters.
    Puts ``("ok", tag, rank, {"records": [(it, begin, comm_start, comm_end)], "compute_s"})``.
    """
    agent = None
    try:
        from .agent import Agent
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
                      hp={"lr": 1e-3} if mode == "server" else None, timeout=timeout, transport=transport)
        agent.declare([(n, s, d, opts) for n, s, d in tensors])
        if mode == "server":
            if rank == 0:
                for h in [agent.init(n, np.zeros(s, d)) for n, s, d in tensors]:
                    h.wait()
            for h in [agent.pull(n, outs[n], 0) for n, _, _ in tensors]:
                h.wait()
        order = list(reversed(tensors))
        records: list[tuple[int, float, float, float]] = []
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
            progress.value = it
            if target_s is not None and it == calib_iters:
                comm = [r[3] - r[2] for r in records[2:]] or [r[3] - r[2] for r in records]
                compute_s = max(0.0, target_s - statistics.median(comm))
        results.put(("ok", tag, rank, {"records": records, "compute_s": compute_s}))
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
                  go: bool = True, transport: str = "auto") -> None:
        """Spawn the job's workers; they register when ``go`` (or ``open(tag)``)."""
        self.jobs[tag], self.world[tag] = job, world
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
                                       self.results, timeout, transport))
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
        for p in self.procs:
            p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


# --- measurement helpers -------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float | None:
    import psutil
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


def _proc_counters(pids: dict[str, int]) -> dict[str, tuple[float, int]]:
    """name -> (CPU seconds user+system, minor page faults) from /proc/PID/stat."""
    tick = 100.0
    try:
        import os
        tick = float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        pass
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[name] = ((int(fields[11]) + int(fields[12])) / tick, int(fields[7]))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _delta(a: dict, b: dict, per: float = 1.0) -> dict[str, list]:
    return {k: [round((b[k][0] - a[k][0]) / per, 3), int((b[k][1] - a[k][1]) / per)] for k in a if k in b}


def _all_cpu() -> dict[int, tuple[str, float]]:
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


def _background(before: dict[int, tuple[str, float]], wall: float) -> dict[str, float]:
    """Other processes' CPU use during a measurement, in cores, when above 5% of one core (ours
    are gone by then; processes that ended during the measurement are missed)."""
    import os
    after = _all_cpu()
    out = {}
    for pid, (cmd, cpu) in after.items():
        if pid != os.getpid() and wall > 0:
            # ours have exited by now; a process that is new started during the measurement
            share = (cpu - (before[pid][1] if pid in before else 0.0)) / wall
            if share > 0.05:
                out[f"{pid} {cmd}"] = round(share, 3)
    return out


def _in_use(status: dict) -> list[str]:
    return sorted(a["id"] for a in status["aggregators"] if a["alive"] and a["state"] != "idle")


def _speed(records: list, t0: float, t1: float) -> dict:
    """Iterations/s of one worker between its first and last iteration end in [t0, t1]."""
    ends = [r[3] for r in records if t0 <= r[3] <= t1]
    if len(ends) < 2:
        return {"iters": len(ends), "rate": None, "median_rate": None}
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return {"iters": len(ends), "rate": (len(ends) - 1) / (ends[-1] - ends[0]),
            "median_rate": 1.0 / statistics.median(gaps),
            "comm_ms_median": 1e3 * statistics.median(r[3] - r[2] for r in records if t0 <= r[3] <= t1)}


def _status_brief(status: dict) -> dict:
    """What the packing timeline keeps of one status."""
    return {"in_use": len(_in_use(status)),
            "jobs": {j["job"]: [j["state"], j["aggregators"]] for j in status["jobs"]},
            "migrations_active": status["migrations"]["active"]}


def _run_mode(mode: str, model: str, njobs: int, tensors: list[Tensor], target_s: float, args: argparse.Namespace,
              compute: dict[int, list[float]] | None) -> dict:
    """One pool, ``njobs`` jobs; returns the steady-window measurement of ``mode``."""
    from .local import LocalPool
    shared = mode == "shared"
    if shared:
        master_args = ["--warmup-iters", str(args.warmup_iters), "--profile-iters", str(args.profile_iters),
                       "--period", str(args.period), "--window", str(args.revert_window)]
    else:
        master_args = ["--static"]
    run_id = uuid.uuid4().hex[:5]
    names = [f"{model}-{mode[:3]}{i}-{run_id}" for i in range(njobs)]
    timeline: list[dict] = []
    t_begin = started = time.monotonic()
    with LocalPool(2 * njobs, log_level=args.log_level, master_args=master_args) as pool, Admin(pool.master) as admin:
        workers = Workers(pool.master)
        try:
            # spawn every worker first (imports and buffers, CPU-heavy on this machine), then let
            # the jobs register --stagger seconds apart (in both modes: similar phases between jobs)
            for i, name in enumerate(names):
                workers.start_job(i, name, tensors, compute_s=compute[i] if compute else target_s,
                                  target_s=None if compute else target_s, calib_iters=args.calib_iters,
                                  timeout=args.agent_timeout, go=False, transport=args.transport)
            workers.wait_ready()
            started = time.monotonic()
            for i in range(njobs):
                if i:
                    _sleep_checking(workers, args.stagger)
                workers.open(i)
            # wait for steady state
            deadline = time.monotonic() + args.steady_timeout
            steady = False
            min_iters = args.calib_iters + 2
            while time.monotonic() < deadline:
                workers.check()
                status = admin.status()
                timeline.append({"t": round(time.monotonic() - started, 2), **_status_brief(status)})
                jobs = [j for j in status["jobs"] if j["job"] in names]
                if (len(jobs) == njobs and all(j["state"] in ("packed", "dedicated") for j in jobs)
                        and status["migrations"]["active"] == 0 and status["migrations"].get("batches_active", 0) == 0
                        and all(workers.iteration(i) >= min_iters for i in range(njobs))):
                    steady = True
                    break
                time.sleep(0.5)
            if not steady:
                print(f"  [{mode}] WARNING: not steady after {args.steady_timeout:.0f}s; measuring anyway. "
                      f"status: {json.dumps(_status_brief(status))}", flush=True)
            steady_after = time.monotonic() - started
            _sleep_checking(workers, args.settle_iters * target_s)
            # the steady window; measured again (up to --window-restarts times) when a migration
            # (a revert, a recycling) ran in it, after that migration is over
            window_s = max(args.min_window, args.measure_iters * target_s)
            discarded: list[dict] = []
            while True:
                status = admin.status()
                agg_pids = {a["id"]: a["pid"] for a in status["aggregators"]}
                mig0 = dict(status["migrations"])
                master_cpu0 = _cpu_seconds(pool.procs[0].pid)
                cpu0 = {a: _cpu_seconds(p) for a, p in agg_pids.items()}
                t0 = time.monotonic()
                samples: list[int] = []
                used: set[str] = set()
                speeds_autops: dict[str, list[float]] = {n: [] for n in names}
                migrating = False
                while time.monotonic() < t0 + window_s:
                    workers.check()
                    status = admin.status()
                    in_use = _in_use(status)
                    samples.append(len(in_use))
                    used.update(in_use)
                    migrating = migrating or status["migrations"]["active"] > 0
                    for j in status["jobs"]:
                        if j["job"] in speeds_autops and j.get("speed_vs_standalone"):
                            speeds_autops[j["job"]].append(j["speed_vs_standalone"])
                    timeline.append({"t": round(time.monotonic() - started, 2), **_status_brief(status)})
                    time.sleep(min(0.5, max(0.0, t0 + window_s - time.monotonic())))
                moved = status["migrations"]["completed"] + status["migrations"]["failed"] \
                    - mig0["completed"] - mig0["failed"]
                if not (migrating or moved) or len(discarded) >= args.window_restarts:
                    break
                discarded.append({"start_s": round(t0 - started, 2), "keys_migrated": moved,
                                  "aggregators_max": max(samples)})
                print(f"  [{mode}] a migration ran in the steady window (t={t0 - started:.0f}s); measuring again",
                      flush=True)
                while admin.status()["migrations"]["active"] > 0:
                    _sleep_checking(workers, 0.5)
                _sleep_checking(workers, args.settle_iters * target_s)
            t1 = time.monotonic()
            cpu1 = {a: _cpu_seconds(p) for a, p in agg_pids.items()}
            master_cpu1 = _cpu_seconds(pool.procs[0].pid)
            final = admin.status()
            results = workers.finish()
        finally:
            workers.close()
    cpu = {a: (cpu1[a] - cpu0[a]) if cpu0[a] is not None and cpu1[a] is not None else None for a in agg_pids}
    per_job = []
    job_iters = 0.0
    for i, name in enumerate(names):
        ranks = [_speed(results[(i, r)]["records"], t0, t1) for r in range(2)]
        rate = min((s["rate"] for s in ranks if s["rate"]), default=None)
        median_rate = min((s["median_rate"] for s in ranks if s["median_rate"]), default=None)
        job_iters += (rate or 0.0) * (t1 - t0)
        js = next((j for j in final["jobs"] if j["job"] == name), {})
        per_job.append({
            "job": name, "speed_it_s": rate, "speed_median_it_s": median_rate,
            "iteration_s": 1 / rate if rate else None,
            "comm_ms_median": max((s.get("comm_ms_median") or 0) for s in ranks),
            "compute_s": [results[(i, r)]["compute_s"] for r in range(2)],
            "state": js.get("state"), "aggregators": js.get("aggregators"),
            "keys_per_aggregator": js.get("keys_per_aggregator"), "reverts": js.get("reverts"),
            "autops_speed_vs_standalone": statistics.median(speeds_autops[name]) if speeds_autops[name] else None,
            "autops_standalone_iteration_s": js.get("standalone_iteration_time_s"),
            "autops_iteration_s": js.get("iteration_time_s"), "autops_cpu_demand": js.get("cpu_demand"),
            # rank 0: [iteration, end (s since the first job was let go), iteration s, communication s]
            "trace": [[it, round(e - started, 3), round(e - b, 4), round(e - c, 4)]
                      for it, b, c, e in results[(i, 0)]["records"]]})
    known = [c for c in cpu.values() if c is not None]
    cpu_total = sum(known)
    cpu_in_use = sum(c for a, c in cpu.items() if c is not None and a in used)
    aggs = [{k: a.get(k) for k in ("id", "state", "tasks", "jobs", "cpu_percent", "busy_fraction", "cycle_s",
                                   "late", "postponed", "migrated_in", "migrated_out")}
            | {"cpu_s_window": round(cpu[a["id"]], 3) if cpu.get(a["id"]) is not None else None}
            for a in final["aggregators"]]
    mig1 = final["migrations"]
    return {
        "mode": mode, "steady": steady, "steady_after_s": round(steady_after, 2), "window_s": round(t1 - t0, 3),
        "aggregators_max": max(samples), "aggregators_median": statistics.median(samples),
        "aggregators_used_ids": sorted(used), "aggregator_processes": len(agg_pids),
        "cpu_s_total": round(cpu_total, 3), "cpu_s_in_use": round(cpu_in_use, 3),
        "master_cpu_s": round(master_cpu1 - master_cpu0, 3) if master_cpu0 is not None and master_cpu1 else None,
        "job_iterations": round(job_iters, 2), "window_start_s": round(t0 - started, 2),
        "cpu_s_per_iter": cpu_total / job_iters if job_iters else None,
        "cpu_s_per_iter_in_use": cpu_in_use / job_iters if job_iters else None,
        "discarded_windows": discarded,
        "migrations_in_window": {"completed": mig1["completed"] - mig0["completed"],
                                 "failed": mig1["failed"] - mig0["failed"]},
        "migrations_total": {"completed": mig1["completed"], "failed": mig1["failed"]},
        "jobs": per_job, "aggregators": aggs, "timeline": timeline,
        "wall_s": round(time.monotonic() - t_begin, 1)}


def _sleep_checking(workers: Workers, seconds: float) -> None:
    end = time.monotonic() + seconds
    while True:
        workers.check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.5, left))


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_packing(model: str, njobs: int, args: argparse.Namespace) -> dict:
    """``args.rounds`` x (dedicated run, then shared run); per-job speed ratios are the median
    over rounds, aggregators the largest seen in any round's steady window."""
    tensors = scaled_tensors(model, args.scale, args.shapes)
    target_s = ITERATION_S[model] * args.time_scale
    started = time.monotonic()
    others = _all_cpu()
    runs = []
    for _ in range(args.rounds):
        dedicated = _run_mode("dedicated", model, njobs, tensors, target_s, args, None)
        compute = {i: j["compute_s"] for i, j in enumerate(dedicated["jobs"])}
        shared = _run_mode("shared", model, njobs, tensors, target_s, args, compute)
        runs.append({"dedicated": dedicated, "shared": shared})
    detail = []
    for i in range(njobs):
        per_round = []
        for run in runs:
            d, s = run["dedicated"]["jobs"][i], run["shared"]["jobs"][i]
            per_round.append({
                "dedicated_it_s": d["speed_it_s"], "shared_it_s": s["speed_it_s"],
                "speed_vs_dedicated": s["speed_it_s"] / d["speed_it_s"] if s["speed_it_s"] and d["speed_it_s"] else None,
                "speed_vs_dedicated_median": (s["speed_median_it_s"] / d["speed_median_it_s"]
                                              if s["speed_median_it_s"] and d["speed_median_it_s"] else None),
                "autops_speed_vs_standalone": s["autops_speed_vs_standalone"], "state": s["state"],
                "aggregators": s["aggregators"], "reverts": s["reverts"], "compute_s": s["compute_s"],
                "dedicated_comm_ms": d["comm_ms_median"], "shared_comm_ms": s["comm_ms_median"]})
        last = per_round[-1]
        detail.append({
            "job": runs[-1]["shared"]["jobs"][i]["job"],
            **{k: _med([r[k] for r in per_round]) for k in (
                "dedicated_it_s", "shared_it_s", "speed_vs_dedicated", "speed_vs_dedicated_median",
                "autops_speed_vs_standalone", "dedicated_comm_ms", "shared_comm_ms")},
            "state": last["state"], "aggregators": last["aggregators"], "reverts": last["reverts"],
            "compute_s": last["compute_s"],
            "speed_vs_dedicated_per_round": [r["speed_vs_dedicated"] for r in per_round]})
    rels = [x["speed_vs_dedicated"] for x in detail if x["speed_vs_dedicated"] is not None]
    rels_med = [x["speed_vs_dedicated_median"] for x in detail if x["speed_vs_dedicated_median"] is not None]
    agg_sh = max(run["shared"]["aggregators_max"] for run in runs)
    agg_de = max(run["dedicated"]["aggregators_max"] for run in runs)
    cpu_sh = _med([run["shared"]["cpu_s_per_iter"] for run in runs])
    cpu_de = _med([run["dedicated"]["cpu_s_per_iter"] for run in runs])
    round_slowdowns = []
    for run in runs:
        r = [s["speed_it_s"] / d["speed_it_s"] for d, s in zip(run["dedicated"]["jobs"], run["shared"]["jobs"])
             if s["speed_it_s"] and d["speed_it_s"]]
        round_slowdowns.append(1 - min(r) if r else None)
    row = {
        "benchmark": "packing", "model": model, "jobs": njobs, "workers_per_job": 2, "aggregators_per_job": 2,
        "scale": args.scale, "transport": args.transport, "time_scale": args.time_scale,
        "iteration_target_s": target_s,
        "iteration_targets_s": {m: t * args.time_scale for m, t in ITERATION_S.items()},
        "tensors": len(tensors), "model_bytes": tensor_bytes(model_tensors(model, args.shapes)),
        "scaled_bytes": tensor_bytes(tensors), "rounds": len(runs),
        "aggregators_dedicated": agg_de, "aggregators_shared": agg_sh,
        "aggregators_shared_median": _med([run["shared"]["aggregators_median"] for run in runs]),
        "aggregator_reduction": 1 - agg_sh / agg_de if agg_de else None,
        "cpu_s_per_iter_dedicated": cpu_de, "cpu_s_per_iter_shared": cpu_sh,
        "cpu_s_per_iter_dedicated_in_use": _med([run["dedicated"]["cpu_s_per_iter_in_use"] for run in runs]),
        "cpu_s_per_iter_shared_in_use": _med([run["shared"]["cpu_s_per_iter_in_use"] for run in runs]),
        "cpu_reduction": 1 - cpu_sh / cpu_de if cpu_sh and cpu_de else None,
        "max_slowdown": 1 - min(rels) if rels else None,
        "mean_slowdown": 1 - statistics.mean(rels) if rels else None,
        "max_slowdown_median_based": 1 - min(rels_med) if rels_med else None,
        "max_slowdown_per_round": round_slowdowns,
        "min_autops_speed_vs_standalone": min((x["autops_speed_vs_standalone"] for x in detail
                                               if x["autops_speed_vs_standalone"]), default=None),
        "all_packed": all(run["shared"]["steady"] for run in runs),
        "job_detail": detail, "dedicated": runs[0]["dedicated"], "shared": runs[0]["shared"],
        "more_runs": runs[1:],
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "model", "jobs")},
        "background_cpu_cores": _background(others, time.monotonic() - started),
        "wall_s": round(time.monotonic() - started, 1)}
    row["targets"] = {
        "aggregator_reduction_ge_0.5": row["aggregator_reduction"] is not None and row["aggregator_reduction"] >= 0.5,
        "max_slowdown_le_0.1": row["max_slowdown"] is not None and row["max_slowdown"] <= 0.1}
    return row


def _write_rows(rows: list[dict], path: str | None, append: bool) -> None:
    if not path:
        return
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path == "-":
        sys.stdout.write(text)
        return
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a" if append else "w") as f:
        f.write(text)
    print(f"wrote {len(rows)} configuration(s) to {path}", flush=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _add_common_args(p: argparse.ArgumentParser) -> None:
    """Options both benchmarks take: transport, logging, shapes, JSON output."""
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "ipc", "tcp"],
                   help="agents' transport (auto: shared memory on this host)")
    p.add_argument("--log-level", default="WARNING", help="log level of the pool's processes")
    p.add_argument("--shapes", default=None, help="tensor_shapes.json (default: shared/data/models)")
    p.add_argument("--json", nargs="?", const="-", default=None, help="JSON lines, one per configuration")
    p.add_argument("--append", action="store_true", help="append to --json FILE instead of replacing it")


def packing_main(argv: list[str] | None = None) -> int:
    """``autops bench packing``: dedicated vs shared aggregators for J concurrent 2s-2w jobs."""
    argv = list(argv or [])
    if argv and argv[0] == "packing":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="autops bench packing", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[4], choices=[1, 2, 3, 4, 5, 6])
    p.add_argument("--model", nargs="+", default=["vgg19"], choices=sorted(ITERATION_S))
    p.add_argument("--scale", type=float, default=0.1, help="fraction of every tensor's elements (default 0.1)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies the models' iteration times")
    p.add_argument("--measure-iters", type=int, default=20, help="steady window, in iterations of the model")
    p.add_argument("--min-window", type=float, default=10.0, help="shortest steady window, seconds")
    p.add_argument("--settle-iters", type=float, default=3, help="iterations waited after steady state")
    p.add_argument("--calib-iters", type=int, default=6, help="dedicated run: iterations before calibrating")
    p.add_argument("--stagger", type=float, default=3.0, help="seconds between job starts")
    p.add_argument("--warmup-iters", type=int, default=3, help="pMaster --warmup-iters (shared run)")
    p.add_argument("--profile-iters", type=int, default=6, help="pMaster --profile-iters (shared run)")
    p.add_argument("--period", type=float, default=5.0, help="pMaster --period (shared run)")
    p.add_argument("--revert-window", type=int, default=20, help="pMaster --window (shared run)")
    p.add_argument("--rounds", type=int, default=1,
                   help="dedicated+shared pairs per configuration; per-job speed ratios are their medians")
    p.add_argument("--window-restarts", type=int, default=1,
                   help="measure the steady window again this often when a migration ran in it")
    p.add_argument("--steady-timeout", type=float, default=90.0)
    p.add_argument("--agent-timeout", type=float, default=30.0)
    _add_common_args(p)
    args = p.parse_args(argv)

    rows = []
    for model in args.model:
        for njobs in args.jobs:
            row = run_packing(model, njobs, args)
            rows.append(row)
            print(f"{model:>9} jobs={njobs} scale={args.scale:g} target {row['iteration_target_s']:.2f}s/it: "
                  f"aggregators {row['aggregators_dedicated']} -> {row['aggregators_shared']} "
                  f"({_pct(-row['aggregator_reduction'] if row['aggregator_reduction'] is not None else None)}), "
                  f"aggregator CPU {_ms(row['cpu_s_per_iter_dedicated'])} -> {_ms(row['cpu_s_per_iter_shared'])} "
                  f"ms/job-iteration, worst job {_pct(-row['max_slowdown'] if row['max_slowdown'] is not None else None)}"
                  f" vs dedicated (AutoPS min speed_vs_standalone "
                  f"{row['min_autops_speed_vs_standalone'] or float('nan'):.3f}), "
                  f"{'all packed' if row['all_packed'] else 'NOT STEADY'}, {row['wall_s']:.0f}s", flush=True)
            if row["rounds"] > 1:
                print(f"      worst job per round: "
                      f"{', '.join(_pct(None if x is None else -x) for x in row['max_slowdown_per_round'])} vs dedicated "
                      f"(rows below: medians over rounds)", flush=True)
            for x in row["job_detail"]:
                print(f"      {x['job']}: {x['state']:<9} on {','.join(x['aggregators'] or [])}  "
                      f"{x['dedicated_it_s'] or 0:.3f} -> {x['shared_it_s'] or 0:.3f} it/s "
                      f"({_pct((x['speed_vs_dedicated'] or 1) - 1)}), comm {x['dedicated_comm_ms']:.1f} -> "
                      f"{x['shared_comm_ms']:.1f} ms", flush=True)
            _warn_background(row)
            _write_rows([row], args.json, append=args.append or len(rows) > 1)
    return 0


def _warn_background(row: dict) -> None:
    busy = {k: v for k, v in row["background_cpu_cores"].items() if v > 0.3}
    if busy:
        print(f"      NOTE: other processes used CPU during this measurement (cores): {busy}", flush=True)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


# --- migrate ---------------------------------------------------------------------------------
def run_migrate(model: str, mode: str, args: argparse.Namespace) -> dict:
    from .local import LocalPool
    tensors = scaled_tensors(model, args.scale, args.shapes)
    compute_s = ITERATION_S[model] * args.time_scale if args.compute_s is None else args.compute_s
    job = f"mig-{model}-{mode}-{uuid.uuid4().hex[:5]}"
    started = time.monotonic()
    others = _all_cpu()
    repeats: list[dict] = []
    with LocalPool(4, log_level=args.log_level, master_args=["--static"]) as pool, Admin(pool.master) as admin:
        workers = Workers(pool.master)
        try:
            workers.start_job(0, job, tensors, mode=mode, optimizer=args.optimizer, compute_s=compute_s,
                              timeout=args.agent_timeout, transport=args.transport)
            deadline = time.monotonic() + args.start_timeout
            while workers.iteration(0) < args.warmup:
                workers.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job did not reach iteration {args.warmup} in {args.start_timeout:.0f}s")
                time.sleep(0.05)
            status = admin.status()
            pids = {a["id"]: a["pid"] for a in status["aggregators"]}
            pids.update({p.name.rsplit("-", 1)[1]: p.pid for p in workers.procs})
            mark = (_proc_counters(pids), workers.iteration(0))
            target = mark[1] + args.gap        # a steady stretch before the first migration, measured
            while workers.iteration(0) < target:
                workers.check()
                time.sleep(0.05)
            for rep in range(args.repeats):
                status = admin.status()
                js = next(j for j in status["jobs"] if j["job"] == job)
                current = sorted(js["keys_per_aggregator"])
                live = sorted(a["id"] for a in status["aggregators"] if a["alive"])
                targets = [a for a in live if a not in current][:2]
                failed0 = status["migrations"]["failed"]
                it_before = workers.iteration(0)
                before = _proc_counters(pids)
                t_call = time.monotonic()
                reply = admin.migrate(job, targets)
                t_reply = time.monotonic()
                done, t_done, last = False, None, None
                while time.monotonic() < t_call + args.migrate_timeout:
                    workers.check()
                    last = admin.status()
                    js = next((j for j in last["jobs"] if j["job"] == job), None)
                    if (last["migrations"]["active"] == 0 and last["migrations"].get("batches_active", 0) == 0
                            and js is not None and set(js["keys_per_aggregator"]) <= set(targets)
                            and js.get("migrating_keys", 0) == 0):
                        t_done, done = time.monotonic(), True
                        break
                    time.sleep(args.poll)
                during = _proc_counters(pids)
                failed = (last or status)["migrations"]["failed"] - failed0
                rec = {"repeat": rep + 1, "from": current, "to": targets, "keys": reply["keys"],
                       "batches": reply["batches"], "iteration_at_call": it_before, "t_call": t_call,
                       "t_done": t_done, "done": done, "failed_keys": failed,
                       "call_ms": round(1e3 * (t_reply - t_call), 2),
                       "migration_s": round(t_done - t_call, 4) if t_done else None,
                       "iteration_at_done": workers.iteration(0),
                       # per process [CPU s, minor page faults]: per iteration in the steady stretch
                       # before the first call (later repeats: see the previous proc_after_per_iter),
                       # in total from the call to done, per iteration in the --gap iterations after done
                       "proc_before_per_iter": (_delta(mark[0], before, max(1, it_before - mark[1]))
                                                if it_before > mark[1] else None),
                       "proc_migration": _delta(before, during)}
                repeats.append(rec)
                print(f"  repeat {rep + 1}: {reply['keys']} keys {current} -> {targets} "
                      f"{'done' if done else 'NOT DONE'} in "
                      f"{rec['migration_s'] if done else args.migrate_timeout:.3f}s"
                      f"{f', {failed} keys failed' if failed else ''}", flush=True)
                if not done:
                    print("  status: " + json.dumps({"migrations": (last or status)["migrations"],
                                                     "job": js}), flush=True)
                    break
                it_done = workers.iteration(0)
                target = it_done + args.gap
                while workers.iteration(0) < target:
                    workers.check()
                    time.sleep(0.05)
                mark = (_proc_counters(pids), workers.iteration(0))
                rec["proc_after_per_iter"] = _delta(during, mark[0], max(1, mark[1] - it_done))
            final = admin.status()
            results = workers.finish()
        finally:
            workers.close()
    # pauses
    per_rank = {r: results[(0, r)]["records"] for r in range(2)}
    affected: dict[int, dict[int, set[int]]] = {}     # repeat -> rank -> iterations
    for rec in repeats:
        t_end = rec["t_done"] if rec["t_done"] is not None else float("inf")
        for r, records in per_rank.items():
            its = {it for it, _, s, e in records if e >= rec["t_call"] and s <= t_end}
            after = [it for it, _, s, _ in records if s > t_end]
            if after:
                its.add(min(after))          # the first iteration after done, on the new aggregators
            affected.setdefault(rec["repeat"], {})[r] = its
    excluded = {r: set().union(*(affected[k][r] for k in affected)) if affected else set() for r in per_rank}
    base = [e - s for r, records in per_rank.items() for it, _, s, e in records
            if it > args.skip and it not in excluded[r]]
    baseline = statistics.median(base) if base else float("nan")
    excess_all: list[float] = []
    for rec in repeats:
        ex, totals = [], []
        for r, records in per_rank.items():
            its = affected[rec["repeat"]][r]
            mine = [(e - s) - baseline for it, _, s, e in records if it in its]
            ex += mine
            totals.append(sum(mine))
        rec["excess_ms"] = [round(1e3 * x, 2) for x in ex]
        rec["total_excess_ms"] = round(1e3 * max(totals), 2) if totals else None   # slowest rank, all its iterations
        rec["pause_ms"] = round(1e3 * max(ex), 2) if ex else None
        excess_all += ex
        rec.pop("t_call")
        rec.pop("t_done")
    pauses = [rec["pause_ms"] for rec in repeats if rec["pause_ms"] is not None]
    comm_all = [[round(1e3 * (e - s), 1) for _, _, s, e in records] for records in per_rank.values()]
    iters = [e - b for records in per_rank.values() for it, b, _, e in records if it > args.skip]
    return {
        "benchmark": "migrate", "model": model, "mode": mode, "optimizer": args.optimizer if mode == "server" else None,
        "scale": args.scale, "transport": args.transport, "workers": 2, "aggregators": 4, "compute_s": compute_s,
        "tensors": len(tensors), "model_bytes": tensor_bytes(tensors), "keys_moved": repeats[0]["keys"] if repeats else 0,
        "repeats": len(repeats), "all_completed": all(r["done"] and not r["failed_keys"] for r in repeats),
        "max_pause_ms": max(pauses) if pauses else None,
        "median_pause_ms": statistics.median(pauses) if pauses else None,
        "median_excess_ms": round(1e3 * statistics.median(excess_all), 2) if excess_all else None,
        "pause_ms_per_repeat": pauses,
        "total_excess_ms_per_repeat": [rec["total_excess_ms"] for rec in repeats],
        "first_iterations_comm_ms": [comm[:2] for comm in comm_all],
        "migration_s": [r["migration_s"] for r in repeats],
        "baseline_comm_ms": round(1e3 * baseline, 2),
        "baseline_comm_ms_p90": round(1e3 * float(np.percentile(base, 90)), 2) if base else None,
        "iteration_ms_median": round(1e3 * statistics.median(iters), 1) if iters else None,
        "migrations_failed": final["migrations"]["failed"], "migrations_completed_keys": final["migrations"]["completed"],
        "per_repeat": repeats, "comm_ms": comm_all,
        "target_max_pause_le_20ms": bool(pauses) and max(pauses) <= 20.0,
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "model", "mode")},
        "background_cpu_cores": _background(others, time.monotonic() - started),
        "wall_s": round(time.monotonic() - started, 1)}


def migrate_main(argv: list[str] | None = None) -> int:
    """``autops bench migrate``: pause a training job sees when all its tensors move live."""
    argv = list(argv or [])
    if argv and argv[0] == "migrate":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="autops bench migrate", description="live migration of all of a job's "
                                "tensors: pause seen by the workers and migration duration")
    p.add_argument("--model", nargs="+", default=["vgg19"], choices=sorted(ITERATION_S))
    p.add_argument("--mode", nargs="+", default=["sum"], choices=["sum", "server"])
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    p.add_argument("--scale", type=float, default=1.0, help="fraction of every tensor's elements (default 1.0)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies the models' iteration times")
    p.add_argument("--compute-s", type=float, default=None, help="sleep per iteration (default: the model's)")
    p.add_argument("--repeats", type=int, default=3, help="migrations, back and forth")
    p.add_argument("--warmup", type=int, default=4, help="iterations before the steady stretch (--gap) that precedes the first migration")
    p.add_argument("--gap", type=int, default=5, help="iterations between a migration's end and the next")
    p.add_argument("--skip", type=int, default=2, help="first iterations left out of the baseline")
    p.add_argument("--poll", type=float, default=0.02, help="status poll interval while migrating, seconds")
    p.add_argument("--migrate-timeout", type=float, default=60.0)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--agent-timeout", type=float, default=60.0)
    _add_common_args(p)
    args = p.parse_args(argv)

    rows = []
    for model in args.model:
        for mode in args.mode:
            row = run_migrate(model, mode, args)
            rows.append(row)
            fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            print(f"{model:>9} {mode:<6} {row['keys_moved']} keys ({row['model_bytes'] / 1e6:.0f} MB): pause max "
                  f"{fmt(row['max_pause_ms'])} ms, median {fmt(row['median_pause_ms'])} ms (per repeat "
                  f"{row['pause_ms_per_repeat']}), baseline comm {row['baseline_comm_ms']:.1f} ms, migration "
                  f"{row['migration_s']} s, {'all completed' if row['all_completed'] else 'INCOMPLETE'}, "
                  f"{row['wall_s']:.0f}s", flush=True)
            _warn_background(row)
            _write_rows([row], args.json, append=args.append or len(rows) > 1)
    return 0


if __name__ == "__main__":
    sys.exit(packing_main(sys.argv[1:]))
