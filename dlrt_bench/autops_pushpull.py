"""``autops bench pushpull``: one training iteration's push+pull of a model's tensors, next
to ``torch.distributed`` gloo all-reduce of the same tensors in DDP-style 25 MB buckets,
measured in the same run on this machine.

Per configuration (model x workers x transport x mode) it starts a fresh local pool, runs
``W`` worker processes that push and pull every tensor (last layer first, as backward
produces them) for ``--iters`` iterations, and reports the median seconds per iteration,
gloo's median for the same tensors, their ratio, and the aggregators' peak RSS (VmHWM)
relative to the model's size. ``--json FILE`` writes one object per configuration (``-``:
stdout). Model shapes come from ``autops.models``.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import sys
import time
import uuid

import numpy as np

from autops.local import LocalPool, free_port
from autops.models import model_tensors
from dlrt import cli
from dlrt.procs import join_or_kill

BUCKET_BYTES = 25 * 2**20



def seed_parameters(agent, rank: int, tensors, outs: dict) -> None:
    """Server mode: rank 0 initialises every tensor (zeros), then every rank pulls them once."""
    if rank == 0:
        for h in [agent.init(n, np.zeros(s, d)) for n, s, d in tensors]:
            h.wait()
    for h in [agent.pull(n, outs[n], 0) for n, _, _ in tensors]:
        h.wait()

def _median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup else times)


# --- AutoPS worker -------------------------------------------------------------------------
def _autops_worker(master, job, rank, world, tensors, iters, transport, mode, optimizer, aggregators, queue):
    try:
        from autops.agent import Agent
        opts = {"mode": mode, "average": True}
        if mode == "server":
            opts.update(optimizer=optimizer, hp={"lr": 1e-3})
        agent = Agent(master, job, rank, world, mode=mode, num_aggregators=aggregators, transport=transport,
                      optimizer=optimizer if mode == "server" else None, timeout=120)
        agent.declare([(n, s, d, opts) for n, s, d in tensors])
        grads = {n: np.full(s, rank + 1, dtype=d) for n, s, d in tensors}
        outs = {n: np.empty(s, dtype=d) for n, s, d in tensors}
        if mode == "server":
            seed_parameters(agent, rank, tensors, outs)
        times = []
        order = list(reversed(tensors))
        for it in range(1, iters + 1):
            start = time.perf_counter()
            handles = [agent.push_pull(n, grads[n], outs[n], it) for n, _, _ in order]
            agent.flush()
            for h in handles:
                h.wait()
            times.append(time.perf_counter() - start)
            if it == 1 and mode == "sum":
                expected = (world + 1) / 2
                for n, _, _ in tensors:
                    flat = outs[n].reshape(-1)
                    if flat.size and not (flat[0] == expected and flat[-1] == expected):
                        raise RuntimeError(f"wrong aggregate for {n}: {flat[0]} != {expected}")
        queue.put(("ok", rank, times))
        agent.job_done()
        agent.close()
    except BaseException as exc:  # report, never hang the parent
        queue.put(("error", rank, f"{exc.__class__.__name__}: {exc}"))


def _collect(procs: list, queue, label: str) -> dict:
    """Start ``procs``, gather one ``(status, rank, payload)`` per worker, always reap them."""
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            status, rank, payload = queue.get(timeout=600)
            if status != "ok":
                raise RuntimeError(f"{label} worker {rank} failed: {payload}")
            results[rank] = payload
    finally:
        join_or_kill(procs, timeout=10)
    return results


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
    """Samples ``owned_rss`` of some processes every ``period`` seconds; keeps the peak sum."""

    def __init__(self, pids: list[int], period: float = 0.05) -> None:
        import threading
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


def run_autops(tensors, world: int, transport: str, iters: int, warmup: int, aggregators: int,
               mode: str = "sum", optimizer: str = "adam", log_level: str = "WARNING") -> dict:
    ctx = mp.get_context("spawn")
    with LocalPool(aggregators, log_level=log_level) as pool:
        agg_pids = [p.pid for p in pool.procs[1:]]
        idle_rss = sum(_peak_rss(pid) for pid in agg_pids)
        queue = ctx.Queue()
        job = f"bench-{uuid.uuid4().hex[:6]}"
        procs = [ctx.Process(target=_autops_worker, args=(pool.master, job, r, world, tensors, iters, transport,
                                                          mode, optimizer, aggregators, queue))
                 for r in range(world)]
        idle_owned = sum(owned_rss(pid) for pid in agg_pids)
        with RssSampler(agg_pids) as sampler:
            results = _collect(procs, queue, "AutoPS")
        peak_rss = sum(_peak_rss(pid) for pid in agg_pids)
    per_iter = [max(results[r][i] for r in results) for i in range(iters)]
    return {"autops_s": _median_after_warmup(per_iter, warmup), "autops_iters_s": per_iter,
            "agg_peak_rss_bytes": peak_rss, "agg_idle_rss_bytes": idle_rss,
            "agg_peak_owned_bytes": sampler.peak, "agg_idle_owned_bytes": idle_owned}


# --- gloo peer ------------------------------------------------------------------------------
def _gloo_worker(rank, world, port, tensors, iters, queue):
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        grads = [torch.full(s, float(rank + 1)) for _, s, _ in reversed(tensors)]
        buckets, current, size = [], [], 0        # DDP: reverse order, 25 MB buckets
        for g in grads:
            current.append(g)
            size += g.numel() * 4
            if size >= BUCKET_BYTES:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        flats = [torch.empty(sum(g.numel() for g in b)) for b in buckets]
        times, reduce_only = [], []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            for flat in flats:
                dist.all_reduce(flat)
            reduce_only.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            works = []
            for bucket, flat in zip(buckets, flats):
                torch.cat([g.reshape(-1) for g in bucket], out=flat)
                works.append(dist.all_reduce(flat, async_op=True))
            for bucket, flat, work in zip(buckets, flats, works):
                work.wait()
                flat.div_(world)
                offset = 0
                for g in bucket:
                    g.view(-1).copy_(flat[offset:offset + g.numel()])
                    offset += g.numel()
            times.append(time.perf_counter() - start)
            for g in grads:
                g.fill_(float(rank + 1))
        dist.destroy_process_group()
        queue.put(("ok", rank, (times, reduce_only)))
    except BaseException as exc:
        queue.put(("error", rank, f"{exc.__class__.__name__}: {exc}"))


def run_gloo(tensors, world: int, iters: int, warmup: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, tensors, iters, queue)) for r in range(world)]
    results = _collect(procs, queue, "gloo")
    per_iter = [max(results[r][0][i] for r in results) for i in range(iters)]
    reduce_only = [max(results[r][1][i] for r in results) for i in range(iters)]
    return {"gloo_s": _median_after_warmup(per_iter, warmup), "gloo_iters_s": per_iter,
            "gloo_allreduce_only_s": _median_after_warmup(reduce_only, warmup)}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("autops bench pushpull", __doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", nargs="+", default=["flat64m", "resnet50", "bert-base", "vgg19"])
    parser.add_argument("--transport", nargs="+", default=["ipc", "tcp"], choices=["ipc", "tcp", "shm"])
    parser.add_argument("--mode", nargs="+", default=["sum"], choices=["sum", "server"])
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"],
                        help="server-side optimizer in server mode")
    parser.add_argument("--aggregators", type=int, default=2)
    parser.add_argument("--compare", choices=["gloo", "none"], default="gloo")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--shapes", default=None,
                        help="tensor shapes JSON (default: $AUTOPS_TENSOR_SHAPES, else shared/data/models)")
    cli.add_log_level(parser, "WARNING")
    cli.add_json(parser, "write JSON lines, one per configuration, to FILE ('-' for stdout; the "
                         "progress lines then go to stderr)")
    args = parser.parse_args(argv)
    cli.setup_logging(args.log_level)
    out = cli.text_out(args.json)
    try:
        shapes = {model: model_tensors(model, args.shapes) for model in args.model}
    except ValueError as exc:
        parser.error(str(exc))

    rows = []
    for model in args.model:
        tensors = shapes[model]
        model_bytes = sum(math.prod(s) * 4 for _, s, _ in tensors)
        for world in args.workers:
            gloo = run_gloo(tensors, world, args.iters, args.warmup) if args.compare == "gloo" else {}
            for transport in args.transport:
                for mode in args.mode:
                    res = run_autops(tensors, world, transport, args.iters, args.warmup, args.aggregators,
                                     mode, args.optimizer, args.log_level)
                    row = {"model": model, "workers": world, "transport": transport, "mode": mode,
                           "optimizer": args.optimizer if mode == "server" else None,
                           "aggregators": args.aggregators, "tensors": len(tensors), "model_bytes": model_bytes,
                           "autops_s": res["autops_s"], "gloo_s": gloo.get("gloo_s"),
                           "gloo_allreduce_only_s": gloo.get("gloo_allreduce_only_s"),
                           "ratio": res["autops_s"] / gloo["gloo_s"] if gloo else None,
                           "agg_peak_rss_bytes": res["agg_peak_rss_bytes"],
                           "agg_peak_rss_over_model": res["agg_peak_rss_bytes"] / model_bytes,
                           "agg_idle_rss_bytes": res["agg_idle_rss_bytes"],
                           "agg_peak_owned_bytes": res["agg_peak_owned_bytes"],
                           "agg_owned_over_model":
                               (res["agg_peak_owned_bytes"] - res["agg_idle_owned_bytes"]) / model_bytes,
                           "iters": args.iters, "warmup": args.warmup}
                    rows.append(row)
                    ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
                    gloo_ms = f"{row['gloo_s'] * 1e3:8.1f}" if row["gloo_s"] else "       -"
                    print(f"{model:>9} W={world} {transport:<4} {mode:<6} autops {row['autops_s'] * 1e3:8.1f} ms  "
                          f"gloo {gloo_ms} ms  ratio {ratio}  aggregator memory {row['agg_owned_over_model']:.2f}x model "
                          f"(peak RSS {row['agg_peak_rss_over_model']:.2f}x incl. mapped worker buffers)", file=out, flush=True)
    if args.json:
        cli.write_json(args.json, rows, lines=True)
        if args.json != "-":
            print(f"wrote {len(rows)} configurations to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
