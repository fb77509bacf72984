"""Trains a small model with the README's clipping block pasted into its step, as a user would.
Usage: readme_clip_worker.py MODE OUT.npz (under `autops local -- torchrun`, or alone)."""
import pathlib
import sys
import textwrap

import numpy as np
import torch

import autops.torch as aps

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_block(tag: str) -> str:
    """The code block after ``<!-- ... runs this block: TAG -->`` in the README, dedented."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().endswith(f"runs this block: {tag} -->"))
    body = []
    for line in lines[start + 2:]:
        if line.strip() == "```":
            break
        body.append(line)
    return textwrap.dedent("\n".join(body))


def main() -> None:
    mode, out = sys.argv[1:3]
    torch.set_num_threads(1)
    aps.init()
    rank, world = aps.rank(), aps.size()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = aps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode=mode,
                                   averaged_grads=mode == "server")      # as the README says for server mode
    aps.broadcast_parameters(model.state_dict(), root_rank=0)
    step_code = compile(readme_block("clipping"), "README.md", "exec")
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        x, y = torch.randn(24, 20, generator=gen), torch.randint(0, 4, (24,), generator=gen)
        opt.zero_grad()
        # scaled so that the README's clip at 1.0 acts in every step (the gradient norm is about 5)
        loss = 10 * torch.nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        exec(step_code, {"torch": torch, "loss": loss, "opt": opt, "model": model})
    np.savez(out, **{n: p.detach().numpy() for n, p in model.named_parameters()})
    aps.shutdown()


if __name__ == "__main__":
    main()
