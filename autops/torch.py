"""The PyTorch swap-in (Horovod/BytePS shape): three lines turn a script into an AutoPS job.

```python
import autops.torch as aps
aps.init()
opt = aps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
aps.broadcast_parameters(model.state_dict(), root_rank=0)
```

``init`` reads ``AUTOPS_MASTER``, ``AUTOPS_JOB``, ``AUTOPS_JOB_SECRET`` (the job's secret, set
by the launcher: ``autops local``, the Tiresias master, or ``export
AUTOPS_JOB_SECRET=$(autops secret)`` before torchrun) and torchrun's ``RANK``/``WORLD_SIZE``; no
``torch.distributed`` process group is used. Gradients are pushed from per-parameter
post-accumulate-grad hooks, so communication overlaps the rest of backward. In ``sum`` mode
the aggregators return the mean gradient and the wrapped optimizer steps locally; in
``server`` mode the aggregators hold the master copy and run the same optimizer with the
same hyper-parameters (read from the wrapped optimizer's param groups at every step, so
LR schedulers keep working), and workers pull parameters. Without ``AUTOPS_MASTER`` and
with a world size of 1 everything runs locally, so the same script trains alone.

Checkpoints. ``opt.state_dict()`` of a ``DistributedOptimizer`` is always the full state in
``torch.optim``'s format. In ``sum`` mode that is the local optimizer state (the same on
every rank). In ``server`` mode the local state is stale (the aggregators step), so
``state_dict()`` first fetches every parameter's optimizer state and step from the
aggregators as they are after the last completed ``step()`` (STATE_GET requests, answered
with the serialisation of live migration's TENSOR_COPY); it is not collective, call it on the
rank that writes the checkpoint, between steps. ``load_state_dict()`` loads it locally, and
in ``server`` mode root's first ``step()`` sends it to the aggregators with the parameters
(``broadcast_optimizer_state(opt)`` sends it at once); so a job resumed under a new job id,
on new aggregators, continues exactly. Both formats are interchangeable with a local
``torch.optim`` optimizer of the same class.

Agreement. ``any_rank(flag, name)`` is True on every rank when ``flag`` is True on at least
one (a summed push_pull of one number): call it at the same point on every rank, e.g. to
stop all ranks at the same iteration when one saw a preemption request;
``any_rank_async`` starts it early so the round trip overlaps the iteration.
``allgather(tensor, name)`` gives every rank all ranks' tensors (per-rank RNG states for the
checkpoint rank 0 writes).

GPU tensors. Parameters, gradients and tensors may live on a CUDA device: each is staged
through a pinned host buffer (``autops.worker.device``). A gradient's copy to the host starts
in its autograd hook on a side stream and its push leaves once the copy is done (handed to
the agent by the next hook or wait, else by the stager's thread 2 ms later), so the copy
overlaps the rest of backward and the other tensors' communication; results are copied back
into the device tensors when ``step()``/``synchronize()`` waits for them.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Mapping

import torch

from .config import master_address
from .worker.agent import Agent, AuthRefused, AutoPSError, Handle, config_from_env
from .worker.context import WorkerContext, dtype_name, flat_numpy, on_device
from .worker.optimizer import DistributedMixin, create_missing_state, group_scalars, set_group_scalars, wrap_optimizer

log = logging.getLogger("autops.torch")

__all__ = ["init", "shutdown", "rank", "size", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "push_pull", "push_pull_async", "synchronize", "placement",
           "any_rank", "any_rank_async", "allgather", "AutoPSError", "AuthRefused"]


_ctx: WorkerContext | None = None


def _no_master_advice(world_size: int) -> str:
    """Why a job of several workers cannot start without ``AUTOPS_MASTER``, and what to do:
    for a job the Tiresias master started (it sets ``TIRESIAS_JOB_ID``), what to pass to
    ``tiresias submit``; otherwise how to start a pool."""
    if os.environ.get("TIRESIAS_JOB_ID"):
        gpus = os.environ.get("TIRESIAS_GPUS") or str(world_size)
        return (f"AUTOPS_MASTER is not set: Tiresias job {os.environ['TIRESIAS_JOB_ID']} has {world_size} "
                f"workers and exchanges gradients through AutoPS; submit it with aggregators: `tiresias submit "
                f"--gpus {gpus} --autops-aggregators K -- SCRIPT ...` (its master needs --autops-master ADDR)")
    return ("AUTOPS_MASTER is not set; start a pool (`autops local -- CMD` or "
            "`autops master` + `autops aggregator`) and point AUTOPS_MASTER at it")


def init(master: str | None = None, job: str | None = None, rank: int | None = None,
         world_size: int | None = None, num_aggregators: int | None = None, timeout: float | None = None,
         transport: str | None = None, secret: str | None = None) -> None:
    """Connect this worker to the parameter service (idempotent).

    ``secret``: the job's secret (default ``$AUTOPS_JOB_SECRET``); without one it raises
    ``AutoPSError`` naming the variable, and ``AuthRefused`` when pMaster refuses it.

    Fails within ``timeout`` seconds (``AUTOPS_TIMEOUT``, default 60) with the master's address
    in the message when it cannot be reached.

    The arguments not given come from the environment (``autops.config.AgentConfig``, read
    here once pMaster's address is known; a bad value raises ``BadSetting`` naming it).
    """
    global _ctx
    if _ctx is not None:
        return
    master = master or master_address()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not master:
        if world_size > 1:
            raise AutoPSError(_no_master_advice(world_size))
        log.info("AUTOPS_MASTER not set and world size 1: training locally without a parameter service")
        _ctx = WorkerContext(None, 0, 1)
        return
    config = config_from_env()
    job = job or config.job
    if not job:
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            job = f"torchrun-{os.environ['MASTER_ADDR']}-{os.environ['MASTER_PORT']}"
        else:
            raise AutoPSError("AUTOPS_JOB is not set: give every job a unique id")
    agent = Agent(master, job, rank, world_size, mode="sum",
                  num_aggregators=config.aggregators if num_aggregators is None else num_aggregators,
                  timeout=config.timeout if timeout is None else timeout, transport=transport or config.transport,
                  secret=secret, fault_tolerant=config.fault_tolerant, config=config)
    _ctx = WorkerContext(agent, rank, world_size)


def _context() -> WorkerContext:
    if _ctx is None:
        raise AutoPSError("call autops.torch.init() first")
    return _ctx


def shutdown() -> None:
    """Tell pMaster this rank is done and close the connections."""
    global _ctx
    if _ctx is not None and _ctx.agent is not None:
        _ctx.agent.job_done()
        _ctx.agent.close()
    if _ctx is not None:
        _ctx.close()
    _ctx = None


def rank() -> int:
    return _context().rank


def size() -> int:
    return _context().size


def placement() -> dict[str, list[str]]:
    """aggregator id -> keys of this job it serves (empty when training locally)."""
    ctx = _context()
    return ctx.agent.placement() if ctx.agent is not None else {}


# --- collective-style helpers -------------------------------------------------------------
def push_pull_async(tensor: torch.Tensor, name: str, average: bool = True) -> Handle | None:
    """Start aggregating ``tensor`` over all workers; the result lands in ``tensor`` in place."""
    ctx = _context()
    if ctx.agent is None:
        return None
    key = f"push_pull.{name}" if average else f"push_pull_sum.{name}"
    ctx.declare([(key, tuple(tensor.shape), dtype_name(tensor), {"mode": "sum", "average": average})])
    it = ctx.iterations.get(key, 0) + 1
    ctx.iterations[key] = it
    if on_device(tensor):
        handle = ctx.stager().submit(key, tensor, lambda a: ctx.agent.push_pull(key, a, a, it), result=tensor)
    else:
        arr = flat_numpy(tensor)
        handle = ctx.agent.push_pull(key, arr, arr, it)
    ctx.outstanding.append((handle, tensor))
    return handle


def push_pull(tensor: torch.Tensor, name: str, average: bool = True) -> torch.Tensor:
    """Aggregate ``tensor`` (mean by default, sum with ``average=False``) over all workers.

    Returns a new tensor; ``tensor`` is left unchanged.
    """
    out = tensor.detach().clone().contiguous()
    handle = push_pull_async(out, name, average)
    synchronize(handle)
    return out


def synchronize(handle: Handle | None = None) -> None:
    """Wait for ``handle``, or for every outstanding asynchronous operation."""
    ctx = _context()
    if handle is not None:
        handle.wait()
        ctx.outstanding = [(h, t) for h, t in ctx.outstanding if h is not handle]
        return
    pending, ctx.outstanding = ctx.outstanding, []
    for h, _ in pending:
        h.wait()


def any_rank_async(flag: bool, name: str = "any_rank") -> Callable[[], bool]:
    """Start ``any_rank(flag, name)``; the returned function waits and gives the answer.

    Every rank must make the same sequence of calls for a given ``name``."""
    vote = torch.tensor([1.0 if flag else 0.0])
    handle = push_pull_async(vote, f"any_rank.{name}", average=False)
    if handle is None:                 # training alone
        return lambda: bool(flag)

    def result() -> bool:
        synchronize(handle)
        return bool(vote.item() > 0)
    return result


def any_rank(flag: bool, name: str = "any_rank") -> bool:
    """True on every rank if ``flag`` is True on at least one rank (``flag`` alone when
    training locally). A collective: every rank calls it at the same point."""
    return any_rank_async(flag, name)()


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Overwrite every worker's tensors with ``root_rank``'s values (in place)."""
    ctx = _context()
    if ctx.agent is None:
        return
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    handles = [_broadcast_start(ctx, name, tensor, root_rank) for name, tensor in items
               if isinstance(tensor, torch.Tensor)]
    for h in handles:
        h.wait()


def _broadcast_start(ctx: WorkerContext, name: str, tensor: torch.Tensor, root_rank: int) -> Handle:
    seq = ctx.bcast_seq.get(name, 0)
    ctx.bcast_seq[name] = seq + 1
    if on_device(tensor):
        return ctx.stager().submit(f"bcast.{name}", tensor.data,
                                   lambda a: ctx.agent.broadcast(f"bcast.{name}", a, root_rank, seq),
                                   result=tensor.data)
    return ctx.agent.broadcast(f"bcast.{name}", flat_numpy(tensor.data), root_rank, seq)


def allgather(tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order, byte for byte (e.g. per-rank RNG states for a
    checkpoint). A collective: every rank passes a tensor of the same shape and dtype."""
    ctx = _context()
    mine = tensor.detach().clone().contiguous()
    if ctx.agent is None:
        return [mine]
    out = [mine if r == ctx.rank else torch.empty_like(mine) for r in range(ctx.size)]
    handles = [_broadcast_start(ctx, f"allgather.{name}.{r}", out[r], r) for r in range(ctx.size)]
    for h in handles:
        h.wait()
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every worker ``root_rank``'s optimizer state (e.g. after loading a checkpoint).

    In ``server`` mode the aggregators hold the state, so root's state is sent to them.
    """
    ctx = _context()
    if ctx.agent is None:
        return
    if isinstance(optimizer, DistributedMixin) and optimizer._aps_mode == "server":
        optimizer._aps_init(root_rank, with_state=True)
        return
    # which parameters have state is root's to say: the others create what they lack (a fresh
    # optimizer has none until its first step) and drop what root has not, so every rank
    # broadcasts the same tensors
    params = [p for group in optimizer.param_groups for p in group["params"]]
    has = torch.tensor([1.0 if optimizer.state.get(p) else 0.0 for p in params])
    broadcast_parameters([("opt.has_state", has)], root_rank)
    with_state = [p for p, flag in zip(params, has.tolist()) if flag]
    create_missing_state(optimizer, [p for p in with_state if not optimizer.state.get(p)])
    for p in set(params) - set(with_state):
        optimizer.state.pop(p, None)
    tensors = []
    for gi, group in enumerate(optimizer.param_groups):
        hyper = group_scalars(group)
        if hyper is not None:
            tensors.append((f"opt.{gi}.hyper", hyper))
        for pi, p in enumerate(group["params"]):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((f"opt.{gi}.{pi}.{key}", value))
    broadcast_parameters(tensors, root_rank)
    for gi, group in enumerate(optimizer.param_groups):
        set_group_scalars(group, dict(tensors).get(f"opt.{gi}.hyper"))


# --- DistributedOptimizer -----------------------------------------------------------------
def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, mode: str = "sum", *,
                         backward_passes_per_step: int = 1, clip_grad_norm: float | None = None,
                         averaged_grads: bool = False, sparse_as_dense: bool = False,
                         prefix: str = "") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are aggregated by the parameter service.

    ``mode="sum"``: the mean gradient comes back and ``optimizer`` steps locally.
    ``mode="server"``: the aggregators apply the same optimizer (SGD, Adam or AdamW) with the
    hyper-parameters of ``optimizer``'s param groups; workers receive parameters.
    The returned object is an instance of ``optimizer``'s class sharing its state, so LR
    schedulers and ``state_dict()`` keep working; it adds ``synchronize()`` and
    ``skip_synchronize()`` (Horovod's contract, see ``autops.worker.optimizer``).

    ``backward_passes_per_step``: backward passes whose gradients are summed before one push.
    ``clip_grad_norm``: clip the averaged gradient by its global norm before the optimizer runs
    (both modes; in server mode it implies ``averaged_grads``). ``averaged_grads`` (server
    mode): ``synchronize()`` leaves the averaged gradients in ``p.grad`` for the script to
    change before ``step()``, at the cost of one more round trip per step.
    ``sparse_as_dense``: push sparse gradients as dense (else they are refused).
    ``prefix``: prepended to every parameter name, so two models with the same parameter names
    (a GAN's generator and discriminator) can be trained in one job; names are unique per job.
    """
    return wrap_optimizer(optimizer, _context(), named_parameters, mode,
                          backward_passes_per_step=backward_passes_per_step, clip_grad_norm=clip_grad_norm,
                          averaged_grads=averaged_grads, sparse_as_dense=sparse_as_dense, prefix=prefix)
