"""``autops bench packing``: AutoPS elasticity measured on this machine.

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

Workers emulate compute at the model's iteration time (see ``autops_elastic``); tensor
sizes are scaled by ``--scale`` (default 0.1). ``--json FILE`` writes one JSON object per
(model, jobs) (``-``: stdout; ``--append`` adds to FILE).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

from autops.admin import AdminClient
from autops.local import LocalPool
from autops.models import model_tensors
from dlrt import cli

from .autops_elastic import (ITERATION_S, Tensor, Workers, add_common_args, all_cpu, background_cpu, parse_args,
                             scaled_tensors, sleep_checking, tensor_bytes, warn_background, write_rows)

def _cpu_seconds(pid: int) -> float | None:
    import psutil
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


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
    with LocalPool(2 * njobs, log_level=args.log_level, master_args=master_args) as pool, AdminClient(pool.master, 10.0) as admin:
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
                    sleep_checking(workers, args.stagger)
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
                      f"status: {json.dumps(_status_brief(status))}", file=cli.text_out(args.json), flush=True)
            steady_after = time.monotonic() - started
            sleep_checking(workers, args.settle_iters * target_s)
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
                      file=cli.text_out(args.json), flush=True)
                while admin.status()["migrations"]["active"] > 0:
                    sleep_checking(workers, 0.5)
                sleep_checking(workers, args.settle_iters * target_s)
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


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_packing(model: str, njobs: int, args: argparse.Namespace) -> dict:
    """``args.rounds`` x (dedicated run, then shared run); per-job speed ratios are the median
    over rounds, aggregators the largest seen in any round's steady window."""
    tensors = scaled_tensors(model, args.scale, args.shapes)
    target_s = ITERATION_S[model] * args.time_scale
    started = time.monotonic()
    others = all_cpu()
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
        "background_cpu_cores": background_cpu(others, time.monotonic() - started),
        "wall_s": round(time.monotonic() - started, 1)}
    row["targets"] = {
        "aggregator_reduction_ge_0.5": row["aggregator_reduction"] is not None and row["aggregator_reduction"] >= 0.5,
        "max_slowdown_le_0.1": row["max_slowdown"] is not None and row["max_slowdown"] <= 0.1}
    return row


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    """``autops bench packing``: dedicated vs shared aggregators for J concurrent 2s-2w jobs."""
    p = cli.parser("autops bench packing", description=__doc__.splitlines()[0])
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
    add_common_args(p)
    args = parse_args(p, argv)
    out = cli.text_out(args.json)

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
                  f"{'all packed' if row['all_packed'] else 'NOT STEADY'}, {row['wall_s']:.0f}s", file=out, flush=True)
            if row["rounds"] > 1:
                print(f"      worst job per round: "
                      f"{', '.join(_pct(None if x is None else -x) for x in row['max_slowdown_per_round'])} vs dedicated "
                      f"(rows below: medians over rounds)", file=out, flush=True)
            for x in row["job_detail"]:
                print(f"      {x['job']}: {x['state']:<9} on {','.join(x['aggregators'] or [])}  "
                      f"{x['dedicated_it_s'] or 0:.3f} -> {x['shared_it_s'] or 0:.3f} it/s "
                      f"({_pct((x['speed_vs_dedicated'] or 1) - 1)}), comm {x['dedicated_comm_ms']:.1f} -> "
                      f"{x['shared_comm_ms']:.1f} ms", file=out, flush=True)
            warn_background(row, out)
            write_rows([row], args.json, append=args.append or len(rows) > 1)
    return 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
