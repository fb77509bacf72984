"""``bench/autops_torch_step.py``: one training step through ``autops.torch`` against DDP over gloo.

One step is what a training script's loop body does -- ``zero_grad``, forward, backward,
``step`` -- on the same model and the same data, for each variant of the
``DistributedOptimizer`` contract and for its peer, ``torch.nn.parallel.DistributedDataParallel``
over gloo:

* ``sum``: plain ``DistributedOptimizer`` (mean gradient back, the local optimizer steps);
* ``sum-clip``: ``opt.synchronize()``, ``clip_grad_norm_``, ``with opt.skip_synchronize(): opt.step()``;
* ``server``: ``mode="server"`` (the aggregators run the SGD, the workers pull parameters);
* ``server-averaged``: ``mode="server", averaged_grads=True`` with the same clipping idiom (one
  more push and pull of every gradient per step);
* ``sum-accumulate``: ``backward_passes_per_step=2``, the batch in two half micro-batches;
* ``ddp`` / ``ddp-clip`` / ``ddp-accumulate``: DDP's plain step, clipping straight after
  backward, and the first micro-batch under ``no_sync()`` -- the peer of each idiom;
* ``local``: each worker alone, a plain optimizer and no communication (the compute floor).

Every variant is a job of its own (its own ``AUTOPS_JOB`` and secret, or its own gloo process
group) of ``W`` worker processes (``python -m dlrt_bench.torch_step VARIANT ...``, one thread
of torch each) against one local pool (``LocalPool``: pMaster and ``A`` aggregators, static).
All groups start up front and warm up; then the variants run in alternating blocks
(``--rounds``, the order reversed every other round), so a change in the machine's background
load hits them all. Each block starts with a barrier among its ranks; a step's time is the
slowest rank's. Per variant it reports the median and p90 step time, steps/s (measured steps
over the blocks' wall time), the CPU time per step (workers, and for AutoPS the aggregators),
and the ratios of the median to DDP's, to ``sum``'s and to the variant's peer idiom. Two
probes give the fixed cost of one tiny collective: ``autops_small_round_trip_ms`` (a summed
``push_pull`` of one float per parameter tensor, the size of the per-step usage mask) and
``gloo_small_allreduce_ms`` (a gloo all-reduce of the same tensor).

Worker protocol (stdin/stdout, as ``pushpull_workers``): one JSON line ``{"ready": true, ...}``
after setup, then per command line ``run N`` -> ``{"times": [...], "wall": s, "cpu": s,
"loss": x}``, ``probe N`` -> ``{"probe": [...]}``, ``stop`` (or the end of stdin) -> leave the
job and exit; a failure is one ``{"error": "..."}`` line and exit status 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator, Sequence

from .answers import read_answers, stop_workers
from .autops_pushpull import cpu_seconds

__all__ = ["VARIANTS", "MODELS", "PEER", "main", "worker_main", "summarize"]

# variant -> (system, options); options of DistributedOptimizer for autops
VARIANTS: dict[str, tuple[str, dict]] = {
    "local": ("local", {}),
    "sum": ("autops", {"mode": "sum"}),
    "sum-clip": ("autops", {"mode": "sum"}),
    "server": ("autops", {"mode": "server"}),
    "server-averaged": ("autops", {"mode": "server", "averaged_grads": True}),
    "sum-accumulate": ("autops", {"mode": "sum", "backward_passes_per_step": 2}),
    "ddp": ("ddp", {}),
    "ddp-clip": ("ddp", {}),
    "ddp-accumulate": ("ddp", {}),
}
CLIPPING = {"sum-clip", "server-averaged", "ddp-clip"}
ACCUMULATING = {"sum-accumulate", "ddp-accumulate"}
# the DDP step doing the same work as an autops variant
PEER = {"sum": "ddp", "sum-clip": "ddp-clip", "server": "ddp", "server-averaged": "ddp-clip",
        "sum-accumulate": "ddp-accumulate"}
# model -> (width, layers) of a stack of Linear(width, width) layers with ReLU between them
MODELS = {"mlp": (512, 8), "many-small": (64, 60)}
CLIP_NORM = 1.0
DATA_BATCHES = 4          # distinct batches per rank, cycled
ANSWER_TIMEOUT = 300.0    # seconds a setup or a block may take


# --- the worker ---------------------------------------------------------------------------------
def build_model(width: int, layers: int):
    """The same initial weights in every process: ``layers`` Linear(width, width), ReLU between."""
    import torch
    torch.manual_seed(0)
    mods: list = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def rank_batches(width: int, batch: int, rank: int) -> list:
    """This rank's share of the data: ``DATA_BATCHES`` (input, target) pairs, the same in every variant."""
    import torch
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))
            for _ in range(DATA_BATCHES)]


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def commands() -> Iterator[tuple[str, int]]:
    """``(run|probe, N)`` from stdin until ``stop`` or its end."""
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "stop":
            return
        if words[0] not in ("run", "probe") or len(words) != 2 or not words[1].isdigit():
            raise ValueError(f"unknown command {line.strip()!r} (run N, probe N, stop)")
        yield words[0], int(words[1])


