"""``autops bench failover``: what surviving an aggregator's loss costs.

Two measurements on one ``--static`` pool of three aggregators (loopback, this machine), a
W=2 job of the model's tensors (``--scale`` of their sizes), in-process workers (threads):

* **cost** -- iterations of push + pull of every tensor with fault tolerance on and off, in
  ``sum`` mode (each worker keeps a copy of its pushes) and ``server`` mode with Adam (plus a
  replica that receives every step's gradient). On and off alternate ``--repeats`` times in
  the same pool; the median iteration time of each and their ratio (on / off) are reported.
* **pause** -- a job trains, the aggregator owning its largest key is SIGKILLed after
  ``--warmup`` iterations; the longest iteration (the pause the workers saw) against the
  median iteration, with pMaster's ``--heartbeat-timeout``: the pause is that timeout plus the
  recovery (the agents' next probe, the take-over, the replay). In ``server`` mode, per
  surviving aggregator: the serving thread's time and page faults installing whole states as
  a replica, and the memory made ready for them at once (``replica_installs``).

``--json FILE`` writes one object per (measurement, mode) (``-``: stdout).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from typing import Sequence

import numpy as np

from autops.worker.agent import Agent
from autops.wire.jobauth import new_job_secret
from autops.local import LocalPool
from dlrt import cli

from .autops_elastic import scaled_tensors, tensor_bytes


def _job(pool: LocalPool, mode: str, tensors: list, fault_tolerant: bool, iters: int,
         on_iteration=None) -> list[float]:
    """Train one W=2 job for ``iters`` iterations; returns rank 0's iteration times."""
    job = f"ft-{mode}-{uuid.uuid4().hex[:6]}"
    kw = dict(mode=mode, average=True, num_aggregators=2, timeout=60, fault_tolerant=fault_tolerant,
              secret=new_job_secret())
    if mode == "server":
        kw.update(optimizer="adam", hp={"lr": 1e-3})
    agents = [Agent(pool.master, job, r, 2, **kw) for r in range(2)]
    times: list[float] = []
    errors: list[BaseException] = []
    try:
        for a in agents:
            a.declare(tensors)
        if mode == "server":
            for n, s, d in tensors:
                agents[0].init(n, np.zeros(s, d)).wait()
        grads = [{n: np.full(s, 0.001 * (r + 1), d) for n, s, d in tensors} for r in range(2)]
        outs = [{n: np.empty(s, d) for n, s, d in tensors} for _ in range(2)]
        barrier = threading.Barrier(2)

        def work(rank: int) -> None:
            try:
                for it in range(1, iters + 1):
                    barrier.wait()
                    if rank == 0 and on_iteration is not None:
                        on_iteration(it, agents[0])
                    t0 = time.perf_counter()
                    handles = [agents[rank].push_pull(n, grads[rank][n], outs[rank][n], it) for n, _, _ in tensors]
                    for h in handles:
                        h.wait()
                    if rank == 0:
                        times.append(time.perf_counter() - t0)
            except BaseException as exc:  # surfaced below
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    finally:
        for a in agents:
            a.close()
    return times


def measure_cost(pool: LocalPool, mode: str, tensors: list, args: argparse.Namespace) -> dict:
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for on in (False, True):
            runs[on].extend(_job(pool, mode, tensors, on, args.iters)[args.warmup:])
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    return {"measurement": "cost", "model": args.model, "mode": mode, "bytes": tensor_bytes(tensors),
            "iterations": len(runs[True]), "fault_tolerant_s": round(on, 5), "plain_s": round(off, 5),
            "ratio": round(on / off, 4)}


def measure_pause(pool: LocalPool, mode: str, tensors: list, args: argparse.Namespace) -> dict:
    killed: dict = {}

    def kill(it: int, agent: Agent) -> None:
        if it != args.warmup + 1:
            return
        placement = agent.placement()
        sizes = {k: s.nbytes for k, s in agent.table.keys.items()}
        victim = max(placement, key=lambda a: sum(sizes[k] for k in placement[a]))
        pool.aggregators[victim].kill()
        killed.update(agg=victim, keys=len(placement[victim]))

    before = serving_thread_copies(pool)
    times = _job(pool, mode, tensors, True, args.warmup + args.iters, on_iteration=kill)
    steady = statistics.median(times[:args.warmup] + times[args.warmup + 3:])
    time.sleep(2 * min(1.0, args.heartbeat_timeout / 5))      # the counters come with the heartbeats
    after = serving_thread_copies(pool)
    return {"measurement": "pause", "model": args.model, "mode": mode, "heartbeat_timeout_s": args.heartbeat_timeout,
            "killed": killed.get("agg"), "keys_moved": killed.get("keys"), "median_iteration_s": round(steady, 5),
            "pause_s": round(max(times), 4), "recovery_s": round(max(times) - args.heartbeat_timeout, 4),
            # per surviving aggregator, over the job: whole states installed as a replica on the
            # serving thread (seconds, page faults) and memory made ready for them at once
            "replica_installs": {a: {k: round(v - before.get(a, {}).get(k, 0), 4) for k, v in c.items()}
                                 for a, c in after.items() if a != killed.get("agg")}}


COPY_COUNTERS = ("replica_install_s", "replica_install_faults", "at_once_prefaulted_bytes")


def serving_thread_copies(pool: LocalPool) -> dict[str, dict[str, float]]:
    """Each aggregator's ``COPY_COUNTERS`` as its last heartbeat reported them."""
    return {a["id"]: {k: a.get(k, 0) for k in COPY_COUNTERS} for a in pool.status()["aggregators"] if a.get("alive")}


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("autops bench failover", __doc__.split("\n\n")[0])
    cli.add_log_level(p, "WARNING")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--scale", type=cli.positive(float), default=0.25, help="fraction of each tensor's size")
    p.add_argument("--modes", default="sum,server")
    p.add_argument("--iters", type=cli.positive(int), default=20, help="iterations measured per run")
    p.add_argument("--warmup", type=cli.positive(int), default=3)
    p.add_argument("--repeats", type=cli.positive(int), default=3, help="on/off runs alternated, per mode")
    p.add_argument("--heartbeat-timeout", type=cli.positive(float), default=2.0, help="pMaster's, for the pause")
    p.add_argument("--skip", choices=["cost", "pause"], default=None)
    cli.add_json(p)
    args = p.parse_args(argv)
    cli.setup_logging(args.log_level)
    try:
        tensors = scaled_tensors(args.model, args.scale)
    except ValueError as exc:
        p.error(str(exc))
    rows = []
    pool = LocalPool(3, log_level=args.log_level, master_args=["--static", "--heartbeat-timeout", str(args.heartbeat_timeout)],
                     aggregator_args=["--heartbeat-interval", str(min(1.0, args.heartbeat_timeout / 5))])
    with pool:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            if args.skip != "cost":
                rows.append(measure_cost(pool, mode, tensors, args))
                print(rows[-1], file=sys.stderr)
            if args.skip != "pause":
                rows.append(measure_pause(pool, mode, tensors, args))
                print(rows[-1], file=sys.stderr)
                name = rows[-1]["killed"]
                pool.aggregators.pop(name, None)
                pool.add_aggregator(f"{name}-again")
                time.sleep(args.heartbeat_timeout * 1.5)     # the lost one is forgotten, the new one up
    cli.emit(args.json, rows, "\n".join(str(r) for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
