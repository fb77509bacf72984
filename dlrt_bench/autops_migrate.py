"""``autops bench migrate`` (thesis §4.5.2.2, Table 4.3): the pause a training job sees when all
its tensors migrate live, and what the migration costs another job on the same aggregators.

One job (2 workers, ``num_aggregators=2``, ``sum`` mode or ``server`` mode with adam) trains
on a ``--static`` pool of 4 aggregators with the model's real tensors (``--scale 1.0``) and
sleep-emulated compute; a second job (``--other``, default resnet50, 2 workers, ``sum`` mode)
trains on the other two aggregators. After a warm-up the admin ``MIGRATE`` moves every key of
the first job to the two aggregators it does not use -- the second job's -- and the benchmark
waits until no migration is active and every key is there; ``--repeats`` times, back and
forth (the even repeats move the job off the second job's aggregators).

Figures, per repeat; over repeats their maximum (``max_*``) and median (``median_*``):

* the job's *communication time* in an iteration: the longest of its two workers' (push_pull
  start to all handles done). A synchronous iteration waits for its slower worker, so that is
  the time the job spent.
* ``pause_ms``: the job's longest communication time over the *switch* iterations -- the
  first iterations the new aggregators serve (pMaster's ``status()["migrations"]["recent"]``
  gives each batch's first and last such iteration) -- minus its median in the iterations
  outside every migration that are closest to this one (``job_baseline_comm_ms``): the
  ``--gap`` before the migration and the ``--gap`` after it (after the first ``--skip``). A
  local baseline, because the load other processes put on a shared machine drifts over a
  run. That is where the job waits for the move.
* ``pause_vs_worker_ms`` (``max_`` / ``median_`` over repeats): the same longest time against
  the median of *every worker's* communication time in those iterations
  (``baseline_comm_ms``), the definition this benchmark used before (rows without
  ``pause_baseline: "job"``). It counts the two workers' spread as a pause: without any
  migration its median is above 0 (``quiet_pause_vs_worker_ms_median``).
* ``window_excess_ms``: the largest excess of a worker's communication time over
  ``baseline_comm_ms`` in every iteration overlapping [MIGRATE, done] plus the first one
  after done -- the pause as this benchmark measured it before the switch iterations were
  known. It includes what the copy in the background (memory population, state sent ahead)
  costs the job's other iterations, and this machine's noise.
* ``quiet_pause_ms_median`` / ``_p90``: the pause's statistic (the job's longest
  communication time over as many consecutive iterations as the switch spanned, minus the
  job's baseline) over the iterations without a migration that gave each repeat's baseline:
  what this machine's noise alone makes of it. A pause near it is no pause this benchmark
  can tell from noise. ``quiet_pause_ms`` lists every value it was taken over
  (``quiet_pause_vs_worker_ms*``: the same against the workers' baseline).
* ``targets_met``: the goals for the pauses over the repeats -- median at most 20 ms (``sum``)
  or 100 ms (``server``), and in ``sum`` mode the longest at most 60 ms;
  ``noise_only_targets_share``: the share of runs with as many moves that would meet each
  goal (and ``all`` of them) if no move paused the job at all, each move's statistic drawn
  from ``quiet_pause_ms``: how often this machine's noise alone lets a run meet the goals.
* ``handover_wait_ms``: what the switch itself made the workers wait -- the longest any key's
  first iteration on the new aggregator, complete (every worker pushed it), waited there for
  the old owner's hand-over (pMaster's ``recent`` batches, from the new owner's WORKER_DONE);
  ``redirects``: requests the workers had to resend because they reached the old owner after
  the switch (each a round trip and a resend). Unlike the excesses these are free of the
  machine's noise, and they leave out what the copy in the background costs.
* ``worker_end_skew_ms_median`` / ``_p90``: how far apart the two workers' iterations end
  (whoever ends later starts later, and the other then waits for its pushes): a spread the
  excesses inherit, migration or not.
* ``other_job``: the second job's communication and iteration times in its iterations that
  overlap a migration against those that do not, and their ratio (the copy's cost to a
  neighbour).
* ``first_reply_ms`` per repeat (``first_reply_ms_per_repeat``): how long after both workers
  started the switch iteration's communication the first of their operations completed, with
  ``first_reply_ms_quiet_median`` / ``_p90`` over the iterations without a migration: a switch
  that starts late shows here, one whose transfers are slower does not.
* ``tcp_switch`` / ``tcp_lead`` per repeat and ``tcp_quiet`` (``--emulate-hosts`` only): the
  emulated hosts' TCP loss (``dlrt_bench.tcp_loss``: retransmitted segments, retransmission
  timeouts, tail-loss probes, backlog drops) over the switch iterations and the iteration
  before them, and per iteration without a migration (``per_iteration`` lists every one), so
  a pause can be told apart from a loss the emulated links made.
* ``cpu_switch`` per repeat and ``cpu_quiet``: the machine's CPU time (``dlrt_bench.cpu_time``:
  ms the VM's host took, ``steal_ms``; idle; used here; and each aggregator's and worker's)
  over the switch iterations and per iteration without a migration, so a pause the VM's host
  made can be told apart, and each process's CPU in the switch against the iterations after
  the move (``over_after_ms``) says who did extra work in it.
* ``cutover_ms`` per repeat (``max_`` / ``median_`` over repeats): the same excess as
  ``pause_ms`` in the iteration before the switch -- the old owners' last, in which they hand
  the keys over -- and ``cutover_end_skew_ms``, how far apart it ended the two workers' (the
  switch iteration inherits that spread). ``cpu_cutover`` per repeat: ``cpu_switch`` for that
  iteration, each process against the iterations before the move (``over_before_ms``).
* ``new_owner_ms`` per repeat: per batch, when the first push of its keys and its hand-over
  reached the new owner and when their first iteration there was complete, in ms after both
  workers started the switch iteration (the new owner's clock; one machine).
* ``timeline``: per worker, each iteration's begin, communication start and end on the
  machine's monotonic clock, to lay other recordings over (``perf record -k CLOCK_MONOTONIC``).
* ``cycles``: each aggregator's cyclic execution at the end (its cycle, and the aggregations
  run out of their slot or put off to the next cycle).
* ``warm_bytes``: what each new TCP connection carried to the new owner and back before the
  switch (``--warm-bytes``, the agents' ``$AUTOPS_WARM_BYTES``), and ``warmed_connections``:
  how many the workers warmed, counted as the echoes came back.
* the migration duration, MIGRATE call to done (status polled every ``--poll`` s), and per
  aggregator and worker process CPU seconds and minor page faults during the migration and
  per iteration before and after it.

``--emulate-hosts`` runs every aggregator and every worker on an emulated host of its own
(``dlrt_bench.testbed``, ``--link``, default 10 Gbit/s): the state then crosses shaped links.

``--json FILE`` writes one JSON object per (model, mode) (``-``: stdout; ``--append`` adds
to FILE).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import numpy as np
import psutil

from autops.admin import AdminClient
from autops.config import PREFAULT_SHARE, RESERVE_SHARED, WARM_BYTES, WARM_ENV, AgentConfig
from autops.local import LocalPool
from dlrt import cli
from dlrt.procs import exit_on_sigterm

from .autops_hosts import HostPool
from .cpu_time import CpuSampler
from .tcp_loss import TcpLossSampler
from .testbed import Testbed, add_rps_option, available, cleanup, enter_netns

from .autops_elastic import (ITERATION_S, Workers, add_common_args, all_cpu, background_cpu, counter_delta,
                             parse_args, proc_counters, scaled_tensors, tensor_bytes, warn_background,
                             write_rows)

MAIN, OTHER = 0, 1          # worker tags of the migrating job and of its neighbour

Record = tuple[int, float, float, float]      # iteration, begin, communication start, end


@contextlib.contextmanager
def site(args: argparse.Namespace, master_args: list[str]) -> Iterator[tuple[str, AdminClient, dict]]:
    """A pool of 4 aggregators: ``(pMaster's address, an admin client, {tag: worker hosts})``.
    On this machine the workers run here (no hosts); with ``--emulate-hosts`` every aggregator
    and every worker is an emulated host of its own (8 hosts, ``--link``), pMaster beside the
    first aggregator, and the admin client's connection is made from inside pMaster's host."""
    if not args.emulate_hosts:
        with LocalPool(4, log_level=args.log_level, master_args=master_args,
                       aggregator_args=aggregator_args(args)) as pool, \
                AdminClient(pool.master, 10.0) as admin:
            yield pool.master, admin, {}
        return
    tb = Testbed(8, link=args.link, prefix=args.prefix, rps=args.rps)
    cleanup(tb.prefix)                      # what a killed earlier run left behind
    tb.up()
    try:
        with HostPool(tb, tb.hosts[:4], log_level=args.log_level, master_args=master_args,
                      aggregator_args=aggregator_args(args)) as pool:
            admin = in_netns(pool.master_host.netns, lambda: AdminClient(pool.master, 10.0))
            try:
                yield pool.master, admin, {MAIN: tb.hosts[4:6], OTHER: tb.hosts[6:8]}
            finally:
                admin.close()
    finally:
        tb.down()


def aggregator_args(args: argparse.Namespace) -> list[str]:
    """The options this benchmark gives every aggregator."""
    return ["--prefault-share", str(args.prefault_share), "--reserve", str(args.reserve),
            "--reserve-shared", str(args.reserve_shared)]


def master_pid() -> dict[str, int]:
    """``{"pmaster": pid}`` of the pMaster this process started (``autops.cli master``), or {}."""
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[1:4] == ["-m", "autops.cli", "master"]:
                return {"pmaster": child.pid}
        except psutil.Error:
            continue
    return {}


def wait_reserves(admin: AdminClient, timeout: float) -> float | None:
    """Seconds until every aggregator reports its ``--reserve`` populated (None: no reserve,
    or not within ``timeout``): the jobs start on aggregators whose reserve is ready."""
    started = time.monotonic()
    while time.monotonic() < started + timeout:
        aggs = admin.status()["aggregators"]
        if not any(a.get("reserve_bytes") for a in aggs):
            return None
        if all(a.get("reserve_warmed_bytes") for a in aggs):
            return round(time.monotonic() - started, 1)
        time.sleep(0.5)
    return None


def in_netns(netns: str, make: Callable[[], Any]) -> Any:
    """``make()`` called on a thread inside network namespace ``netns``: the ZeroMQ context
    it creates starts its I/O thread there, so the object's connections are made from there
    while this thread stays where it is."""
    box: list = []

    def run() -> None:
        try:
            enter_netns(netns)
            box.append((True, make()))
        except BaseException as exc:      # handed to the caller
            box.append((False, exc))

    thread = threading.Thread(target=run, name=f"in-{netns}")
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def run_migrate(model: str, mode: str, args: argparse.Namespace) -> dict:
    tensors = scaled_tensors(model, args.scale, args.shapes)
    compute_s = ITERATION_S[model] * args.time_scale if args.compute_s is None else args.compute_s
    job = f"mig-{model}-{mode}-{uuid.uuid4().hex[:5]}"
    other = None if args.other == "none" else f"nbr-{args.other}-{uuid.uuid4().hex[:5]}"
    out = cli.text_out(args.json)
    started = time.monotonic()
    others = all_cpu()
    repeats: list[dict] = []
    seen_batches: set[int] = set()
    loss: TcpLossSampler | None = None
    cpu: CpuSampler | None = None
    master_args = ["--static", "--heartbeat-timeout", str(args.heartbeat_timeout)]
    with site(args, master_args) as (master, admin, hosts):
        reserve_wait_s = wait_reserves(admin, args.start_timeout) if args.reserve else None
        workers = Workers(master)
        try:
            workers.start_job(MAIN, job, tensors, mode=mode, optimizer=args.optimizer, compute_s=compute_s,
                              timeout=args.agent_timeout, transport=args.transport, hosts=hosts.get(MAIN))
            wait_iterations(workers, MAIN, args.warmup, args.start_timeout)
            if other is not None:
                # after the first job has its aggregators: the neighbour gets the two others
                workers.start_job(OTHER, other, scaled_tensors(args.other, args.scale, args.shapes),
                                  compute_s=ITERATION_S[args.other] * args.time_scale, timeout=args.agent_timeout,
                                  transport=args.transport, hosts=hosts.get(OTHER))
                wait_iterations(workers, OTHER, args.skip + 1, args.start_timeout)
            status = admin.status()
            pids = {a["id"]: a["pid"] for a in status["aggregators"]}
            pids.update({p.name.rsplit("-", 1)[1]: p.pid for p in workers.procs})
            # pMaster, and this process (its status polls during a move cost both CPU)
            pids.update(bench=os.getpid(), **master_pid())
            placement = {j["job"]: sorted(j["keys_per_aggregator"]) for j in status["jobs"]}
            if args.emulate_hosts:            # every process a host of its own
                loss = TcpLossSampler(pids, args.tcp_sample).start()
            cpu = CpuSampler(args.cpu_sample, pids=pids, threads=args.thread_cpu).start()
            seen_batches.update(b["mid"] for b in status["migrations"].get("recent") or ())
            mark = (proc_counters(pids), workers.iteration(MAIN))
            wait_iterations(workers, MAIN, mark[1] + args.gap)   # a steady stretch, measured
            for rep in range(args.repeats):
                status = admin.status()
                js = next(j for j in status["jobs"] if j["job"] == job)
                current = sorted(js["keys_per_aggregator"])
                live = sorted(a["id"] for a in status["aggregators"] if a["alive"])
                targets = [a for a in live if a not in current][:2]
                failed0 = status["migrations"]["failed"]
                it_before = workers.iteration(MAIN)
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
                batches = [b for b in (last or status)["migrations"].get("recent") or ()
                           if b["job"] == job and b["mid"] not in seen_batches]
                seen_batches.update(b["mid"] for b in batches)
                firsts = [i for b in batches if b.get("first_iterations") for i in b["first_iterations"]]
                rec = {"repeat": rep + 1, "from": current, "to": targets, "keys": reply["keys"],
                       "batches": reply["batches"], "iteration_at_call": it_before, "t_call": t_call,
                       "t_done": t_done, "done": done, "failed_keys": failed,
                       "call_ms": round(1e3 * (t_reply - t_call), 2),
                       "migration_s": round(t_done - t_call, 4) if t_done else None,
                       "iteration_at_done": workers.iteration(MAIN),
                       "switch_iterations": [min(firsts), max(firsts)] if firsts else None,
                       "keys_precopied": sum(b.get("precopied_keys", 0) for b in batches),
                       "handover_wait_ms": max((b.get("handover_wait_ms", 0.0) for b in batches), default=None),
                       "switch_seen": [b["switch_seen"] for b in batches if b.get("switch_seen")],
                       # per process [CPU s, minor page faults]: per iteration in the steady stretch
                       # before the first call (later repeats: see the previous proc_after_per_iter),
                       # in total from the call to done, per iteration in the --gap iterations after done
                       "proc_before_per_iter": (counter_delta(mark[0], before, max(1, it_before - mark[1]))
                                                if it_before > mark[1] else None),
                       "proc_migration": counter_delta(before, during)}
                repeats.append(rec)
                print(f"  repeat {rep + 1}: {reply['keys']} keys {current} -> {targets} "
                      f"{'done' if done else 'NOT DONE'} in "
                      f"{rec['migration_s'] if done else args.migrate_timeout:.3f}s, switched in iterations "
                      f"{rec['switch_iterations']}{f', {failed} keys failed' if failed else ''}", file=out, flush=True)
                if not done:
                    print("  status: " + json.dumps({"migrations": (last or status)["migrations"],
                                                     "job": js}), file=out, flush=True)
                    break
                it_done = workers.iteration(MAIN)
                wait_iterations(workers, MAIN, it_done + args.gap)
                mark = (proc_counters(pids), workers.iteration(MAIN))
                rec["proc_after_per_iter"] = counter_delta(during, mark[0], max(1, mark[1] - it_done))
            final = admin.status()
            results = workers.finish()
        finally:
            workers.close()
            if loss is not None:
                loss.stop()
            if cpu is not None:
                cpu.stop()
    per_rank = {r: results[(MAIN, r)]["records"] for r in range(2)}
    windows = [(rec.pop("t_call"), rec.pop("t_done")) for rec in repeats]
    summary = pauses(per_rank, repeats, windows, args.skip, args.gap)
    summary.update(end_skew(per_rank, args.skip))
    summary.update(first_reply(per_rank, {r: results[(MAIN, r)]["first_replies"] for r in range(2)}, repeats,
                               windows, args.skip))
    new_owner_times(per_rank, repeats)
    if loss is not None:
        summary["tcp_quiet"] = tcp_loss(loss, per_rank, repeats, windows, args.skip)
    if cpu is not None:
        summary["cpu_quiet"] = cpu_time(cpu, per_rank, repeats, windows, args.skip, args.gap)
    waits = [rec["handover_wait_ms"] for rec in repeats if rec["handover_wait_ms"] is not None]
    summary.update(max_handover_wait_ms=max(waits, default=None),
                   median_handover_wait_ms=statistics.median(waits) if waits else None,
                   redirects=sum(results[(MAIN, r)].get("redirects", 0) for r in range(2)))
    if other is not None:
        summary["other_job"] = {"model": args.other, "aggregators": placement.get(other),
                                **neighbour_cost([results[(OTHER, r)]["records"] for r in range(2)], windows,
                                                 args.skip)}
    iters = [e - b for records in per_rank.values() for it, b, _, e in records if it > args.skip]
    row = {
        "benchmark": "migrate", "model": model, "mode": mode, "optimizer": args.optimizer if mode == "server" else None,
        "scale": args.scale, "transport": args.transport, "workers": 2, "aggregators": 4, "compute_s": compute_s,
        "site": "emulated" if args.emulate_hosts else "local", "link": args.link if args.emulate_hosts else None,
        "rps": args.rps if args.emulate_hosts else None,
        "prefault_share": args.prefault_share, "reserve": args.reserve,
        "reserve_shared": args.reserve_shared, "reserve_wait_s": reserve_wait_s,
        "warm_bytes": AgentConfig.from_env().warm_bytes,
        # the workers' connections warmed ahead of a move, their echoes back
        "warmed_connections": sum(results[(MAIN, r)].get("warmed", 0) for r in range(2)),
        "tensors": len(tensors), "model_bytes": tensor_bytes(tensors), "keys_moved": repeats[0]["keys"] if repeats else 0,
        "aggregators_before": placement.get(job),
        "repeats": len(repeats), "all_completed": all(r["done"] and not r["failed_keys"] for r in repeats),
        **summary,
        "first_iterations_comm_ms": [[round(1e3 * (e - s), 1) for _, _, s, e in records[:2]]
                                     for records in per_rank.values()],
        "migration_s": [r["migration_s"] for r in repeats],
        "iteration_ms_median": round(1e3 * statistics.median(iters), 1) if iters else None,
        "migrations_failed": final["migrations"]["failed"], "migrations_completed_keys": final["migrations"]["completed"],
        # memory made ready for the incoming keys, per aggregator: bytes, CPU s (of it on CPU
        # the host had to spare), s paused to keep the rest to --prefault-share, s waited for
        # a busy host to have CPU to spare, the helper threads' page faults; the same for
        # keys a job waited for (at_once_*), and the --reserve populated at start
        "prefault": {a["id"]: {k: v for k, v in a.items()
                               if k.startswith(("prefault", "at_once_prefault", "reserve")) or k == "heap_warmed_bytes"}
                     for a in final["aggregators"]},
        # cyclic execution where both jobs share aggregators (thesis §4.3.3.2), per aggregator
        # at the end: its cycle (None: one job or none there) and the aggregations its
        # schedules ran outside their slot (late) or put off to the next cycle (postponed)
        "cycles": {a["id"]: {"cycle_s": a.get("cycle_s"), "late": a.get("late", 0),
                             "postponed": a.get("postponed", 0)} for a in final["aggregators"]},
        # server mode: the serving threads' time and page faults copying state (the old
        # owners' snapshots, the followers' installs and take-overs, whole replica installs)
        "state_copy": {a["id"]: {k: v for k, v in a.items() if k.startswith(("state_", "replica_install"))}
                       for a in final["aggregators"]},
        # the hand-overs each aggregator sent as an old owner: TENSOR_COPY messages, and its
        # loop's CPU sending them and taking their answers
        "handovers": {a["id"]: {"messages": a.get("handover_messages", 0), "cpu_s": a.get("handover_cpu_s", 0.0),
                                "keys": a.get("migrated_out", 0)} for a in final["aggregators"]},
        "per_repeat": repeats,
        "comm_ms": [[round(1e3 * (e - s), 1) for _, _, s, e in records] for records in per_rank.values()],
        # per rank, every iteration's [iteration, begin, communication start, end] on this
        # machine's CLOCK_MONOTONIC (s), to lay other recordings (perf -k CLOCK_MONOTONIC) over
        "timeline": [[[it, round(b, 6), round(s, 6), round(e, 6)] for it, b, s, e in records]
                     for records in per_rank.values()],
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "model", "mode")},
        "background_cpu_cores": background_cpu(others, time.monotonic() - started),
        "wall_s": round(time.monotonic() - started, 1)}
    row["targets_met"] = targets_met(row["pause_ms_per_repeat"], mode)
    row["noise_only_targets_share"] = noise_only_share(row["quiet_pause_ms"], len(repeats), mode)
    return row


# the goals for a run's pauses (ms): its median over the moves, by mode, and in ``sum`` mode
# its longest
MEDIAN_GOAL_MS = {"sum": 20.0, "server": 100.0}
MAX_GOAL_MS = {"sum": 60.0}


def targets_met(pause_ms: list[float], mode: str) -> dict[str, bool]:
    """Whether a run's per-move pauses meet each goal (``MEDIAN_GOAL_MS``, ``MAX_GOAL_MS``);
    no pause at all meets none."""
    median_goal = MEDIAN_GOAL_MS[mode]
    met = {f"median_pause_le_{median_goal:.0f}ms": bool(pause_ms) and statistics.median(pause_ms) <= median_goal}
    if mode in MAX_GOAL_MS:
        met[f"max_pause_le_{MAX_GOAL_MS[mode]:.0f}ms"] = bool(pause_ms) and max(pause_ms) <= MAX_GOAL_MS[mode]
    return met


def noise_only_share(quiet_ms: list[float], moves: int, mode: str, draws: int = 20000,
                     seed: int = 0) -> dict[str, float] | None:
    """What this machine's noise alone lets a run show: the share of runs of ``moves`` moves
    that would meet each goal of ``targets_met`` (and ``all`` of them at once) if no move
    paused the job at all -- each move's statistic drawn (with replacement, ``draws`` runs,
    a fixed ``seed``) from ``quiet_ms``, the same statistic over iterations without a
    migration (``pauses``). ``None`` without quiet iterations or moves."""
    if not quiet_ms or moves < 1:
        return None
    runs = np.random.default_rng(seed).choice(np.asarray(quiet_ms, dtype=float), size=(draws, moves))
    met = [targets_met(run.tolist(), mode) for run in runs]
    shares = {name: sum(m[name] for m in met) / draws for name in met[0]}
    shares["all"] = sum(all(m.values()) for m in met) / draws
    return {name: round(share, 3) for name, share in shares.items()}


def wait_iterations(workers: Workers, tag: int, target: int, timeout: float | None = None) -> None:
    """Until every rank of job ``tag`` completed ``target`` iterations (raising on a worker's
    failure, or after ``timeout`` seconds)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while workers.iteration(tag) < target:
        workers.check()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {workers.jobs[tag]} did not reach iteration {target} in {timeout:.0f}s")
        time.sleep(0.05)


