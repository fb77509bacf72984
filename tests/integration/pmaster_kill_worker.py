"""The command test_local_pmaster_kill runs under ``autops local``: launches ranks 0 and 1 of a
job (as torchrun would) that train the torch_reference model for STEPS deterministic steps
through autops.torch and save their final parameters to DIR/rRANK.npz.

Usage: pmaster_kill_worker.py MODE DIR (MODE: sum or server; the job comes from the
environment ``autops local`` sets). With ``$PAUSE_AT`` (e.g. ``3,6``) each rank, after each of
those steps, writes DIR/at-STEP-rRANK and waits for DIR/go-STEP, so the test can SIGKILL or
restart pMaster while the job is mid-run. Exits non-zero when a rank failed.
"""
import os
import pathlib
import subprocess
import sys
import time

STEPS = 10
WORLD = 2
GO_WAIT_S = 60.0


def launch(mode: str, out: str) -> int:
    """Both ranks as child processes; the worst exit status."""
    procs = [subprocess.Popen([sys.executable, __file__, mode, out], env={**os.environ, "RANK": str(rank)})
             for rank in range(WORLD)]
    return max(p.wait() for p in procs)


def pause(out: pathlib.Path, step: int, rank: int) -> None:
    (out / f"at-{step}-r{rank}").touch()
    deadline = time.monotonic() + GO_WAIT_S
    while not (out / f"go-{step}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: nobody wrote go-{step}")
        time.sleep(0.02)


def train(mode: str, out: pathlib.Path, rank: int) -> None:
    import numpy as np
    import torch

    import autops.torch as aps
    from torch_reference import make_model, make_optimizer

    torch.set_num_threads(1)
    pauses = {int(s) for s in os.environ.get("PAUSE_AT", "").split(",") if s}
    aps.init(rank=rank, world_size=WORLD, timeout=10)
    torch.manual_seed(100 + rank)                   # broadcast makes rank 0's the start
    model = make_model()
    opt = aps.DistributedOptimizer(make_optimizer("adam", model), named_parameters=model.named_parameters(),
                                   mode=mode)
    aps.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, STEPS + 1):
        x, y = torch.randn(8, 300, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
        opt.step()
        if step in pauses:
            pause(out, step, rank)
    np.savez(out / f"r{rank}.npz", **{n: p.detach().numpy() for n, p in model.named_parameters()})
    aps.shutdown()


if __name__ == "__main__":
    mode, out = sys.argv[1:3]
    if "RANK" not in os.environ:
        sys.exit(launch(mode, out))
    train(mode, pathlib.Path(out), int(os.environ["RANK"]))
