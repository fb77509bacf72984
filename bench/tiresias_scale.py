"""How fast the Tiresias simulator and one scheduling decision are (JSON out).

1. The whole ``philly.csv`` (82,247 jobs) simulated with 2D-LAS on 48x8 — as the original
   simulator (GPUs counted, no overheads) and with node placement and overhead models —
   next to FIFO on the same trace in the same run (the cheapest policy: the peer).
   ``philly_48x8_las_s`` is the second row's time: ``tiresias simulate`` with its defaults.
2. One scheduling decision (``allocate``) with N active jobs on 2,048 GPUs (256x8), N = 1k,
   10k, 100k: the cluster full of running jobs, the rest waiting, one job just arrived.
   The peer is the textbook pass: sort every active job by priority, then walk the order.
3. The simulator's time per event as the number of active jobs grows (1k, 10k, 50k): that
   many long jobs submitted at once on 256x8 with the defaults (node placement, overheads,
   the progress guarantee); once every one of them has run past 2D-LAS's threshold (the
   backlog is settled in the second queue), a stream of short jobs arrives; timed over the
   stream's events only (its arrivals, completions, demotions and the preemptions they
   cause), with the starts and stops per event reported next to the time.

    python bench/tiresias_scale.py --json bench/results/tiresias_scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiresias.cluster import ClusterSpec  # noqa: E402
from tiresias.metrics import summarize  # noqa: E402
from tiresias.policies import make_policy  # noqa: E402
from tiresias.policies.base import JobState, allocate  # noqa: E402
from tiresias.sim import SimConfig, simulate  # noqa: E402
from tiresias.trace import load_trace  # noqa: E402
from dlrt.trace import TraceJob  # noqa: E402

PHILLY = ROOT.parent / "shared" / "data" / "traces" / "philly.csv"
SIZES = [1] * 60 + [2] * 12 + [4] * 12 + [8] * 12 + [16] * 3 + [32]


def full_trace(cluster: ClusterSpec, trace: str | pathlib.Path = PHILLY) -> list[dict]:
    jobs = load_trace(trace, max_gpus=cluster.total_gpus).jobs
    rows = []
    for policy, config in (("las", SimConfig("count")),
                           ("las", SimConfig("tiresias", overheads=True, slowdown=True)),
                           ("fifo", SimConfig("count"))):
        target = cluster if config.placement != "count" else cluster.total_gpus
        t0 = time.perf_counter()
        result = simulate(jobs, target, make_policy(policy), config=config)
        wall = time.perf_counter() - t0
        s = summarize(result)
        rows.append({"policy": policy, "placement": config.placement, "overheads": config.overheads,
                     "jobs": s["jobs"], "events": s["events"], "wall_seconds": wall,
                     "avg_jct": s["avg_jct"], "median_jct": s["median_jct"], "preemptions": s["preemptions"]})
        print(f"  {policy:5} {config.placement:9} {s['jobs']} jobs, {s['events']} events: {wall:6.1f} s  "
              f"(avg JCT {s['avg_jct']:.0f} s, median {s['median_jct']:.0f} s)", flush=True)
    return rows


class _Enough(Exception):
    """The timed window of ``per_event`` is over."""


def per_event(n_active: int, stream: int = 3000, seed: int = 0) -> dict:
    """Wall time per simulator event with ``n_active`` long jobs active (module docstring, 3)."""
    rng = random.Random(seed)
    jobs = [TraceJob(i, 0.0, rng.choice(SIZES), rng.expovariate(1 / 1e7) + 1e6) for i in range(n_active)]
    settled = 1.5 * n_active * 3200.0 / 2048      # every long job demoted once (GPU-s / GPUs)
    t = start = 1000.0 + settled
    for i in range(stream):
        t += rng.expovariate(1 / 20.0)
        jobs.append(TraceJob(n_active + i, t, rng.choice(SIZES), rng.expovariate(1 / 3000.0) + 10.0))
    end = t
    mark: dict = {}
    policy = make_policy("las")
    changes = [0]

    class Counting(type(policy)):                 # counts the starts and stops it is told of
        def started(self, job, now):
            changes[0] += 1
            super().started(job, now)

        def stopped(self, job, now):
            changes[0] += 1
            super().stopped(job, now)

    policy.__class__ = Counting

    def progress(done: int, total: int, now: float) -> None:
        if now >= start and "t0" not in mark:
            mark.update(t0=time.perf_counter(), e0=mark.get("events", 0), c0=changes[0],
                        active=len(policy.active))
        mark["events"] = mark.get("events", 0) + 1
        if now > end:
            mark.update(t1=time.perf_counter(), c1=changes[0])
            raise _Enough

    try:
        simulate(jobs, ClusterSpec(256, 8), policy, progress=progress, config=SimConfig("tiresias"))
    except _Enough:
        pass
    events = mark["events"] - 1 - mark["e0"]
    us = (mark["t1"] - mark["t0"]) / events * 1e6
    row = {"policy": "las", "active_jobs": mark["active"], "long_jobs": n_active, "gpus": 2048, "events": events,
           "starts_stops_per_event": (mark["c1"] - mark["c0"]) / events, "us_per_event": us}
    print(f"  las {mark['active']:>7} active ({n_active} long jobs) + a stream of {stream}: {events} events, "
          f"{row['starts_stops_per_event']:.2f} starts+stops each, {us:7.1f} us per event", flush=True)
    return row


def _state(n_active: int, capacity: int, policy_name: str, seed: int = 0):
    """A policy with ``n_active`` jobs, the cluster filled by a first pass, service spread."""
    rng = random.Random(seed)
    policy = make_policy(policy_name, history=[rng.choice(SIZES) * rng.expovariate(1 / 5000) for _ in range(1000)])
    now = 1e6
    for i in range(n_active):
        job = JobState(i, rng.choice(SIZES), now - rng.uniform(0, 1e5), duration=rng.expovariate(1 / 5000) + 1)
        started = rng.random() < 0.5
        if started:
            job.first_start = job.submit_time + rng.uniform(0, 100)
            job.service = rng.expovariate(1 / 3000) * job.num_gpus
            job.executed = job.service / job.num_gpus
        policy.add(job, now)
    to_start, _ = allocate(policy, capacity, [], now)
    for job in to_start:
        job.running = True
        policy.started(job, now)
    return policy, now


def _naive(policy, capacity: int, now: float):
    """Sort every active job, then walk: the pass without the per-size index."""
    order = sorted(policy.active.values(), key=lambda j: policy.key(j, now))
    free = capacity
    start, stop = [], []
    for job in order:
        if job.num_gpus <= free:
            free -= job.num_gpus
            if not job.running:
                start.append(job)
        elif job.running:
            stop.append(job)
    return start, stop


def decision(n_active: int, capacity: int, policy_name: str, reps: int) -> dict:
    policy, now = _state(n_active, capacity, policy_name)
    running = list(policy.running.values())
    times, naive_times = [], []
    rng = random.Random(1)
    for r in range(reps):
        arrival = JobState(10_000_000 + r, rng.choice(SIZES), now)
        policy.add(arrival, now)
        t0 = time.perf_counter()
        fast = allocate(policy, capacity, running, now)
        times.append(time.perf_counter() - t0)
        if r < max(3, reps // 10):
            t0 = time.perf_counter()
            slow = _naive(policy, capacity, now)
            naive_times.append(time.perf_counter() - t0)
            assert {j.job_id for j in fast[0]} == {j.job_id for j in slow[0]}, "passes disagree"
            assert {j.job_id for j in fast[1]} == {j.job_id for j in slow[1]}, "passes disagree"
        policy.remove(arrival, now)
    ms = statistics.median(times) * 1e3
    naive_ms = statistics.median(naive_times) * 1e3
    row = {"policy": policy_name, "active_jobs": n_active, "running_jobs": len(running), "gpus": capacity,
           "decision_ms_median": ms, "decision_ms_p95": sorted(times)[int(0.95 * (len(times) - 1))] * 1e3,
           "naive_sort_ms_median": naive_ms, "speedup_vs_naive": naive_ms / ms}
    print(f"  {policy_name:8} {n_active:>7} active, {len(running):>4} running on {capacity} GPUs: "
          f"{ms:7.2f} ms (sort-everything pass {naive_ms:8.2f} ms, {naive_ms / ms:6.1f}x)", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the results to FILE")
    ap.add_argument("--trace", default=str(PHILLY), help="the Philly trace (default: %(default)s)")
    ap.add_argument("--skip-trace", action="store_true", help="only the decision benchmark")
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--active", default="1000,10000,50000", help="active jobs for the time per event")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    out = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}}
    if not args.skip_trace:
        print(f"full {args.trace} on 48x8:", flush=True)
        out["full_trace"] = full_trace(ClusterSpec(48, 8), args.trace)
        las = out["full_trace"][0]["wall_seconds"]
        out["full_trace_las_over_fifo_wall"] = las / out["full_trace"][2]["wall_seconds"]
        out["philly_48x8_las_s"] = out["full_trace"][1]["wall_seconds"]
    print("one scheduling decision on 256x8 = 2048 GPUs:", flush=True)
    out["decision"] = [decision(int(n), 2048, p, args.reps) for p in ("las", "gittins")
                       for n in args.sizes.split(",")]
    print("time per simulator event on 256x8 = 2048 GPUs:", flush=True)
    out["per_event"] = [per_event(int(n)) for n in args.active.split(",") if n]
    if len(out["per_event"]) > 1:
        out["per_event_last_over_first"] = out["per_event"][-1]["us_per_event"] / out["per_event"][0]["us_per_event"]
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