def migration_iterations(per_rank: dict[int, list[Record]],
                         windows: list[tuple[float, float | None]]) -> dict[int, list[set[int]]]:
    """rank -> per migration window, the iterations of that rank that overlap it, and the first
    one after it (on the new aggregators)."""
    in_window: dict[int, list[set[int]]] = {r: [] for r in per_rank}
    for t_call, t_done in windows:
        t_end = t_done if t_done is not None else float("inf")
        for r, records in per_rank.items():
            its = {it for it, _, s, e in records if e >= t_call and s <= t_end}
            after = [it for it, _, s, _ in records if s > t_end]
            if after:
                its.add(min(after))
            in_window[r].append(its)
    return in_window


def busy_iterations(per_rank: dict[int, list[Record]], windows: list[tuple[float, float | None]]) -> set[int]:
    """The iterations that some rank had in a migration window (``migration_iterations``)."""
    return set().union(*(its for sets in migration_iterations(per_rank, windows).values() for its in sets))


def pauses(per_rank: dict[int, list[Record]], repeats: list[dict], windows: list[tuple[float, float | None]],
           skip: int, gap: int) -> dict:
    """The pause figures (module docstring) over ``per_rank`` records; adds each repeat's
    ``pause_ms``, ``pause_vs_worker_ms``, ``window_excess_ms``, ``baseline_comm_ms``,
    ``job_baseline_comm_ms`` and ``excess_ms`` to its record in ``repeats``.

    A synchronous job's iteration waits for its slower worker, so the job's communication
    time in an iteration is the longest of its workers'. The pause compares that in the
    switch iterations with its median over the quiet iterations around the move
    (``job_baseline_comm_ms``): with no migration its median is 0. ``pause_vs_worker_ms`` is
    the same maximum against the median of every worker's time (``baseline_comm_ms``, the
    definition before): it reads the workers' spread as a pause (its median without a
    migration is above 0)."""
    in_window = migration_iterations(per_rank, windows)
    excluded = {r: set().union(*sets) if sets else set() for r, sets in in_window.items()}
    base = [e - s for r, records in per_rank.items() for it, _, s, e in records
            if it > skip and it not in excluded[r]]
    baseline = statistics.median(base) if base else float("nan")
    quiet_pauses: list[float] = []           # against the job's baseline
    quiet_vs_worker: list[float] = []        # against the workers' (the definition before)
    for n, rec in enumerate(repeats):
        switch = rec.get("switch_iterations")
        window, switched = [], []
        local = []
        stretches: list[dict[int, float]] = [{}, {}]     # iteration -> the job's communication time, before / after
        for r, records in per_rank.items():
            quiet = [(it, e - s) for it, _, s, e in records if it > skip and it not in excluded[r]]
            first, last = min(in_window[r][n], default=0), max(in_window[r][n], default=0)
            for stretch, part in zip(stretches, ([q for q in quiet if q[0] < first][-gap:],
                                                 [q for q in quiet if q[0] > last][:gap])):
                local += [c for _, c in part]
                for it, c in part:
                    stretch[it] = max(c, stretch.get(it, c))
        near = statistics.median(local) if local else baseline
        job = [c for stretch in stretches for c in stretch.values()]
        job_near = statistics.median(job) if job else near
        rec["baseline_comm_ms"] = round(1e3 * near, 2)
        rec["job_baseline_comm_ms"] = round(1e3 * job_near, 2)
        if switch is not None:
            # the pause's statistic -- the job's longest time over the switch's span of
            # iterations -- taken over as many consecutive iterations without a migration:
            # the noise alone
            span = switch[1] - switch[0] + 1
            for stretch in stretches:
                its = sorted(stretch)
                for i in range(len(its) - span + 1):
                    if its[i + span - 1] - its[i] == span - 1:
                        longest = max(stretch[it] for it in its[i:i + span])
                        quiet_pauses.append(longest - job_near)
                        quiet_vs_worker.append(longest - near)
        for r, records in per_rank.items():
            for it, _, s, e in records:
                if it in in_window[r][n]:
                    window.append((e - s) - near)
                if switch is not None and switch[0] <= it <= switch[1]:
                    switched.append(e - s)
        rec["excess_ms"] = [round(1e3 * x, 2) for x in window]
        rec["window_excess_ms"] = round(1e3 * max(window), 2) if window else None
        rec["pause_ms"] = round(1e3 * (max(switched) - job_near), 2) if switched else None
        rec["pause_vs_worker_ms"] = round(1e3 * (max(switched) - near), 2) if switched else None
        rec["cutover_ms"] = rec["cutover_end_skew_ms"] = None
        if switch is not None:
            # the old owners' last iteration: its excess, and how far apart it left the workers
            last = [(s, e) for records in per_rank.values() for it, _, s, e in records if it == switch[0] - 1]
            if len(last) == len(per_rank):
                rec["cutover_ms"] = round(1e3 * (max(e - s for s, e in last) - job_near), 2)
                rec["cutover_end_skew_ms"] = round(1e3 * (max(e for _, e in last) - min(e for _, e in last)), 2)
    return {
        "pause_baseline": "job",
        **over_repeats(repeats, "pause"),
        **over_repeats(repeats, "pause_vs_worker"),
        **over_repeats(repeats, "window_excess"),
        **over_repeats(repeats, "cutover"),
        **quiet_figures("quiet_pause_ms", quiet_pauses),
        **quiet_figures("quiet_pause_vs_worker_ms", quiet_vs_worker),
        "baseline_comm_ms": round(1e3 * baseline, 2),
        "baseline_comm_ms_p90": round(1e3 * float(np.percentile(base, 90)), 2) if base else None}


