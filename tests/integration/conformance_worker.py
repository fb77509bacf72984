"""One rank of the conformance test: every idiom of conformance_idioms that applies to MODE,
through autops.torch, saved as IDIOM/PARAM arrays.
Usage: conformance_worker.py MASTER JOB RANK WORLD MODE OUT.npz"""
import sys

import numpy as np
import torch

import autops.torch as aps
from conformance_idioms import IDIOMS, Run, idioms_for


def broadcast(model: torch.nn.Module, opt) -> None:
    aps.broadcast_parameters(model.state_dict(), root_rank=0)
    if opt is not None:
        aps.broadcast_optimizer_state(opt, root_rank=0)


def main() -> None:
    master, job, rank, world, mode, out = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    aps.init(master=master, job=job, rank=rank, world_size=world, timeout=30)
    results = {}
    for name in idioms_for(mode):
        def wrap(opt, model, **options):
            return aps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode=mode,
                                            **{"prefix": f"{name}.", **options,
                                               **({"prefix": f"{name}.{options['prefix']}"}
                                                  if "prefix" in options else {})})
        params = IDIOMS[name](Run(wrap=wrap, rank=rank, world=world, mode=mode, broadcast=broadcast))
        results.update({f"{name}/{k}": v for k, v in params.items()})
    np.savez(out, **results)
    aps.shutdown()


if __name__ == "__main__":
    main()
