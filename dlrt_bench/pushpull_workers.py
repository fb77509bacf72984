"""The worker processes of ``autops bench pushpull``: AutoPS push+pull, or gloo all-reduce.

``python -m dlrt_bench.pushpull_workers autops|gloo [options]`` sets up (an AutoPS agent
with the model's tensors declared, or a gloo process group), writes one JSON line
``{"ready": true, "pid": PID}`` to stdout and then obeys its stdin, one command per line:
``run N`` runs N more iterations and answers one JSON line with their seconds (``times``),
the CPU seconds the process spent on them (``cpu``) and, from gloo, as many iterations of
the bare all-reduce of the buckets (``reduce_only``); ``stop`` (or the end of
stdin) leaves the job and exits. Any failure is one line ``{"error": "..."}`` and exit
status 1. The benchmark drives the AutoPS and the gloo workers in alternating blocks, so
both see the same background load; the workers may run on emulated hosts (only stdin and
stdout link them to the benchmark).

An AutoPS iteration pushes and pulls every tensor, last layer first as backward produces
them, with one ``push_pull`` per tensor; the first iteration of ``sum`` mode checks the
aggregate. A gloo iteration is DDP's: the tensors in reverse order in 25 MB buckets, each
copied into a flat buffer, all-reduced asynchronously, averaged and copied back.

``--device cuda`` keeps the gradients (and gloo's buckets) on a GPU (rank r on GPU r modulo
the GPUs there are). AutoPS then stages them as ``autops.torch``'s optimizer does
(``DeviceStager``: the copy to a pinned host buffer on a side stream, the push once it is
there, the result copied back into the device tensor; in ``server`` mode the parameters
pulled into pinned buffers and copied to the device), and gloo all-reduces the CUDA buckets
itself. Both iterations end when the device has the results (``torch.cuda.synchronize``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Iterator

import numpy as np

from autops.models import model_tensors

BUCKET_BYTES = 25 * 2**20


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def commands() -> Iterator[int]:
    """The iteration counts of the ``run N`` commands on stdin, until ``stop`` or its end."""
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "stop":
            return
        if words[0] != "run" or len(words) != 2 or not words[1].isdigit():
            raise ValueError(f"unknown command {line.strip()!r} (run N, stop)")
        yield int(words[1])


def seed_parameters(agent, rank: int, tensors, outs: dict) -> None:
    """Server mode: rank 0 initialises every tensor (zeros), then every rank pulls them once."""
    if rank == 0:
        for h in [agent.init(n, np.zeros(s, d)) for n, s, d in tensors]:
            h.wait()
    for h in [agent.pull(n, outs[n], 0) for n, _, _ in tensors]:
        h.wait()


def cuda_device(rank: int):
    """The GPU of ``rank``: one per rank while there are enough, else shared round-robin."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device (torch.cuda.is_available() is False)")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# --- AutoPS ----------------------------------------------------------------------------------
def declared_agent(args: argparse.Namespace, tensors: list):
    """This rank's agent, joined to the job with the model's tensors declared."""
    from autops.worker.agent import Agent
    opts = {"mode": args.mode, "average": True}
    if args.mode == "server":
        opts.update(optimizer=args.optimizer, hp={"lr": 1e-3})
    agent = Agent(args.master, args.job, args.rank, args.world, mode=args.mode, num_aggregators=args.aggregators,
                  transport=args.transport, optimizer=args.optimizer if args.mode == "server" else None,
                  timeout=120)
    try:
        agent.declare([(n, s, d, opts) for n, s, d in tensors])
    except BaseException:
        agent.close()
        raise
    return agent


def autops_worker(args: argparse.Namespace, tensors: list) -> None:
    if args.device == "cuda":
        return autops_cuda_worker(args, tensors)
    agent = declared_agent(args, tensors)
    try:
        grads = {n: np.full(s, args.rank + 1, dtype=d) for n, s, d in tensors}
        outs = {n: np.empty(s, dtype=d) for n, s, d in tensors}
        if args.mode == "server":
            seed_parameters(agent, args.rank, tensors, outs)
        order = list(reversed(tensors))
        iteration = 0

        def one() -> float:
            nonlocal iteration
            iteration += 1
            start = time.perf_counter()
            handles = [agent.push_pull(n, grads[n], outs[n], iteration) for n, _, _ in order]
            agent.flush()
            for h in handles:
                h.wait()
            took = time.perf_counter() - start
            if iteration == 1 and args.mode == "sum":
                check_mean(outs, args.world)
            return took

        serve(one, ready={"partition_bytes": agent.partition_bytes})
        agent.job_done()
    finally:
        agent.close()