def over_repeats(repeats: list[dict], name: str) -> dict:
    """``max_{name}_ms``, ``median_{name}_ms`` and ``{name}_ms_per_repeat`` over the repeats
    that have ``{name}_ms``."""
    values = [rec[f"{name}_ms"] for rec in repeats if rec[f"{name}_ms"] is not None]
    return {f"max_{name}_ms": max(values) if values else None,
            f"median_{name}_ms": statistics.median(values) if values else None,
            f"{name}_ms_per_repeat": values}


def quiet_figures(key: str, values: list[float]) -> dict:
    """``key`` (every value, ms), ``key_median`` and ``key_p90`` for no-migration values (s)."""
    return {f"{key}_median": round(1e3 * statistics.median(values), 2) if values else None,
            f"{key}_p90": round(1e3 * float(np.percentile(values, 90)), 2) if values else None,
            key: [round(1e3 * q, 2) for q in values]}


def comm_spans(per_rank: dict[int, list[Record]]) -> dict[int, tuple[float, float]]:
    """Iteration -> (first start, last end) of the workers' communication in it."""
    spans: dict[int, tuple[float, float]] = {}
    for records in per_rank.values():
        for it, _, s, e in records:
            a, b = spans.get(it, (s, e))
            spans[it] = (min(a, s), max(b, e))
    return spans


