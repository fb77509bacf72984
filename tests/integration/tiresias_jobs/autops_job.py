"""A small AutoPS training job for report tests: one large tensor (skew about 0.97).

``autops_job.py STEPS PAUSE``; stops cleanly when Tiresias asks.
"""
import sys
import time

import torch

import autops.torch as aps
from tiresias import job

steps, pause = int(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(0)
aps.init()
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
opt = aps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
aps.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(32, 256), torch.randint(0, 8, (32,))
for step in range(steps):
    if job.should_stop():
        aps.shutdown()
        job.exit_stopped()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    time.sleep(pause)
print(f"done after {steps} steps", flush=True)
aps.shutdown()
