"""Train a small CNN on scikit-learn's bundled digits data set (8x8 images, no download).

Alone:            python examples/train_digits.py
With AutoPS:      autops local --aggregators 2 -- torchrun --nproc-per-node 2 examples/train_digits.py
Server-side Adam: ... examples/train_digits.py --mode server --optimizer adam
Clipping:         ... examples/train_digits.py --clip-grad-norm 0.1

Each worker trains on its own shard of the training set; the three AutoPS lines are marked.
Prints per-epoch loss, final test accuracy and samples/s; ``--json FILE`` writes them.

Under Tiresias every step's loss goes to the master (``tiresias.job.report``: buffered, one
append a second).

Preemptible (Tiresias): between iterations the job polls ``tiresias.job.should_stop()``; the
ranks agree with ``aps.any_rank`` so that all stop after the same iteration; rank 0 then
saves a checkpoint to ``--checkpoint-dir`` (default: ``tiresias.job.checkpoint_dir()``) and
every rank exits 0 after ``mark_stopped()``. A run that finds a checkpoint there continues
from it exactly (model, optimizer state -- the aggregators' in server mode --, LR scheduler,
position in the epoch and the data-order generator, the only randomness training draws), so
it ends with the parameters of an uninterrupted run.

Elastic (``--global-batch N``, e.g. a Tiresias job submitted with ``--gpus 1-4``): every step
trains on the same N samples of one global data order whatever the world size, each rank on
its contiguous part, its loss scaled so that the averaged gradient is the mean over all N
(Optimus §5.4 keeps the global batch the same way). A checkpoint then resumes at any world
size, at the same step of the same epoch; only the float summation order differs.
``--emulate-gpu S`` makes each step also sleep S / world seconds, standing for a GPU's compute
of the batch, so that a scheduler's benchmark on CPUs sees speeds that scale with the GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import autops.torch as aps
import tiresias.job as tjob

CHECKPOINT_NAME = "train_digits.pt"
RESUME_CONFIG = ("world_size", "batch_size", "seed", "optimizer")   # must match to resume exactly
ELASTIC_RESUME_CONFIG = ("global_batch", "seed", "optimizer")        # --global-batch: any world size


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te), torch.from_numpy(y_te)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--global-batch", type=int, default=None, metavar="N",
                        help="elastic: N samples per step split over the ranks, resumable at any world size")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--lr-step-size", type=int, default=8, help="epochs between halvings of the lr (default 8)")
    parser.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd")
    parser.add_argument("--mode", choices=["sum", "server"], default="sum")
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                        help="clip the averaged gradients by their global norm before each step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulate-gpu", type=float, default=0.0, metavar="SECONDS",
                        help="each step also sleeps SECONDS / world size: the compute of a step's batch on an "
                             "emulated GPU, spread over the ranks (benchmarks of the scheduler on CPUs)")
    parser.add_argument("--json", default=None, help="write the results of rank 0 here")
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None,
                        help="save a checkpoint here when asked to stop, resume from it "
                             "(default: the Tiresias job's checkpoint dir; none: no checkpoints)")
    parser.add_argument("--save-params", type=pathlib.Path, default=None,
                        help="rank 0 writes the final model state_dict here (torch.save)")
    # tests: behave exactly as if should_stop() turned true just before step N (1-based) began,
    # on every rank or only on --stop-rank: the job stops with N steps done (the last step of
    # the last epoch excepted: then it has finished anyway)
    parser.add_argument("--stop-at-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stop-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.global_batch is not None and args.global_batch < 1:
        parser.error(f"--global-batch must be >= 1, got {args.global_batch}")
    if not 0 <= args.emulate_gpu < 60:
        parser.error(f"--emulate-gpu must be from 0 to 60 seconds, got {args.emulate_gpu}")
    if args.checkpoint_dir is None:
        args.checkpoint_dir = tjob.checkpoint_dir()
    return args


def make_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr or 0.05, momentum=0.9)
    if args.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=args.lr or 2e-3)
    return torch.optim.AdamW(model.parameters(), lr=args.lr or 2e-3)


def run_config(args: argparse.Namespace, world: int) -> dict:
    if args.global_batch is not None:
        return {"global_batch": args.global_batch, "seed": args.seed, "optimizer": args.optimizer, "world_size": world}
    return {"world_size": world, "batch_size": args.batch_size, "seed": args.seed, "optimizer": args.optimizer}


def rank_part(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous part of a global batch (sizes differ by at most one)."""
    return torch.tensor_split(batch, world)[rank]