def cpu_time(sampler: CpuSampler, per_rank: dict[int, list[Record]], repeats: list[dict],
             windows: list[tuple[float, float | None]], skip: int, gap: int) -> dict:
    """The machine's CPU time (``cpu_time.CpuSampler``: ms taken by the VM's host, idle,
    used here, and each process's) in the communication phases of the migrating job: adds
    ``cpu_switch`` (over its switch iterations' communication; ``over_after_ms``: each
    process's CPU there minus its median over the same phase of the ``gap`` iterations after the
    move, where the keys sit where the switch put them) and ``cpu_cutover`` (over the iteration
    before, the old owners' last; ``over_before_ms``: against the ``gap`` iterations before the
    move) to each repeat's record (with ``--thread-cpu`` also ``over_after_by_thread_ms`` /
    ``over_before_by_thread_ms``, per ``process/thread``); returns, over
    the iterations outside every migration (after the first ``skip``): median / p90 / max of
    ``steal_ms``, the medians of ``idle_ms`` and ``busy_ms``, and ``per_iteration``: every
    iteration's [iteration, steal, idle, busy ms, in a migration (0/1)]."""
    spans = comm_spans(per_rank)
    for rec in repeats:
        switch = rec.get("switch_iterations")
        if switch is not None and switch[0] in spans and switch[1] in spans:
            rec["cpu_switch"] = sampler.window(spans[switch[0]][0], spans[switch[1]][1])
            if switch[0] - 1 in spans:
                rec["cpu_cutover"] = sampler.window(*spans[switch[0] - 1])
    busy = busy_iterations(per_rank, windows)
    each = {it: sampler.window(*span) for it, span in sorted(spans.items()) if it > skip}
    per_iteration = [[it, w["steal_ms"], w["idle_ms"], w["busy_ms"], int(it in busy)] for it, w in each.items()]
    quiet = [w for it, w in each.items() if it not in busy]
    if not quiet:
        return {"iterations": 0, "per_iteration": per_iteration}
    for rec in repeats:
        switch = rec.get("switch_iterations")
        if "cpu_switch" not in rec:
            continue
        # who used more than in the iterations with the keys where they were then, no migration:
        # the switch against the ``gap`` right after the move, the cutover against those before it
        after = [w for it, w in each.items() if it > switch[1] and it not in busy][:gap]
        before = [w for it, w in each.items() if it < switch[0] - 1 and it not in busy][-gap:]
        for name, key, same in (("cpu_switch", "over_after_ms", after), ("cpu_cutover", "over_before_ms", before)):
            if name in rec:
                rec[name][key] = over_usual(rec[name]["by_process"], [w["by_process"] for w in same])
                if "by_thread" in rec[name]:
                    rec[name][key.replace("_ms", "_by_thread_ms")] = over_usual(
                        per_thread(rec[name]), [per_thread(w) for w in same])
    steal = [q["steal_ms"] for q in quiet]
    return {"iterations": len(quiet), "steal_ms_median": statistics.median(steal),
            "steal_ms_p90": round(float(np.percentile(steal, 90)), 1), "steal_ms_max": max(steal),
            "idle_ms_median": statistics.median(q["idle_ms"] for q in quiet),
            "busy_ms_median": statistics.median(q["busy_ms"] for q in quiet), "per_iteration": per_iteration}