def autops_cuda_worker(args: argparse.Namespace, tensors: list) -> None:
    """``autops_worker`` with the gradients on a GPU, staged like ``autops.torch``'s optimizer."""
    import torch
    from autops.worker.device import DeviceStager, host_array
    device = cuda_device(args.rank)
    agent = declared_agent(args, tensors)
    stager = DeviceStager()
    try:
        grads = {n: torch.full(s, float(args.rank + 1), dtype=getattr(torch, d), device=device)
                 for n, s, d in tensors}
        params: dict = {}
        staged: dict = {}
        if args.mode == "server":          # parameters on the GPU, pulled into pinned buffers
            params = {n: torch.zeros_like(g) for n, g in grads.items()}
            staged = {n: stager.buffer(n, "params", g) for n, g in grads.items()}
            seed_parameters(agent, args.rank, tensors, {n: host_array(b).reshape(grads[n].shape)
                                                        for n, b in staged.items()})
        order = list(reversed(tensors))
        iteration = 0

        def one() -> float:
            nonlocal iteration
            iteration += 1
            it = iteration
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            handles = []
            for n, _, _ in order:
                if args.mode == "sum":
                    handles.append(stager.submit(n, grads[n], lambda a, n=n: agent.push_pull(n, a, a, it),
                                                 result=grads[n]))
                else:
                    out = host_array(staged[n])
                    handles.append(stager.submit(n, grads[n], lambda a, n=n, out=out: agent.push_pull(n, a, out, it)))
            for h in handles:
                h.submitted()          # every staged push reached the agent before it flushes
            agent.flush()
            for h in handles:
                h.wait()
            for n, p in params.items():
                p.copy_(staged[n].view(p.shape), non_blocking=True)
            torch.cuda.synchronize(device)
            took = time.perf_counter() - start
            if iteration == 1 and args.mode == "sum":
                check_mean({n: g.cpu().numpy() for n, g in grads.items()}, args.world)
            for g in grads.values():
                g.fill_(float(args.rank + 1))
            return took

        serve(one, ready={"partition_bytes": agent.partition_bytes, "device": str(device)})
        agent.job_done()
    finally:
        stager.close()
        agent.close()


def check_mean(outs: dict, world: int) -> None:
    """Rank r pushed r + 1 everywhere: the mean of the ranks' pushes is (W + 1) / 2."""
    expected = (world + 1) / 2
    for name, out in outs.items():
        flat = out.reshape(-1)
        if flat.size and not (flat[0] == expected and flat[-1] == expected):
            raise RuntimeError(f"wrong aggregate for {name}: {flat[0]} != {expected}")


# --- gloo ------------------------------------------------------------------------------------
def gloo_worker(args: argparse.Namespace, tensors: list) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    device = cuda_device(args.rank) if args.device == "cuda" else torch.device("cpu")

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    try:
        grads = [torch.full(s, float(args.rank + 1), device=device) for _, s, _ in reversed(tensors)]
        buckets, current, size = [], [], 0        # DDP: reverse order, 25 MB buckets
        for g in grads:
            current.append(g)
            size += g.numel() * 4
            if size >= BUCKET_BYTES:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        flats = [torch.empty(sum(g.numel() for g in b), device=device) for b in buckets]

        def reduce_only() -> float:
            synchronize()
            dist.barrier()
            start = time.perf_counter()
            for flat in flats:
                dist.all_reduce(flat)
            synchronize()
            return time.perf_counter() - start

        def one() -> float:
            synchronize()
            dist.barrier()
            start = time.perf_counter()
            works = []
            for bucket, flat in zip(buckets, flats):
                torch.cat([g.reshape(-1) for g in bucket], out=flat)
                works.append(dist.all_reduce(flat, async_op=True))
            for bucket, flat, work in zip(buckets, flats, works):
                work.wait()
                flat.div_(args.world)
                offset = 0
                for g in bucket:
                    g.view(-1).copy_(flat[offset:offset + g.numel()])
                    offset += g.numel()
            synchronize()
            took = time.perf_counter() - start
            for g in grads:
                g.fill_(float(args.rank + 1))
            return took

        serve(one, reduce_only)
    finally:
        dist.destroy_process_group()


def serve(iteration: Callable[[], float], extra: Callable[[], float] | None = None,
          ready: dict | None = None) -> None:
    """Announce readiness (with ``ready``), then run the iterations each ``run N`` asks for."""
    emit({"ready": True, "pid": os.getpid(), **(ready or {})})
    for count in commands():
        cpu = time.process_time()
        answer = {"times": [iteration() for _ in range(count)]}
        answer["cpu"] = time.process_time() - cpu        # every thread of this process
        if extra is not None:
            answer["reduce_only"] = [extra() for _ in range(count)]
        emit(answer)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dlrt_bench.pushpull_workers", description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=["autops", "gloo"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", help="autops: pMaster address")
    parser.add_argument("--job", default="bench")
    parser.add_argument("--aggregators", type=int, default=0)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--mode", default="sum", choices=["sum", "server"])
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--init", help="gloo: tcp://HOST:PORT of rank 0")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the gradients live")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        tensors = model_tensors(args.model, args.shapes)
        (autops_worker if args.system == "autops" else gloo_worker)(args, tensors)
    except BaseException as exc:  # one line for the benchmark, never a hang
        emit({"error": f"{args.system} worker {args.rank}: {exc.__class__.__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