def load_checkpoint(args: argparse.Namespace, world: int) -> dict | None:
    """The checkpoint in ``--checkpoint-dir`` (every rank reads it), or None."""
    if args.checkpoint_dir is None or not (args.checkpoint_dir / CHECKPOINT_NAME).exists():
        return None
    path = args.checkpoint_dir / CHECKPOINT_NAME
    ckpt = torch.load(path, weights_only=False)
    want = run_config(args, world)
    fields = ELASTIC_RESUME_CONFIG if args.global_batch is not None else RESUME_CONFIG
    differ = [f"{k} {ckpt['config'].get(k)} (now {want[k]})" for k in fields if ckpt["config"].get(k) != want[k]]
    if differ:
        print(f"train_digits: cannot resume from {path}: it was saved with {', '.join(differ)}; "
              f"run with the same settings or another --checkpoint-dir", file=sys.stderr)
        sys.exit(2)
    return ckpt


def save_checkpoint(path: pathlib.Path, payload: dict) -> None:
    """Write atomically: a temporary file in the same directory, fsync, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def stop_wanted(args: argparse.Namespace, rank: int, next_step: int) -> bool:
    """This rank's view: did the master ask us to stop (or the test option say so)?"""
    if args.stop_at_step is not None and next_step >= args.stop_at_step and args.stop_rank in (None, rank):
        return True
    return tjob.should_stop()


def preemptible(args: argparse.Namespace) -> bool:
    """Can a stop request come? (the same on every rank; no vote per step otherwise)"""
    return args.stop_at_step is not None or tjob.under_tiresias() or bool(os.environ.get(tjob.ENV_STOP_FILE))