def over_usual(used: dict[str, float], usual: list[dict[str, float]]) -> dict[str, float]:
    """Each name's CPU (ms) in ``used`` minus its median over ``usual`` (the same per window;
    a window without the name counts 0), for the names some window of ``usual`` has."""
    return {n: round(ms - statistics.median(w.get(n, 0.0) for w in usual), 1)
            for n, ms in used.items() if any(n in w for w in usual)}


def per_thread(window: dict) -> dict[str, float]:
    """A ``CpuSampler`` window's ``by_thread`` as ``process/thread`` -> CPU ms."""
    return {f"{n}/{t}": ms for n, threads in window.get("by_thread", {}).items() for t, ms in threads.items()}


def tcp_loss(sampler: TcpLossSampler, per_rank: dict[int, list[Record]], repeats: list[dict],
             windows: list[tuple[float, float | None]], skip: int) -> dict:
    """TCP loss on the emulated hosts (``tcp_loss.TcpLossSampler``) in the communication phases
    of the migrating job: adds to each repeat's record ``tcp_switch`` (over its switch
    iterations) and ``tcp_lead`` (the iteration before them, the old owners' last); returns the
    same per iteration over the iterations outside every migration (after the first ``skip``):
    the iterations counted, retransmitted segments median / p90 / max, and the iterations with
    a retransmission timeout; and ``per_iteration``, every iteration's figures."""
    spans = comm_spans(per_rank)
    for rec in repeats:
        switch = rec.get("switch_iterations")
        if switch is None or switch[0] not in spans or switch[1] not in spans:
            continue
        rec["tcp_switch"] = sampler.window(spans[switch[0]][0], spans[switch[1]][1])
        if switch[0] - 1 in spans:
            rec["tcp_lead"] = sampler.window(*spans[switch[0] - 1])
    busy = busy_iterations(per_rank, windows)
    each = {it: sampler.window(*span) for it, span in sorted(spans.items()) if it > skip}
    quiet = [w for it, w in each.items() if it not in busy]
    # every iteration's [iteration, retransmitted segments, timeouts, in a migration (0/1)]
    per_iteration = [[it, w["RetransSegs"], w["TCPTimeouts"], int(it in busy)] for it, w in each.items()]
    if not quiet:
        return {"iterations": 0, "per_iteration": per_iteration}
    retrans = [q["RetransSegs"] for q in quiet]
    return {"iterations": len(quiet), "retrans_median": statistics.median(retrans),
            "retrans_p90": float(np.percentile(retrans, 90)), "retrans_max": max(retrans),
            "iterations_with_timeout": sum(1 for q in quiet if q["TCPTimeouts"]),
            "softnet_drops": sum(q["softnet_drops"] for q in quiet), "per_iteration": per_iteration}