class Worker:
    """One rank of one variant: its model, optimizer and step."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        torch.set_num_threads(1)
        self.torch = torch
        self.args = args
        self.variant = args.variant
        self.system, self.options = VARIANTS[args.variant]
        self.model = build_model(args.width, args.layers)
        self.tensors = len(list(self.model.parameters()))
        self.data = rank_batches(args.width, args.batch, args.rank)
        self.n = 0
        self.loss = None
        self.ddp = None
        sgd = dict(lr=args.lr, momentum=0.9)
        if self.system == "autops":
            import autops.torch as aps
            self.aps = aps
            aps.init()          # AUTOPS_MASTER, AUTOPS_JOB, AUTOPS_JOB_SECRET, RANK, WORLD_SIZE
            self.opt = aps.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), **sgd),
                                                named_parameters=self.model.named_parameters(), **self.options)
            aps.broadcast_parameters(self.model.state_dict(), root_rank=0)
            self.net = self.model
        elif self.system == "ddp":
            import torch.distributed as dist
            self.dist = dist
            dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
            self.net = self.ddp
            self.opt = torch.optim.SGD(self.ddp.parameters(), **sgd)
        else:
            self.net = self.model
            self.opt = torch.optim.SGD(self.model.parameters(), **sgd)
        self.step = {"sum-clip": self._clip_step, "server-averaged": self._clip_step, "ddp-clip": self._ddp_clip_step,
                     "sum-accumulate": self._accumulate_step,
                     "ddp-accumulate": self._ddp_accumulate_step}.get(self.variant, self._plain_step)

    # the steps: what a script's loop body does
    def _batch(self):
        x, y = self.data[self.n % len(self.data)]
        self.n += 1
        return x, y

    def _forward_backward(self, x, y, scale: float = 1.0):
        loss = self.torch.nn.functional.mse_loss(self.net(x), y)
        (loss * scale if scale != 1.0 else loss).backward()
        return loss

    def _plain_step(self) -> None:
        x, y = self._batch()
        self.opt.zero_grad()
        self.loss = self._forward_backward(x, y)
        self.opt.step()

    def _clip_step(self) -> None:
        x, y = self._batch()
        self.opt.zero_grad()
        self.loss = self._forward_backward(x, y)
        self.opt.synchronize()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        with self.opt.skip_synchronize():
            self.opt.step()

    def _ddp_clip_step(self) -> None:
        x, y = self._batch()
        self.opt.zero_grad()
        self.loss = self._forward_backward(x, y)
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        self.opt.step()

    def _accumulate_step(self) -> None:
        x, y = self._batch()
        half = x.shape[0] // 2
        self.opt.zero_grad()
        self._forward_backward(x[:half], y[:half], 0.5)
        self.loss = self._forward_backward(x[half:], y[half:], 0.5)
        self.opt.step()

    def _ddp_accumulate_step(self) -> None:
        x, y = self._batch()
        half = x.shape[0] // 2
        self.opt.zero_grad()
        with self.ddp.no_sync():
            self._forward_backward(x[:half], y[:half], 0.5)
        self.loss = self._forward_backward(x[half:], y[half:], 0.5)
        self.opt.step()

    # the commands
    def barrier(self) -> None:
        if self.system == "autops":
            self.aps.any_rank(False, "bench.block")
        elif self.system == "ddp":
            self.dist.barrier()

    def run(self, count: int) -> dict:
        self.barrier()
        cpu = time.process_time()
        start = time.perf_counter()
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - start
        return {"times": times, "wall": wall, "cpu": time.process_time() - cpu,
                "loss": float(self.loss.item()) if self.loss is not None else None}

    def probe(self, count: int) -> dict:
        """``count`` tiny collectives of one float per parameter tensor (the usage mask's size)."""
        torch = self.torch
        vote = torch.zeros(self.tensors)
        times = []
        self.barrier()
        for _ in range(count):
            t0 = time.perf_counter()
            if self.system == "autops":
                self.aps.push_pull(vote, "bench.probe", average=False)
            elif self.system == "ddp":
                self.dist.all_reduce(vote)
            times.append(time.perf_counter() - t0)
        return {"probe": times}

    def close(self) -> None:
        if self.system == "autops":
            self.aps.shutdown()
        elif self.system == "ddp":
            self.dist.destroy_process_group()


def worker_parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlrt_bench.torch_step", description="one rank of one variant")
    p.add_argument("variant", choices=list(VARIANTS))
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--init", help="ddp: tcp://HOST:PORT of rank 0")
    return p.parse_args(argv)


def worker_main(argv: Sequence[str] | None = None) -> int:
    args = worker_parse(argv)
    worker = None
    try:
        worker = Worker(args)
        emit({"ready": True, "pid": os.getpid(), "tensors": worker.tensors,
              "params": sum(p.numel() for p in worker.model.parameters())})
        for command, count in commands():
            emit(worker.run(count) if command == "run" else worker.probe(count))
        worker.close()
    except BaseException as exc:      # one line for the benchmark, never a hang
        emit({"error": f"{args.variant} worker {args.rank}: {exc.__class__.__name__}: {exc}"})
        return 1
    return 0


# --- the driver -----------------------------------------------------------------------------------
class Group:
    """The ``W`` worker processes of one variant, driven over their stdin and stdout."""

    def __init__(self, variant: str, procs: list[subprocess.Popen], timeout: float) -> None:
        self.variant, self.procs, self.timeout = variant, procs, timeout
        self.ready: list[dict] | None = None

    def send(self, line: str) -> None:
        for proc in self.procs:
            proc.stdin.write((line + "\n").encode())
            proc.stdin.flush()

    def answers(self) -> list[dict]:
        """One JSON line from every rank (``read_answers``)."""
        return read_answers(self.procs, self.timeout, self.variant)

    def ask(self, line: str) -> list[dict]:
        self.send(line)
        return self.answers()

    def close(self, timeout: float = 20.0) -> None:
        stop_workers(self.procs, timeout)


def start_group(variant: str, world: int, shape: tuple[int, int, int], lr: float, base_env: dict,
                master: str | None, timeout: float) -> Group:
    """Start (not wait for) the ``world`` processes of ``variant``."""
    from autops.config import SECRET_ENV
    from autops.wire.jobauth import new_job_secret
    from autops.local import free_port
    from dlrt.procs import die_with_parent
    system = VARIANTS[variant][0]
    width, layers, batch = shape
    env = dict(base_env)
    extra: list[str] = []
    if system == "autops":
        env.update({"AUTOPS_MASTER": master, "AUTOPS_JOB": f"step-{variant}-{uuid.uuid4().hex[:6]}",
                    SECRET_ENV: new_job_secret(), "WORLD_SIZE": str(world)})   # as a launcher sets them
    elif system == "ddp":
        extra = ["--init", f"tcp://127.0.0.1:{free_port()}"]
    procs = []
    try:
        for rank in range(world):
            argv = [sys.executable, "-m", "dlrt_bench.torch_step", variant, "--rank", str(rank), "--world", str(world),
                    "--width", str(width), "--layers", str(layers), "--batch", str(batch), "--lr", str(lr), *extra]
            procs.append(subprocess.Popen(argv, env={**env, "RANK": str(rank)}, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, preexec_fn=die_with_parent))
    except BaseException:
        from dlrt.procs import stop_processes
        stop_processes(procs)
        raise
    return Group(variant, procs, timeout)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * 0.9
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Measured:
    def __init__(self) -> None:
        self.steps: list[float] = []      # the slowest rank's time of each step
        self.wall = 0.0                   # the slowest rank's wall time of each block, summed
        self.cpu = 0.0
        self.loss: float | None = None

    def add(self, answers: list[dict], aggregators_cpu: float) -> None:
        count = len(answers[0]["times"])
        self.steps += [max(a["times"][i] for a in answers) for i in range(count)]
        self.wall += max(a["wall"] for a in answers)
        self.cpu += sum(a["cpu"] for a in answers) + aggregators_cpu
        self.loss = answers[0]["loss"]


def measure_model(args: argparse.Namespace, model: str, pool: Any, out: Any) -> list[dict]:
    """Every variant on ``model``: one row each."""
    width, layers = MODELS[model]
    width, layers = args.width or width, args.layers or layers
    shape = (width, layers, args.batch)
    groups: dict[str, Group] = {}
    measured = {v: Measured() for v in args.variants}
    probes: dict[str, float] = {}
    aggregator_pids = [proc.pid for proc in pool.aggregators.values()]
    try:
        for variant in args.variants:       # all start together, then each announces itself
            groups[variant] = start_group(variant, args.workers, shape, args.lr, pool.env, pool.master, args.timeout)
        for group in groups.values():
            group.ready = group.answers()
        for group in groups.values():
            if args.warmup:
                group.ask(f"run {args.warmup}")
        per_block = max(1, math.ceil(args.steps / args.rounds))
        left = {v: args.steps for v in args.variants}
        for r in range(args.rounds):
            for variant in (args.variants if r % 2 == 0 else args.variants[::-1]):
                count = min(per_block, left[variant])
                if count <= 0:
                    continue
                left[variant] -= count
                system = VARIANTS[variant][0]
                pids = aggregator_pids if system == "autops" else []
                cpu0 = cpu_seconds(pids)
                answers = groups[variant].ask(f"run {count}")
                measured[variant].add(answers, cpu_seconds(pids) - cpu0)
        for variant, label in (("sum", "autops_small_round_trip_ms"), ("ddp", "gloo_small_allreduce_ms")):
            if variant in groups and args.probes:
                answers = groups[variant].ask(f"probe {args.probes}")
                probes[label] = statistics.median(max(a["probe"][i] for a in answers)
                                                  for i in range(args.probes)) * 1e3
    finally:
        for group in groups.values():
            group.close()
    ready = next(iter(groups.values())).ready[0]
    base = {"model": model, "width": width, "layers": layers, "tensors": ready["tensors"], "params": ready["params"],
            "workers": args.workers, "aggregators": args.aggregators, "batch_per_worker": args.batch,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads_per_worker": 1,
            "autops_small_round_trip_ms": probes.get("autops_small_round_trip_ms"),
            "gloo_small_allreduce_ms": probes.get("gloo_small_allreduce_ms")}
    rows = summarize(base, measured)
    print(table(rows), file=out, flush=True)
    return rows


def summarize(base: dict, measured: dict[str, Measured]) -> list[dict]:
    """One row per variant, with the ratios of its median to DDP's, ``sum``'s and its peer's."""
    medians = {v: statistics.median(m.steps) for v, m in measured.items()}
    rows = []
    for variant, m in measured.items():
        median = medians[variant]
        peer = PEER.get(variant)

        def ratio(other: str | None) -> float | None:
            return median / medians[other] if other in medians else None
        rows.append({**base, "variant": variant, "system": VARIANTS[variant][0],
                     "median_ms": median * 1e3, "p90_ms": p90(m.steps) * 1e3,
                     "mean_ms": statistics.fmean(m.steps) * 1e3, "steps_per_s": len(m.steps) / m.wall,
                     "cpu_ms_per_step": m.cpu / len(m.steps) * 1e3,
                     "ratio_to_ddp": ratio("ddp") if variant != "ddp" else 1.0,
                     "ratio_to_sum": ratio("sum") if VARIANTS[variant][0] == "autops" else None,
                     "peer": peer, "ratio_to_peer": ratio(peer),
                     "final_loss": m.loss, "steps_ms": [t * 1e3 for t in m.steps]})
    return rows


def table(rows: list[dict]) -> str:
    first = rows[0]
    lines = [f"model {first['model']}: {first['layers']} x Linear({first['width']}, {first['width']}) = "
             f"{first['tensors']} tensors, {first['params'] / 1e6:.2f}M params; W={first['workers']} "
             f"A={first['aggregators']}, batch {first['batch_per_worker']}/worker, {first['steps']} steps after "
             f"{first['warmup']} warm-up, {first['rounds']} rounds",
             f"{'variant':<16}{'median ms':>10}{'p90 ms':>9}{'steps/s':>9}{'/ddp':>7}{'/sum':>7}"
             f"{'/peer':>7}  {'peer':<15}{'cpu ms/step':>11}"]

    def fmt(x: float | None, width: int = 7) -> str:
        return f"{x:>{width}.2f}" if x is not None else f"{'-':>{width}}"
    for row in rows:
        lines.append(f"{row['variant']:<16}{row['median_ms']:>10.2f}{row['p90_ms']:>9.2f}{row['steps_per_s']:>9.1f}"
                     f"{fmt(row['ratio_to_ddp'])}{fmt(row['ratio_to_sum'])}{fmt(row['ratio_to_peer'])}  "
                     f"{row['peer'] or '-':<15}{row['cpu_ms_per_step']:>11.1f}")
    probes = []
    if first["autops_small_round_trip_ms"] is not None:
        probes.append(f"autops small round trip {first['autops_small_round_trip_ms']:.3f} ms")
    if first["gloo_small_allreduce_ms"] is not None:
        probes.append(f"gloo small all-reduce {first['gloo_small_allreduce_ms']:.3f} ms")
    if probes:
        lines.append(f"({first['tensors']} floats: " + ", ".join(probes) + ")")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from autops.local import LocalPool
    from dlrt import cli
    from dlrt.procs import exit_on_sigterm
    from .pushpull_sites import MASTER_ARGS
    parser = cli.parser("bench/autops_torch_step.py", __doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["mlp"], choices=list(MODELS),
                        help="mlp: 8 x Linear(512, 512); many-small: 60 x Linear(64, 64)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT",
                        help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--workers", type=cli.positive(int), default=2)
    parser.add_argument("--aggregators", type=cli.positive(int), default=2)
    parser.add_argument("--steps", type=cli.positive(int), default=60, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=10, help="steps per variant before measuring")
    parser.add_argument("--rounds", type=cli.positive(int), default=3,
                        help="blocks each variant's steps are split into, the variants alternating")
    parser.add_argument("--batch", type=cli.positive(int), default=32, help="samples per worker per step")
    parser.add_argument("--width", type=cli.positive(int), default=None, help="override the model's layer width")
    parser.add_argument("--layers", type=cli.positive(int), default=None, help="override the model's layer count")
    parser.add_argument("--lr", type=cli.positive(float), default=0.01)
    parser.add_argument("--probes", type=int, default=50,
                        help="tiny collectives timed in the sum and ddp groups (0: none)")
    parser.add_argument("--timeout", type=cli.positive(float), default=ANSWER_TIMEOUT,
                        help="seconds a group may take to set up or to run one block")
    cli.add_log_level(parser, "WARNING")
    cli.add_json(parser, "write JSON lines, one per model and variant, to FILE ('-' for stdout; the table "
                         "then goes to stderr)")
    args = parser.parse_args(argv)
    if any(v in ACCUMULATING for v in args.variants) and args.batch < 2:
        parser.error("--batch must be at least 2 for the accumulating variants (two half micro-batches)")
    args.variants = list(dict.fromkeys(args.variants))
    cli.setup_logging(args.log_level)
    exit_on_sigterm()
    out = cli.text_out(args.json)
    rows: list[dict] = []
    for model in args.model:
        with LocalPool(args.aggregators, log_level=args.log_level, master_args=MASTER_ARGS) as pool:
            rows += measure_model(args, model, pool, out)
        if args.json and args.json != "-":
            cli.write_json(args.json, rows, lines=True)       # kept if a later model fails
    if args.json == "-":
        cli.write_json(args.json, rows, lines=True)
    elif args.json:
        print(f"wrote {len(rows)} rows to {args.json}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