def checkpoint_and_stop(args: argparse.Namespace, rank: int, model: nn.Module, opt: torch.optim.Optimizer,
                        sched: torch.optim.lr_scheduler.LRScheduler, position: dict, rng: torch.Tensor) -> bool:
    """All ranks stop after the same step: rank 0 saves (with every rank's ``rng`` state),
    the ranks agree that it did. Returns False if the checkpoint could not be written."""
    failed = False
    rngs = aps.allgather(rng, "rng") if args.checkpoint_dir is not None else []
    if rank == 0 and args.checkpoint_dir is not None:
        try:
            payload = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "scheduler": sched.state_dict(), "rng": torch.stack(rngs), **position}
            save_checkpoint(args.checkpoint_dir / CHECKPOINT_NAME, payload)
        except Exception as exc:   # reported, and every rank exits 1 instead of claiming a checkpoint
            print(f"train_digits: could not save the checkpoint: {exc}", file=sys.stderr, flush=True)
            failed = True
    failed = aps.any_rank(failed, "checkpoint_failed")        # also a barrier: the file is complete
    if rank == 0 and not failed:
        saved = "checkpoint saved" if args.checkpoint_dir is not None else "no --checkpoint-dir: nothing saved"
        print(f"stopped at step {position['global_step']} ({saved})", flush=True)
    return not failed


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    aps.init()                                                                   # AutoPS line 1
    rank, world = aps.rank(), aps.size()
    torch.manual_seed(args.seed + rank)          # different init per rank: the broadcast fixes it

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    elastic = args.global_batch is not None
    if not elastic:                              # each rank its own shard, --batch-size of it a step
        shard = torch.arange(rank, len(x_tr), world)
        x_tr, y_tr = x_tr[shard], y_tr[shard]
    step_batch = args.global_batch if elastic else args.batch_size

    model = DigitsCNN()
    opt = make_optimizer(args, model)
    opt = aps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode=args.mode,  # line 2
                                   averaged_grads=args.clip_grad_norm is not None)   # server mode: see p.grad
    aps.broadcast_parameters(model.state_dict(), root_rank=0)                  # AutoPS line 3
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=args.lr_step_size, gamma=0.5)

    gen = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = len(x_tr) // step_batch
    if steps_per_epoch < 1:
        sys.exit(f"train_digits: a batch of {step_batch} is larger than the {len(x_tr)} training samples")
    start_epoch, start_step, start_total, resumed_from = 0, 0, 0.0, None
    ckpt = load_checkpoint(args, world)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])      # server mode: root's first step sends it on
        sched.load_state_dict(ckpt["scheduler"])
        # copies: set_state crashes on a view with a storage offset; the data-order generator is
        # the same on every rank, so an elastic run at another world size takes rank 0's
        saved = ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0]
        gen.set_state(saved[0].clone())              # as it was before this epoch's permutation
        if rank < len(ckpt["rng"]):
            torch.set_rng_state(saved[1].clone())
        start_epoch, start_step, start_total = ckpt["epoch"], ckpt["step"], ckpt["epoch_loss_sum"]
        resumed_from = ckpt["global_step"]
        if rank == 0:
            print(f"resumed from step {resumed_from} ({args.checkpoint_dir / CHECKPOINT_NAME})", flush=True)
    voting = preemptible(args)

    samples, train_time, loss_value = 0, 0.0, float("nan")
    preempted, stop_agreed = False, False
    for epoch in range(start_epoch, args.epochs):
        model.train()
        epoch_gen_state = gen.get_state()
        order = torch.randperm(len(x_tr), generator=gen)
        first = start_step if epoch == start_epoch else 0
        start, total = time.perf_counter(), start_total if epoch == start_epoch else 0.0
        for step in range(first, steps_per_epoch):
            done = epoch * steps_per_epoch + step          # steps completed before this one
            if stop_agreed:                                # every rank at the same step
                position = {"config": run_config(args, world), "epoch": epoch, "step": step,
                            "epoch_loss_sum": total, "global_step": done}
                rng = torch.stack([epoch_gen_state, torch.get_rng_state()])    # this rank's
                if not checkpoint_and_stop(args, rank, model, opt, sched, position, rng):
                    aps.shutdown()
                    sys.exit(1)
                preempted = True
                break
            # started before the step, answered after it: the round trip overlaps the step
            stop_vote = aps.any_rank_async(stop_wanted(args, rank, done + 1), "stop") if voting else None
            idx = order[step * step_batch:(step + 1) * step_batch]
            opt.zero_grad()
            if elastic:                                    # averaged over ranks: the mean over the batch
                idx = rank_part(idx, rank, world)
                loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx], reduction="sum") * (world / step_batch)
            else:
                loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            if args.clip_grad_norm is None:
                opt.step()
            else:                                          # Horovod's way: the averaged gradients, clipped
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                with opt.skip_synchronize():
                    opt.step()
            if args.emulate_gpu:
                time.sleep(args.emulate_gpu / world)
            value = loss.item() * (step_batch / (world * len(idx)) if elastic else 1.0)   # this rank's mean
            total += value
            tjob.report(done + 1, value)                   # the master's view, Optimus's loss curve
            samples += len(idx)
            stop_agreed = stop_vote is not None and stop_vote()
        train_time += time.perf_counter() - start
        if preempted:
            break
        sched.step()
        loss_value = total / max(1, steps_per_epoch)
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss_value:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    result = {"rank": rank, "world_size": world, "mode": args.mode, "optimizer": args.optimizer,
              "final_loss": loss_value, "test_accuracy": accuracy,
              "samples_per_s": samples / train_time if train_time else 0.0,
              "aggregators": sorted(aps.placement()), "resumed_from_step": resumed_from, "preempted": preempted,
              "transport": os.environ.get("AUTOPS_TRANSPORT", "auto")}
    if rank == 0:
        if not preempted:
            print(f"test accuracy {accuracy:.4f}  samples/s per worker {result['samples_per_s']:.0f}  "
                  f"workers {world}  aggregators {result['aggregators'] or 'none (local)'}", flush=True)
            if args.save_params:
                torch.save(model.state_dict(), args.save_params)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    aps.shutdown()
    if preempted:
        tjob.mark_stopped()


if __name__ == "__main__":
    main()