def new_owner_times(per_rank: dict[int, list[Record]], repeats: list[dict]) -> None:
    """Replaces each repeat's ``switch_seen`` (per batch, the new owner's clock) with
    ``new_owner_ms``: per batch, when its first push and its hand-over came and when its keys'
    first iteration was complete there, in ms after both workers started the switch iteration
    (one machine: the emulated hosts share its clock)."""
    starts: dict[int, list[float]] = {}
    for records in per_rank.values():
        for it, _, s, _ in records:
            starts.setdefault(it, []).append(s)
    for rec in repeats:
        seen, switch = rec.pop("switch_seen", []), rec.get("switch_iterations")
        if not switch or len(starts.get(switch[0], ())) != len(per_rank):
            continue
        start = max(starts[switch[0]])
        rec["new_owner_ms"] = [{k.removesuffix("_at"): round(1e3 * (v - start), 1) for k, v in batch.items()}
                               for batch in seen]


def first_reply(per_rank: dict[int, list[Record]], firsts: dict[int, list[tuple[int, float]]],
                repeats: list[dict], windows: list[tuple[float, float | None]], skip: int) -> dict:
    """How long after both workers started an iteration's communication the first of their
    operations completed (the aggregators' first reply; ms): adds each repeat's
    ``first_reply_ms`` (its first switch iteration; ``cutover_first_reply_ms``: the iteration
    before, the old owners' last) to its record, and returns them with the
    median and p90 over the iterations outside every migration (after the first ``skip``).
    A switch that starts late shows here; one whose transfers are slower does not."""
    starts: dict[int, list[float]] = {}
    for records in per_rank.values():
        for it, _, s, _ in records:
            starts.setdefault(it, []).append(s)
    earliest: dict[int, list[float]] = {}
    for pairs in firsts.values():
        for it, t in pairs:
            earliest.setdefault(it, []).append(t)
    delay = {it: 1e3 * (min(earliest[it]) - max(s)) for it, s in starts.items()
             if len(s) == len(per_rank) and len(earliest.get(it, ())) == len(per_rank)}
    for rec in repeats:
        switch = rec.get("switch_iterations")
        rec["first_reply_ms"] = round(delay[switch[0]], 2) if switch and switch[0] in delay else None
        # the same in the old owners' last iteration
        rec["cutover_first_reply_ms"] = (round(delay[switch[0] - 1], 2) if switch and switch[0] - 1 in delay
                                         else None)
    busy = busy_iterations(per_rank, windows)
    quiet = [d for it, d in delay.items() if it > skip and it not in busy]
    return {"first_reply_ms_per_repeat": [rec["first_reply_ms"] for rec in repeats],
            "first_reply_ms_quiet_median": round(statistics.median(quiet), 2) if quiet else None,
            "first_reply_ms_quiet_p90": round(float(np.percentile(quiet, 90)), 2) if quiet else None}


