"""A worker process for test_torch_api: trains a tiny model through autops.torch and saves
its final parameters. Usage: torch_worker.py MASTER JOB RANK WORLD MODE OPTIMIZER OUT.npz
($AUTOPS_TEST_DEVICE=cuda trains on the GPU)."""
import os
import sys

import numpy as np
import torch

import autops.torch as aps
from torch_reference import batches, make_model, make_optimizer


def main() -> None:
    master, job, rank, world, mode, optname, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    aps.init(master=master, job=job, rank=rank, world_size=world, timeout=30)
    torch.manual_seed(100 + rank)                 # different on purpose: broadcast must fix it
    device = torch.device(os.environ.get("AUTOPS_TEST_DEVICE", "cpu"))
    model = make_model().to(device)
    opt = make_optimizer(optname, model)
    opt = aps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode=mode)
    aps.broadcast_parameters(model.state_dict(), root_rank=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step, (x, y) in enumerate(batches()):
        xs, ys = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        sched.step()
    np.savez(out, **{n: p.detach().cpu().numpy() for n, p in model.named_parameters()})
    aps.shutdown()


if __name__ == "__main__":
    main()
