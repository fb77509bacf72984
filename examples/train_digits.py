"""Train a small CNN on scikit-learn's bundled digits data set (8x8 images, no download).

Alone:            python examples/train_digits.py
With AutoPS:      autops local --aggregators 2 -- torchrun --nproc-per-node 2 examples/train_digits.py
Server-side Adam: ... examples/train_digits.py --mode server --optimizer adam

Each worker trains on its own shard of the training set; the three AutoPS lines are marked.
Prints per-epoch loss, final test accuracy and samples/s; ``--json FILE`` writes them.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import autops.torch as aps


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd")
    parser.add_argument("--mode", choices=["sum", "server"], default="sum")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results of rank 0 here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    aps.init()                                                                   # AutoPS line 1
    rank, world = aps.rank(), aps.size()
    torch.manual_seed(args.seed + rank)          # different init per rank: the broadcast fixes it

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    shard = torch.arange(rank, len(x_tr), world)
    x_tr, y_tr = x_tr[shard], y_tr[shard]

    model = DigitsCNN()
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr or 0.05, momentum=0.9)
    elif args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=args.lr or 2e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr or 2e-3)
    opt = aps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode=args.mode)  # line 2
    aps.broadcast_parameters(model.state_dict(), root_rank=0)                  # AutoPS line 3
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.5)

    gen = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = len(x_tr) // args.batch_size
    samples, train_time, loss_value = 0, 0.0, float("nan")
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_tr), generator=gen)
        start, total = time.perf_counter(), 0.0
        for step in range(steps_per_epoch):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
            samples += len(idx)
        sched.step()
        train_time += time.perf_counter() - start
        loss_value = total / max(1, steps_per_epoch)
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss_value:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    result = {"rank": rank, "world_size": world, "mode": args.mode, "optimizer": args.optimizer,
              "final_loss": loss_value, "test_accuracy": accuracy,
              "samples_per_s": samples / train_time if train_time else 0.0,
              "aggregators": sorted(aps.placement())}
    if rank == 0:
        print(f"test accuracy {accuracy:.4f}  samples/s per worker {result['samples_per_s']:.0f}  "
              f"workers {world}  aggregators {result['aggregators'] or 'none (local)'}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    aps.shutdown()


if __name__ == "__main__":
    main()