def end_skew(per_rank: dict[int, list[Record]], skip: int) -> dict:
    """How far apart the workers' iterations end (the latest minus the earliest end of each
    iteration after the first ``skip`` that every rank recorded), median and p90 in ms. The
    worker that ends an iteration later starts the next one later, and the others' next
    communication then includes waiting for its pushes: the excesses, and so the pause
    (their maximum over the workers), inherit this spread with or without a migration."""
    ends: dict[int, list[float]] = {}
    for records in per_rank.values():
        for it, _, _, e in records:
            if it > skip:
                ends.setdefault(it, []).append(e)
    skews = [max(e) - min(e) for e in ends.values() if len(e) == len(per_rank) > 1]
    if not skews:
        return {"worker_end_skew_ms_median": None, "worker_end_skew_ms_p90": None}
    return {"worker_end_skew_ms_median": round(1e3 * statistics.median(skews), 2),
            "worker_end_skew_ms_p90": round(1e3 * float(np.percentile(skews, 90)), 2)}


def neighbour_cost(records: list[list[Record]], windows: list[tuple[float, float | None]], skip: int) -> dict:
    """The neighbour job's median communication and iteration times in its iterations that
    overlap a migration against the others (after its first ``skip``), and the ratios."""
    def overlaps(begin: float, end: float) -> bool:
        return any(end >= t_call and begin <= (t_done if t_done is not None else float("inf"))
                   for t_call, t_done in windows)

    during: dict[str, list[float]] = {"comm": [], "iteration": []}
    outside: dict[str, list[float]] = {"comm": [], "iteration": []}
    for rank_records in records:
        for it, begin, start, end in rank_records:
            if it <= skip:
                continue
            into = during if overlaps(begin, end) else outside
            into["comm"].append(end - start)
            into["iteration"].append(end - begin)
    out: dict = {"iterations_during": len(during["comm"]), "iterations_outside": len(outside["comm"])}
    for kind in ("comm", "iteration"):
        a = statistics.median(during[kind]) if during[kind] else None
        b = statistics.median(outside[kind]) if outside[kind] else None
        out[f"{kind}_ms_during"] = round(1e3 * a, 2) if a is not None else None
        out[f"{kind}_ms_outside"] = round(1e3 * b, 2) if b is not None else None
        out[f"{kind}_ratio"] = round(a / b, 3) if a is not None and b else None
    return out


