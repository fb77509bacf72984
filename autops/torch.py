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
through a pinned host buffer (``autops.torch_device``). A gradient's copy to the host starts
in its autograd hook on a side stream and its push leaves once the copy is done (handed to
the agent by the next hook or wait, else by the stager's thread 2 ms later), so the copy
overlaps the rest of backward and the other tensors' communication; results are copied back
into the device tensors when ``step()``/``synchronize()`` waits for them.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Mapping

import torch

from .agent import DEFAULT_TIMEOUT, Agent, AuthRefused, AutoPSError, Handle
from .optim import hp_from_torch_group, optimizer_name_of
from .torch_device import DeviceStager, StagedHandle, host_array

log = logging.getLogger("autops.torch")

__all__ = ["init", "shutdown", "rank", "size", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "push_pull", "push_pull_async", "synchronize", "placement",
           "any_rank", "any_rank_async", "allgather", "AutoPSError", "AuthRefused"]


class _Context:
    def __init__(self, agent: Agent | None, rank: int, size: int) -> None:
        self.agent = agent
        self.rank = rank
        self.size = size
        self.iterations: dict[str, int] = {}
        self.bcast_seq: dict[str, int] = {}
        self.declared: set[str] = set()
        self.outstanding: list[tuple[Handle, Any]] = []
        self._stager: DeviceStager | None = None

    def stager(self) -> DeviceStager:
        """The pinned-memory stager for device tensors (started on first use)."""
        if self._stager is None:
            self._stager = DeviceStager()
        return self._stager

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


_ctx: _Context | None = None


def init(master: str | None = None, job: str | None = None, rank: int | None = None,
         world_size: int | None = None, num_aggregators: int | None = None, timeout: float | None = None,
         transport: str | None = None, secret: str | None = None) -> None:
    """Connect this worker to the parameter service (idempotent).

    ``secret``: the job's secret (default ``$AUTOPS_JOB_SECRET``); without one it raises
    ``AutoPSError`` naming the variable, and ``AuthRefused`` when pMaster refuses it.

    Fails within ``timeout`` seconds (``AUTOPS_TIMEOUT``, default 60) with the master's address
    in the message when it cannot be reached.
    """
    global _ctx
    if _ctx is not None:
        return
    master = master or os.environ.get("AUTOPS_MASTER")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not master:
        if world_size > 1:
            raise AutoPSError("AUTOPS_MASTER is not set; start a pool (`autops local -- CMD` or "
                              "`autops master` + `autops aggregator`) and point AUTOPS_MASTER at it")
        log.info("AUTOPS_MASTER not set and world size 1: training locally without a parameter service")
        _ctx = _Context(None, 0, 1)
        return
    job = job or os.environ.get("AUTOPS_JOB")
    if not job:
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            job = f"torchrun-{os.environ['MASTER_ADDR']}-{os.environ['MASTER_PORT']}"
        else:
            raise AutoPSError("AUTOPS_JOB is not set: give every job a unique id")
    timeout = float(os.environ.get("AUTOPS_TIMEOUT", DEFAULT_TIMEOUT)) if timeout is None else timeout
    n_aggs = int(os.environ.get("AUTOPS_AGGREGATORS", 0)) if num_aggregators is None else num_aggregators
    agent = Agent(master, job, rank, world_size, mode="sum", num_aggregators=n_aggs, timeout=timeout,
                  transport=transport or os.environ.get("AUTOPS_TRANSPORT", "auto"),
                  secret=secret,
                  fault_tolerant=os.environ.get("AUTOPS_FAULT_TOLERANT", "1").lower() not in ("0", "false", "no"))
    _ctx = _Context(agent, rank, world_size)


def _context() -> _Context:
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


def _flat_numpy(t: torch.Tensor):
    """A CPU tensor's flat numpy view; a device tensor's copy on the host (read-only use)."""
    if not t.is_contiguous():
        raise AutoPSError("tensor must be contiguous")
    return host_array(t if t.device.type == "cpu" else t.detach().cpu())


def _on_device(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return False
    if t.device.type != "cuda":
        raise AutoPSError(f"tensor on {t.device}: AutoPS moves CPU and CUDA tensors")
    if not t.is_contiguous():
        raise AutoPSError("tensor must be contiguous")
    return True


def _declare(ctx: _Context, entries: list[tuple]) -> None:
    new = [e for e in entries if e[0] not in ctx.declared]
    if new:
        ctx.agent.declare(new)
        ctx.declared.update(e[0] for e in new)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# --- collective-style helpers -------------------------------------------------------------
def push_pull_async(tensor: torch.Tensor, name: str, average: bool = True) -> Handle | None:
    """Start aggregating ``tensor`` over all workers; the result lands in ``tensor`` in place."""
    ctx = _context()
    if ctx.agent is None:
        return None
    key = f"push_pull.{name}" if average else f"push_pull_sum.{name}"
    _declare(ctx, [(key, tuple(tensor.shape), _dtype_name(tensor), {"mode": "sum", "average": average})])
    it = ctx.iterations.get(key, 0) + 1
    ctx.iterations[key] = it
    if _on_device(tensor):
        handle = ctx.stager().submit(key, tensor, lambda a: ctx.agent.push_pull(key, a, a, it), result=tensor)
    else:
        arr = _flat_numpy(tensor)
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


def _broadcast_start(ctx: _Context, name: str, tensor: torch.Tensor, root_rank: int) -> Handle:
    seq = ctx.bcast_seq.get(name, 0)
    ctx.bcast_seq[name] = seq + 1
    if _on_device(tensor):
        return ctx.stager().submit(f"bcast.{name}", tensor.data,
                                   lambda a: ctx.agent.broadcast(f"bcast.{name}", a, root_rank, seq),
                                   result=tensor.data)
    return ctx.agent.broadcast(f"bcast.{name}", _flat_numpy(tensor.data), root_rank, seq)


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
    if isinstance(optimizer, _DistributedMixin) and optimizer._aps_mode == "server":
        optimizer._aps_init(root_rank, with_state=True)
        return
    tensors = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((f"opt.{gi}.{pi}.{key}", value))
    broadcast_parameters(tensors, root_rank)


# --- DistributedOptimizer -----------------------------------------------------------------
class _DistributedMixin:
    """Methods mixed into a dynamic subclass of the wrapped optimizer's class."""

    _aps_mode: str

    def _aps_setup(self, named_parameters, mode: str, class_name: str) -> None:
        ctx = _context()
        self._aps_ctx = ctx
        self._aps_mode = mode
        self._aps_handles: dict[torch.nn.Parameter, Handle] = {}
        self._aps_staging: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._aps_iteration = 0
        self._aps_hp_sent: dict[int, dict] = {}
        self._aps_initialized = False
        self._aps_loaded = False         # load_state_dict() ran: root's INIT carries the state
        self._aps_optimizer = optimizer_name_of(class_name) if mode == "server" else None
        if named_parameters is None:
            named = [(f"param.{gi}.{pi}", p) for gi, g in enumerate(self.param_groups)
                     for pi, p in enumerate(g["params"])]
        else:
            named = list(named_parameters)
        names = {}
        in_groups = {p for g in self.param_groups for p in g["params"] if p.requires_grad}
        for name, p in named:
            if p in in_groups and p.requires_grad:
                if name in names.values():
                    raise ValueError(f"parameter name {name!r} appears twice")
                names[p] = name
        missing = [p for p in in_groups if p not in names]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters are missing from named_parameters")
        self._aps_names = names
        self._aps_group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        if ctx.agent is None:
            return
        entries = []
        for p, name in names.items():
            opts: dict[str, Any] = {"mode": mode, "average": True}
            if mode == "server":
                opts["optimizer"] = self._aps_optimizer
                opts["hp"] = self._aps_hp(p)
            entries.append((name, tuple(p.shape), _dtype_name(p), opts))
        _declare(ctx, entries)
        for p in names:
            if mode == "server":        # where pulled parameters land (pinned host memory for a GPU's)
                self._aps_staging[p] = (ctx.stager().buffer(names[p], "params", p.data).view(p.shape)
                                        if _on_device(p.data) else
                                        torch.empty_like(p.data, memory_format=torch.contiguous_format))
            p.register_post_accumulate_grad_hook(self._aps_hook)

    def _aps_hp(self, p) -> dict:
        group = self.param_groups[self._aps_group_of[p]]
        return hp_from_torch_group(self._aps_optimizer, {k: v for k, v in group.items() if k != "params"})

    def _aps_init(self, root_rank: int = 0, with_state: bool = False) -> None:
        """Server mode: root sends the master copy (and optimizer state) to the aggregators."""
        ctx = self._aps_ctx
        self._aps_initialized = True
        self._aps_loaded = False
        if ctx.rank != root_rank:
            return
        handles = []
        for p, name in self._aps_names.items():
            state, step = {}, 0
            if with_state:
                for key, value in self.state.get(p, {}).items():
                    if key == "step":
                        step = int(value.item() if isinstance(value, torch.Tensor) else value)
                    elif isinstance(value, torch.Tensor):
                        state[key] = _flat_numpy(value)
            hp = self._aps_hp(p)
            self._aps_hp_sent[id(p)] = hp
            handles.append(ctx.agent.init(name, _flat_numpy(p.data), hp=hp, opt_state=state, step=step))
        for h in handles:
            h.wait()

    def _aps_hook(self, p: torch.Tensor) -> None:
        if p in self._aps_handles:
            raise AutoPSError(f"gradient of {self._aps_names[p]!r} computed twice before step(); "
                              "gradient accumulation over several backward passes is not supported")
        self._aps_start(p)

    def _aps_start(self, p: torch.Tensor) -> None:
        ctx = self._aps_ctx
        if self._aps_mode == "server" and not self._aps_initialized:
            self._aps_init(root_rank=0, with_state=self._aps_loaded)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if not grad.is_contiguous():
            p.grad = grad = grad.contiguous()
        it = self._aps_iteration + 1
        name, agent = self._aps_names[p], ctx.agent
        changed = None
        if self._aps_mode == "server":
            hp = self._aps_hp(p)
            changed = hp if self._aps_hp_sent.get(id(p)) != hp else None
            if changed:
                self._aps_hp_sent[id(p)] = hp
        if _on_device(grad):
            if self._aps_mode == "sum":
                handle = ctx.stager().submit(name, grad, lambda g: agent.push_pull(name, g, g, it), result=grad)
            else:
                out = host_array(self._aps_staging[p])
                handle = ctx.stager().submit(name, grad, lambda g: agent.push_pull(name, g, out, it, hp=changed))
        else:
            g = _flat_numpy(grad)
            out = g if self._aps_mode == "sum" else _flat_numpy(self._aps_staging[p])
            handle = agent.push_pull(name, g, out, it, hp=changed)
        self._aps_handles[p] = handle

    def synchronize(self) -> None:
        """Push what backward did not (unused parameters) and wait for every result."""
        if self._aps_ctx.agent is None:
            return
        for p in self._aps_names:
            if p not in self._aps_handles:
                self._aps_start(p)
        for handle in self._aps_handles.values():
            if isinstance(handle, StagedHandle):
                handle.submitted()       # staged pushes reach the agent before it flushes its batches
        self._aps_ctx.agent.flush()
        handles, self._aps_handles = self._aps_handles, {}
        for handle in handles.values():
            handle.wait()
        self._aps_iteration += 1

    def step(self, closure=None):
        if self._aps_ctx.agent is None:
            return super().step(closure)
        if closure is not None:
            raise AutoPSError("step(closure) is not supported by DistributedOptimizer")
        self.synchronize()
        if self._aps_mode == "sum":
            return super().step()
        with torch.no_grad():
            for p, staged in self._aps_staging.items():
                p.copy_(staged)
        return None

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state (``torch.optim`` format); in server mode the aggregators'
        state after the last ``step()`` is fetched into this optimizer first."""
        if self._aps_server_side():
            self._aps_fetch_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a ``state_dict()``; in server mode root's next step (or
        ``broadcast_optimizer_state``) sends it to the aggregators with the parameters."""
        super().load_state_dict(state_dict)
        if self._aps_mode == "server" and self._aps_ctx.agent is not None:
            self._aps_initialized = False
            self._aps_loaded = True

    def _aps_server_side(self) -> bool:
        """Do the aggregators hold state newer than the local one?"""
        return self._aps_mode == "server" and self._aps_ctx.agent is not None and self._aps_initialized

    def _aps_fetch_state(self) -> None:
        if self._aps_handles:
            raise AutoPSError("state_dict() during an iteration: call it before backward or after step()")
        agent = self._aps_ctx.agent
        handles = {p: agent.fetch_state(name, self._aps_iteration) for p, name in self._aps_names.items()}
        for p, handle in handles.items():
            handle.wait()
            state: dict[str, Any] = {}
            if self._aps_optimizer != "sgd":        # torch's Adam/AdamW keep the step as a tensor
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(float(handle.step), dtype=scalar)
            for key, value in handle.state.items():
                state[key] = torch.from_numpy(value).view(p.shape).to(device=p.device, dtype=p.dtype)
            self.state[p] = state


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         mode: str = "sum") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are aggregated by the parameter service.

    ``mode="sum"``: the mean gradient comes back and ``optimizer`` steps locally.
    ``mode="server"``: the aggregators apply the same optimizer (SGD, Adam or AdamW) with the
    hyper-parameters of ``optimizer``'s param groups; workers receive parameters.
    The returned object is an instance of ``optimizer``'s class sharing its state, so LR
    schedulers and ``state_dict()`` keep working.
    """
    if mode not in ("sum", "server"):
        raise ValueError(f"mode must be 'sum' or 'server', got {mode!r}")
    cls = type(optimizer.__class__.__name__, (_DistributedMixin, optimizer.__class__), {})
    wrapped = object.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__
    wrapped._aps_setup(named_parameters, mode, optimizer.__class__.__name__)
    return wrapped
