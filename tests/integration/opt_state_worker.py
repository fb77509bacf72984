"""Worker for test_broadcast_optimizer_state: ranks start with different Adam state (one local
step with rank-specific gradients); broadcast_optimizer_state must make rank 0's state the one
training continues from. Usage: opt_state_worker.py MASTER JOB RANK WORLD MODE OUT.npz"""
import sys

import numpy as np
import torch

import autops.torch as aps
from torch_reference import batches, make_model


def local_warmup(model, rank):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    opt.step()
    return opt


def main() -> None:
    master, job, rank, world, mode, out = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    aps.init(master=master, job=job, rank=rank, world_size=world, timeout=30)
    torch.manual_seed(100)
    model = make_model()
    opt = local_warmup(model, rank)
    opt = aps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode=mode)
    aps.broadcast_parameters(model.state_dict(), root_rank=0)
    aps.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in list(batches())[:2]:
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    np.savez(out, **{n: p.detach().numpy() for n, p in model.named_parameters()})
    aps.shutdown()


if __name__ == "__main__":
    main()
