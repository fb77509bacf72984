"""What real training scripts do between backward() and step(), written once for both sides of
the conformance test: one process on the whole batch (plain torch optimizers) and W workers
through autops.torch on their shards (DistributedOptimizer). Modelled on the idioms of
Horovod's test/parallel/test_torch.py.

Every idiom is ``fn(run) -> {name: final parameter}``; ``run`` says how to wrap an optimizer
and which part of a batch is this process's. The step loop calls ``synchronize`` and
``skip_synchronize`` through ``run``, which are no-ops for a plain torch optimizer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

STEPS = 5
BATCH = 12          # divisible by 2 and 3: equal shards, so the mean of shard means is the batch mean
MAX_NORM = 0.05     # small enough that every step clips


@dataclass
class Run:
    """How an idiom runs: ``wrap(opt, model, **options)``, this rank, the world size, the mode."""
    wrap: Callable[..., torch.optim.Optimizer]
    rank: int = 0
    world: int = 1
    mode: str = "reference"
    broadcast: Callable[[torch.nn.Module, torch.optim.Optimizer | None], None] = lambda model, opt: None

    @property
    def distributed(self) -> bool:
        return self.mode != "reference"

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.world)[self.rank]

    @staticmethod
    def synchronize(opt) -> None:
        if hasattr(opt, "synchronize"):
            opt.synchronize()

    @staticmethod
    def skip_synchronize(opt):
        return opt.skip_synchronize() if hasattr(opt, "skip_synchronize") else contextlib.nullcontext()


def _model(seed: int, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))


def _batches(seed: int, steps: int = STEPS):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(BATCH, 20, generator=gen), torch.randn(BATCH, 3, generator=gen)


def _loss(model, x, y, run: Run) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(run.shard(x)), run.shard(y))


def _params(prefix: str, model: torch.nn.Module) -> dict:
    return {prefix + n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}


def clip_after_synchronize(run: Run) -> dict:
    """Horovod's clipping: synchronize(), clip the averaged gradients, step without syncing again."""
    model = _model(1)
    opt = run.wrap(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model, averaged_grads=True)
    run.broadcast(model, None)
    for x, y in _batches(1):
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        run.synchronize(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with run.skip_synchronize(opt):
            opt.step()
    return _params("", model)


def clip_option(run: Run) -> dict:
    """DistributedOptimizer(clip_grad_norm=MAX): the same as clip_grad_norm_ before step() in one process."""
    model = _model(2)
    opt = run.wrap(torch.optim.Adam(model.parameters(), lr=0.05), model, clip_grad_norm=MAX_NORM)
    run.broadcast(model, None)
    for x, y in _batches(2):
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        if not run.distributed:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return _params("", model)


def accumulate(run: Run) -> dict:
    """Gradient accumulation over 2 micro-batches (loss scaled by 1/2), one step each."""
    model = _model(3)
    opt = run.wrap(torch.optim.Adam(model.parameters(), lr=0.02), model, backward_passes_per_step=2)
    run.broadcast(model, None)
    for x, y in _batches(3):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (_loss(model, xm, ym, run) / 2).backward()
        opt.step()
    return _params("", model)


def param_groups(run: Run) -> dict:
    """Two param groups with different learning rates and weight decay."""
    model = _model(4)
    opt = run.wrap(torch.optim.Adam([
        {"params": model[0].parameters(), "lr": 0.05},
        {"params": model[2].parameters(), "lr": 0.005, "weight_decay": 0.01}]), model)
    run.broadcast(model, None)
    for x, y in _batches(4):
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        opt.step()
    return _params("", model)


def lr_schedule(run: Run) -> dict:
    """A scheduler that changes the learning rate every step (the aggregators follow it in server mode)."""
    model = _model(5)
    opt = run.wrap(torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5, nesterov=True), model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    run.broadcast(model, None)
    for x, y in _batches(5):
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        opt.step()
        sched.step()
    return _params("", model)


def frozen_layer(run: Run) -> dict:
    """The first layer frozen, the optimizer still given every parameter (a fine-tuning script)."""
    model = _model(6)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = run.wrap(torch.optim.AdamW(model.parameters(), lr=0.05), model)
    run.broadcast(model, None)
    for x, y in _batches(6):
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        opt.step()
    return _params("", model)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(20, 16)
        self.even = torch.nn.Linear(16, 3)
        self.odd = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        head = self.even if step % 2 == 0 else self.odd
        return head(torch.tanh(self.body(x)))


def unused_parameters(run: Run) -> dict:
    """A head used only in every other step: Adam must not step it (no gradient) in the others."""
    torch.manual_seed(7)
    model = _TwoHeads()
    opt = run.wrap(torch.optim.Adam(model.parameters(), lr=0.05), model)
    run.broadcast(model, None)
    for step, (x, y) in enumerate(_batches(7)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(run.shard(x), step), run.shard(y)).backward()
        opt.step()
    return _params("", model)


def state_dict_round_trip(run: Run) -> dict:
    """state_dict() mid-training and load_state_dict() into a fresh optimizer of a fresh model."""
    model = _model(8)
    opt = run.wrap(torch.optim.Adam(model.parameters(), lr=0.05), model, prefix="before.")
    run.broadcast(model, None)
    batches = list(_batches(8))
    for x, y in batches[:2]:
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        opt.step()
    model_state, opt_state = model.state_dict(), opt.state_dict()
    model = _model(80)
    model.load_state_dict(model_state)
    opt = run.wrap(torch.optim.Adam(model.parameters(), lr=0.05), model, prefix="after.")
    opt.load_state_dict(opt_state)
    for x, y in batches[2:]:
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        opt.step()
    return _params("", model)


def broadcast_state(run: Run) -> dict:
    """Rank 0 alone loads a checkpoint (parameters and Adam state); broadcast gives it to every rank."""
    model = _model(9)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    if run.rank == 0:                  # the checkpoint: two local steps on data of its own
        for x, y in _batches(90, steps=2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    opt = run.wrap(opt, model)
    run.broadcast(model, opt)
    for x, y in _batches(9):
        opt.zero_grad()
        _loss(model, x, y, run).backward()
        opt.step()
    return _params("", model)


def grad_scaler(run: Run) -> dict:
    """Mixed precision's GradScaler: unscale_ after synchronize(), clip, scaler.step() without
    syncing again; one step overflows (inf loss), which the scaler skips on every rank."""
    model = _model(10)
    opt = run.wrap(torch.optim.SGD(model.parameters(), lr=0.5), model, averaged_grads=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run.broadcast(model, None)
    for step, (x, y) in enumerate(_batches(10)):
        opt.zero_grad()
        loss = _loss(model, x, y, run) * (float("inf") if step == 2 else 1.0)
        scaler.scale(loss).backward()
        run.synchronize(opt)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with run.skip_synchronize(opt):
            scaler.step(opt)
        scaler.update()
    return _params("", model)


def two_models_same_names(run: Run) -> dict:
    """A GAN-shaped script: two models whose parameter names are the same, one optimizer each;
    the discriminator frozen while the generator's loss flows through it (pix2pix's way)."""
    gen, disc = _model(11), _model(12)
    opt_g = run.wrap(torch.optim.Adam(gen.parameters(), lr=0.02), gen, prefix="generator.")
    opt_d = run.wrap(torch.optim.SGD(disc.parameters(), lr=0.1), disc, prefix="discriminator.")
    run.broadcast(gen, None)
    run.broadcast(disc, None)
    for x, y in _batches(11):
        disc.requires_grad_(True)
        opt_d.zero_grad()
        _loss(disc, x, y, run).backward()
        opt_d.step()
        disc.requires_grad_(False)
        opt_g.zero_grad()
        torch.nn.functional.mse_loss(disc(gen(run.shard(x)) @ _MIX), run.shard(y)).backward()
        opt_g.step()
    return {**_params("generator.", gen), **_params("discriminator.", disc)}


def gradients_discarded_by_zero_grad(run: Run) -> dict:
    """The generator's backward also gives the discriminator gradients, which the next
    ``opt_d.zero_grad()`` throws away (sum mode: the server's optimizer would have stepped)."""
    gen, disc = _model(14), _model(15)
    opt_g = run.wrap(torch.optim.Adam(gen.parameters(), lr=0.02), gen, prefix="generator.")
    opt_d = run.wrap(torch.optim.SGD(disc.parameters(), lr=0.1), disc, prefix="discriminator.")
    run.broadcast(gen, None)
    run.broadcast(disc, None)
    for x, y in _batches(14):
        opt_d.zero_grad()
        _loss(disc, x, y, run).backward()
        opt_d.step()
        opt_g.zero_grad()
        torch.nn.functional.mse_loss(disc(gen(run.shard(x)) @ _MIX), run.shard(y)).backward()
        opt_g.step()
    return {**_params("generator.", gen), **_params("discriminator.", disc)}


gradients_discarded_by_zero_grad.modes = ("sum",)
_MIX = torch.ones(3, 20) / 3


def sparse_embedding(run: Run) -> dict:
    """nn.Embedding(sparse=True): pushed as dense with sparse_as_dense=True; plain SGD agrees with
    the sparse update of one process."""
    torch.manual_seed(13)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8, sparse=True), torch.nn.Linear(8, 3))
    opt = run.wrap(torch.optim.SGD(model.parameters(), lr=0.5), model, sparse_as_dense=True)
    run.broadcast(model, None)
    gen = torch.Generator().manual_seed(13)
    for _ in range(STEPS):
        x, y = torch.randint(0, 6, (BATCH,), generator=gen), torch.randn(BATCH, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(run.shard(x)), run.shard(y)).backward()
        opt.step()
    return _params("", model)


IDIOMS: dict[str, Callable[[Run], dict]] = {fn.__name__: fn for fn in (
    clip_after_synchronize, clip_option, accumulate, param_groups, lr_schedule, frozen_layer,
    unused_parameters, state_dict_round_trip, broadcast_state, grad_scaler, two_models_same_names,
    gradients_discarded_by_zero_grad, sparse_embedding)}


def idioms_for(mode: str) -> list[str]:
    """The idioms that apply to ``mode`` (all but those marked with the modes they are for)."""
    return [name for name, fn in IDIOMS.items() if mode in getattr(fn, "modes", (mode,))]


def reference(name: str) -> dict:
    """One process, whole batches, plain torch."""
    return IDIOMS[name](Run(wrap=lambda opt, model, **options: opt))
