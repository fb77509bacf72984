"""``autops bench migrate`` (thesis §4.5.2.2, Table 4.3): one job (2 workers, ``num_aggregators=2``, ``sum``
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
``--json FILE`` writes one JSON object per (model, mode) (``-``: stdout; ``--append`` adds
to FILE).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

import numpy as np

from autops.admin import AdminClient
from autops.local import LocalPool
from dlrt import cli

from .autops_elastic import (ITERATION_S, Workers, add_common_args, all_cpu, background_cpu, counter_delta,
                             parse_args, proc_counters, scaled_tensors, tensor_bytes, warn_background,
                             write_rows)

def run_migrate(model: str, mode: str, args: argparse.Namespace) -> dict:
    tensors = scaled_tensors(model, args.scale, args.shapes)
    compute_s = ITERATION_S[model] * args.time_scale if args.compute_s is None else args.compute_s
    job = f"mig-{model}-{mode}-{uuid.uuid4().hex[:5]}"
    started = time.monotonic()
    others = all_cpu()
    repeats: list[dict] = []
    with LocalPool(4, log_level=args.log_level, master_args=["--static"]) as pool, AdminClient(pool.master, 10.0) as admin:
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
            mark = (proc_counters(pids), workers.iteration(0))
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
                before = proc_counters(pids)
                t_call = time.monotonic()
                reply = admin.migrate(job, to=targets)
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
                during = proc_counters(pids)
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
                       "proc_before_per_iter": (counter_delta(mark[0], before, max(1, it_before - mark[1]))
                                                if it_before > mark[1] else None),
                       "proc_migration": counter_delta(before, during)}
                repeats.append(rec)
                print(f"  repeat {rep + 1}: {reply['keys']} keys {current} -> {targets} "
                      f"{'done' if done else 'NOT DONE'} in "
                      f"{rec['migration_s'] if done else args.migrate_timeout:.3f}s"
                      f"{f', {failed} keys failed' if failed else ''}", file=cli.text_out(args.json), flush=True)
                if not done:
                    print("  status: " + json.dumps({"migrations": (last or status)["migrations"],
                                                     "job": js}), file=cli.text_out(args.json), flush=True)
                    break
                it_done = workers.iteration(0)
                target = it_done + args.gap
                while workers.iteration(0) < target:
                    workers.check()
                    time.sleep(0.05)
                mark = (proc_counters(pids), workers.iteration(0))
                rec["proc_after_per_iter"] = counter_delta(during, mark[0], max(1, mark[1] - it_done))
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
        "background_cpu_cores": background_cpu(others, time.monotonic() - started),
        "wall_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    """``autops bench migrate``: pause a training job sees when all its tensors move live."""
    p = cli.parser("autops bench migrate", description="live migration of all of a job's "
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
    add_common_args(p)
    args = parse_args(p, argv)
    out = cli.text_out(args.json)

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
                  f"{row['wall_s']:.0f}s", file=out, flush=True)
            warn_background(row, out)
            write_rows([row], args.json, append=args.append or len(rows) > 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