def main(argv: list[str] | None = None) -> int:
    """``autops bench migrate``: pause a training job sees when all its tensors move live."""
    p = cli.parser("autops bench migrate", description="live migration of all of a job's "
                                "tensors: pause seen by the workers, migration duration, cost to a neighbour job")
    p.add_argument("--model", nargs="+", default=["vgg19"], choices=sorted(ITERATION_S))
    p.add_argument("--mode", nargs="+", default=["sum"], choices=["sum", "server"])
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    p.add_argument("--other", default="resnet50", choices=sorted(ITERATION_S) + ["none"],
                   help="model of a second job (sum mode) on the aggregators the first one moves to and from "
                        "(default resnet50; none: no second job)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of every tensor's elements (default 1.0)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies the models' iteration times")
    p.add_argument("--compute-s", type=float, default=None, help="sleep per iteration (default: the model's)")
    p.add_argument("--repeats", type=int, default=3, help="migrations, back and forth")
    p.add_argument("--warmup", type=int, default=4, help="iterations before the steady stretch (--gap) that precedes the first migration")
    p.add_argument("--gap", type=int, default=5, help="iterations between a migration's end and the next")
    p.add_argument("--skip", type=int, default=2, help="first iterations left out of the baseline")
    p.add_argument("--poll", type=float, default=0.5,
                   help="status poll interval while migrating, seconds (each poll costs pMaster and this "
                        "process CPU that the measured job feels: across emulated hosts at 0.1 s, 20-30 ms "
                        "of pMaster's and 10-15 ms of this process's per iteration of the move)")
    p.add_argument("--prefault-share", type=cli.share, default=PREFAULT_SHARE, metavar="SHARE",
                   help="the aggregators' --prefault-share: share of a core populating memory for keys "
                        "migrating in may take on a host busy for over a second (1: at once)")
    p.add_argument("--reserve", type=cli.size, default="0", metavar="SIZE",
                   help="the aggregators' --reserve: memory each populates when it starts and keeps for what "
                        "arrives and migrates in; the jobs start once every reserve is ready (default 0)")
    p.add_argument("--reserve-shared", type=cli.share, default=RESERVE_SHARED, metavar="SHARE",
                   help=f"the aggregators' --reserve-shared: the share of it made as shared memory for the keys' "
                        f"published buffers (default {RESERVE_SHARED}; 0.67 suits sum mode)")
    p.add_argument("--warm-bytes", type=cli.size, default=None, metavar="SIZE",
                   help="the workers' $AUTOPS_WARM_BYTES: what each TCP connection opened for a move carries "
                        f"to the new owner and back before the switch (default {WARM_BYTES >> 20}M; 0: nothing)")
    p.add_argument("--migrate-timeout", type=float, default=60.0)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--agent-timeout", type=float, default=60.0)
    p.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="pMaster's --heartbeat-timeout: on a loaded machine an aggregator allocating a "
                        "model's memory can miss heartbeats for seconds without being lost")
    p.add_argument("--emulate-hosts", action="store_true",
                   help="every aggregator and worker on an emulated host of its own (root; dlrt_bench.testbed)")
    p.add_argument("--link", default="10gbit", help="emulated hosts: link rate (none: unshaped)")
    p.add_argument("--prefix", default="apsm", help="emulated hosts: name prefix of the testbed")
    add_rps_option(p, "emulated hosts: ")
    # what the samplers cost is taken from the run they measure: at 20 ms, reading /proc as
    # they did before ProcFiles, 174 ms of CPU a second on this 2-core machine
    p.add_argument("--cpu-sample", type=float, default=0.02, metavar="S",
                   help="interval of sampling the machine's and each process's CPU time, seconds "
                        "(about 30 ms of CPU a second at 0.02 with a dozen processes)")
    p.add_argument("--tcp-sample", type=float, default=0.1, metavar="S",
                   help="emulated hosts: interval of sampling each host's TCP loss counters, seconds "
                        "(a window then covers up to S more at each end; about 15 ms of CPU a second "
                        "at 0.1 with a dozen hosts, 65 at 0.02)")
    p.add_argument("--thread-cpu", action="store_true",
                   help="also sample each process's CPU per thread (cpu_switch / cpu_cutover by_thread)")
    add_common_args(p)
    args = parse_args(p, argv)
    exit_on_sigterm()                 # stopped by SIGTERM: the testbed and the processes still go
    if args.link.strip().lower() == "none":
        args.link = None
    if args.emulate_hosts:
        if args.transport in ("shm", "ipc"):
            p.error("--emulate-hosts: shm and ipc cannot reach another host; use auto or tcp")
        reason = available()
        if reason:
            raise RuntimeError(f"--emulate-hosts: emulated hosts unavailable here: {reason}")
    if args.warm_bytes is not None:
        os.environ[WARM_ENV] = str(args.warm_bytes)      # the workers inherit it
    out = cli.text_out(args.json)

    rows = []
    for model in args.model:
        for mode in args.mode:
            row = run_migrate(model, mode, args)
            rows.append(row)
            fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            nbr = row.get("other_job")
            print(f"{model:>9} {mode:<6} {row['keys_moved']} keys ({row['model_bytes'] / 1e6:.0f} MB): pause max "
                  f"{fmt(row['max_pause_ms'])} ms, median {fmt(row['median_pause_ms'])} ms (per repeat "
                  f"{row['pause_ms_per_repeat']}; without a migration: median "
                  f"{fmt(row['quiet_pause_ms_median'])}, p90 {fmt(row['quiet_pause_ms_p90'])} ms; against the "
                  f"workers' median: max {fmt(row['max_pause_vs_worker_ms'])}, median "
                  f"{fmt(row['median_pause_vs_worker_ms'])} ms, without a migration "
                  f"{fmt(row['quiet_pause_vs_worker_ms_median'])} ms; the workers' "
                  f"iterations end {fmt(row['worker_end_skew_ms_median'])} ms apart, p90 "
                  f"{fmt(row['worker_end_skew_ms_p90'])}); whole window max {fmt(row['max_window_excess_ms'])} ms, "
                  f"median {fmt(row['median_window_excess_ms'])} ms; hand-over wait max "
                  f"{fmt(row['max_handover_wait_ms'])} ms, median {fmt(row['median_handover_wait_ms'])} ms, "
                  f"{row['redirects']} redirects; "
                  f"baseline comm {row['baseline_comm_ms']:.1f} ms; "
                  f"migration {row['migration_s']} s; "
                  + (f"{nbr['model']} neighbour: comm x{nbr['comm_ratio']}, iteration x{nbr['iteration_ratio']} "
                     f"during migrations; " if nbr else "")
                  + f"{'all completed' if row['all_completed'] else 'INCOMPLETE'}, {row['wall_s']:.0f}s",
                  file=out, flush=True)
            print(f"{'':>9} the old owners' last iteration (the cutover): excess {row['cutover_ms_per_repeat']} ms, "
                  f"first reply {[r['cutover_first_reply_ms'] for r in row['per_repeat']]} ms after both workers "
                  f"started, the workers ended it {[r['cutover_end_skew_ms'] for r in row['per_repeat']]} ms apart",
                  file=out, flush=True)
            print(f"{'':>9} first reply after both workers started: switch {row['first_reply_ms_per_repeat']} ms; "
                  f"without a migration median {fmt(row['first_reply_ms_quiet_median'])}, p90 "
                  f"{fmt(row['first_reply_ms_quiet_p90'])} ms", file=out, flush=True)
            print(f"{'':>9} goals met: {row['targets_met']}; with no pause at all, this machine's noise "
                  f"would meet them in these shares of runs: {row['noise_only_targets_share']}",
                  file=out, flush=True)
            quiet = row.get("tcp_quiet")
            if quiet and quiet.get("iterations"):
                switch = [r.get("tcp_switch") or {} for r in row["per_repeat"]]
                print(f"{'':>9} tcp: switch iterations retransmitted {[t.get('RetransSegs') for t in switch]} "
                      f"segments, timeouts {[t.get('TCPTimeouts') for t in switch]}; without a migration per "
                      f"iteration median {quiet['retrans_median']:.0f}, p90 {quiet['retrans_p90']:.0f}, "
                      f"timeouts in {quiet['iterations_with_timeout']} of {quiet['iterations']}",
                      file=out, flush=True)
            owners = [r.get("new_owner_ms") for r in row["per_repeat"]]
            if any(owners):
                def span(name: str) -> list:
                    return [max((b.get(name) for b in o if b.get(name) is not None), default=None) if o else None
                            for o in owners]
                print(f"{'':>9} new owners, ms after both workers started the switch: first push "
                      f"{span('first_push')}, hand-over {span('handover')}, first iteration complete "
                      f"{span('done')}", file=out, flush=True)
            cpu = row.get("cpu_quiet")
            if cpu and cpu.get("iterations"):
                switch = [r.get("cpu_switch") or {} for r in row["per_repeat"]]
                most = [max(t["over_after_ms"].items(), key=lambda kv: kv[1], default=None)
                        if t.get("over_after_ms") else None for t in switch]
                print(f"{'':>9} cpu: the VM's host took {[t.get('steal_ms') for t in switch]} ms in the switch "
                      f"iterations; without a migration per iteration median {cpu['steal_ms_median']:.0f}, p90 "
                      f"{cpu['steal_ms_p90']:.0f}, max {cpu['steal_ms_max']:.0f} ms (idle median "
                      f"{cpu['idle_ms_median']:.0f} ms); the process most over its CPU in the iterations after, per switch: "
                      f"{[f'{n} +{ms:.0f} ms' if n else None for n, ms in (m or (None, 0) for m in most)]}",
                      file=out, flush=True)
            warn_background(row, out)
            write_rows([row], args.json, append=args.append or len(rows) > 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
