"""``DistributedOptimizer``: a torch optimizer whose gradients the parameter service aggregates.

What a script may do between ``backward()`` and ``step()`` follows Horovod's contract:

* Every parameter's gradient is pushed from its post-accumulate-grad hook, so communication
  overlaps the rest of backward. ``step()`` waits for the results and steps.
* ``opt.synchronize()`` waits for every push; in ``sum`` mode (and in ``server`` mode with
  ``averaged_grads=True``) ``p.grad`` then holds the gradient averaged over all workers, which
  the script may change (clip, unscale, log) before ``with opt.skip_synchronize(): opt.step()``.
* A gradient changed in place after its push and before ``synchronize()`` (the naive
  ``clip_grad_norm_`` right after ``backward()``) raises ``AutoPSError``: the change would reach
  some ranks' pushes and not others'.
* ``backward_passes_per_step=N``: the gradients of N backward passes are summed in ``p.grad``
  as in one process, and pushed once, at the N-th pass.
* ``clip_grad_norm=MAX``: the averaged gradient is clipped by its global norm (over every
  parameter of the optimizer, on whichever aggregators they live) before the optimizer runs,
  as ``torch.nn.utils.clip_grad_norm_(params, MAX)`` in one process.
* A parameter no rank used in a step keeps ``p.grad = None`` and is not stepped, as in one
  process (one small summed push of a usage mask per step tells the ranks apart).
* ``sparse_as_dense=True`` pushes sparse gradients (``nn.Embedding(sparse=True)``) as dense;
  without it a sparse gradient is refused in the backward pass that makes it.

``server`` mode runs the optimizer on the aggregators. By default the hooks push gradients to
the server keys and the aggregators step at once, so the workers' ``p.grad`` stay local and a
change to them after ``synchronize()`` is refused at ``step()``. ``averaged_grads=True`` (implied
by ``clip_grad_norm``) splits the step in two: backward's hooks push to a ``sum`` key per
parameter (``NAME~avg``) and ``synchronize()`` leaves the averaged gradient in ``p.grad``;
``step()`` then sends the (possibly changed) averaged gradient to the server key -- rank 0's,
the other ranks send zeros to a summing key, so the master copy sees rank 0's gradient exactly --
and pulls the parameters. That costs one more push and pull of every gradient per step.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from .agent import AutoPSError, Handle
from ..wire.optimizers import hp_from_torch_group, optimizer_name_of
from .context import WorkerContext, dtype_name, flat_numpy, on_device
from .device import StagedHandle, host_array

__all__ = ["DistributedMixin", "wrap_optimizer", "AVERAGED_SUFFIX", "USAGE_SUFFIX"]

AVERAGED_SUFFIX = "~avg"    # the sum key of a server-mode parameter whose averaged gradient the worker sees
USAGE_SUFFIX = "~used"      # one per optimizer: which parameters some rank used this step


class DistributedMixin:
    """Methods mixed into a dynamic subclass of the wrapped optimizer's class."""

    _aps_mode: str

    def _aps_setup(self, ctx: WorkerContext, named_parameters, mode: str, class_name: str, *,
                   backward_passes_per_step: int = 1, clip_grad_norm: float | None = None,
                   averaged_grads: bool = False, sparse_as_dense: bool = False, prefix: str = "") -> None:
        self._aps_ctx = ctx
        self._aps_mode = mode
        self._aps_passes_per_step = backward_passes_per_step
        self._aps_clip = clip_grad_norm
        self._aps_sparse_as_dense = sparse_as_dense
        # server mode where the workers see the averaged gradient before the aggregators step
        self._aps_two_phase = mode == "server" and (averaged_grads or clip_grad_norm is not None)
        self._aps_handles: dict[torch.nn.Parameter, Handle] = {}
        self._aps_pushed: dict[torch.nn.Parameter, tuple[torch.Tensor, int]] = {}
        self._aps_passes: dict[torch.nn.Parameter, int] = {}
        self._aps_iter: dict[torch.nn.Parameter, int] = {}     # iterations of the key backward pushes to
        self._aps_server_iter: dict[torch.nn.Parameter, int] = {}   # two-phase: of the server key
        self._aps_staging: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._aps_zeros: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._aps_synced = False          # synchronize() ran for the step under way
        self._aps_synced_versions: dict[torch.nn.Parameter, int] = {}
        self._aps_stepped: set = set()     # the parameters whose new value the last synchronize() brought
        self._aps_skip = False
        self._aps_hp_sent: dict[int, dict] = {}
        self._aps_initialized = False
        self._aps_loaded = False         # load_state_dict() ran: root's INIT carries the state
        self._aps_optimizer = optimizer_name_of(class_name) if mode == "server" else None
        if named_parameters is None:
            named = [(f"param.{gi}.{pi}", p) for gi, g in enumerate(self.param_groups)
                     for pi, p in enumerate(g["params"])]
        else:
            named = list(named_parameters)
        names: dict[torch.nn.Parameter, str] = {}
        in_groups = {p for g in self.param_groups for p in g["params"] if p.requires_grad}
        for name, p in named:
            if p in in_groups and p.requires_grad:
                if prefix + name in names.values():
                    raise ValueError(f"parameter name {prefix + name!r} appears twice")
                names[p] = prefix + name
        missing = [p for p in in_groups if p not in names]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters are missing from named_parameters")
        self._aps_names = names
        self._aps_group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        if ctx.agent is None or not names:
            return
        self._aps_grad_key = {p: name + AVERAGED_SUFFIX if self._aps_two_phase else name for p, name in names.items()}
        self._aps_usage_key = next(iter(names.values())) + USAGE_SUFFIX
        ctx.take_names(list(names.values()))          # the internal keys below follow from them
        ctx.optimizer_names.update([self._aps_usage_key, *self._aps_grad_key.values()])
        entries = [(self._aps_usage_key, (len(names),), "float32", {"mode": "sum", "average": False})]
        for p, name in names.items():
            if mode == "sum" or self._aps_two_phase:
                entries.append((self._aps_grad_key[p], tuple(p.shape), dtype_name(p), {"mode": "sum", "average": True}))
            if mode == "server":
                # two-phase: rank 0 sends the averaged gradient, the others zeros, summed
                entries.append((name, tuple(p.shape), dtype_name(p), {
                    "mode": "server", "average": not self._aps_two_phase,
                    "optimizer": self._aps_optimizer, "hp": self._aps_hp(p)}))
        ctx.declare(entries)
        for p in names:
            if mode == "server":        # where pulled parameters land (pinned host memory for a GPU's)
                self._aps_staging[p] = (ctx.stager().buffer(names[p], "params", p.data).view(p.shape)
                                        if on_device(p.data) else
                                        torch.empty_like(p.data, memory_format=torch.contiguous_format))
            p.register_post_accumulate_grad_hook(self._aps_hook)

    def _aps_hp(self, p) -> dict:
        group = self.param_groups[self._aps_group_of[p]]
        return hp_from_torch_group(self._aps_optimizer, {k: v for k, v in group.items() if k != "params"})

    def _aps_changed_hp(self, p) -> dict | None:
        """Server mode: the hyper-parameters to send with this push, when they changed."""
        hp = self._aps_hp(p)
        if self._aps_hp_sent.get(id(p)) == hp:
            return None
        self._aps_hp_sent[id(p)] = hp
        return hp

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
                        state[key] = flat_numpy(value)
            hp = self._aps_hp(p)
            self._aps_hp_sent[id(p)] = hp
            handles.append(ctx.agent.init(name, flat_numpy(p.data), hp=hp, opt_state=state, step=step))
        for h in handles:
            h.wait()

    # --- backward ---------------------------------------------------------------------
    def _aps_hook(self, p: torch.Tensor) -> None:
        self._aps_new_step()
        passes = self._aps_passes.get(p, 0) + 1
        self._aps_passes[p] = passes
        if passes > self._aps_passes_per_step:
            raise AutoPSError(
                f"gradient of {self._aps_names[p]!r} computed {passes} times before step(): to accumulate "
                f"gradients over several backward passes, pass backward_passes_per_step=N to DistributedOptimizer "
                f"(now {self._aps_passes_per_step})")
        if passes == self._aps_passes_per_step:
            self._aps_push_grad(p)

    def _aps_new_step(self) -> None:
        """A backward pass after synchronize(): the step before it ended, stepped or not."""
        if not self._aps_synced:
            return
        if self._aps_mode == "server" and not self._aps_two_phase:
            raise AutoPSError("backward() after synchronize() without step(): in server mode the aggregators "
                              "already stepped with the gradients backward pushed, so a step cannot be skipped "
                              "(e.g. by GradScaler); construct DistributedOptimizer with averaged_grads=True")
        self._aps_synced = False

    def _aps_push_grad(self, p: torch.Tensor) -> None:
        """Push ``p``'s gradient to the key backward pushes to (its sum key, or its server key)."""
        if self._aps_mode == "server" and not self._aps_initialized:
            self._aps_init(root_rank=0, with_state=self._aps_loaded)
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        grad = p.grad
        if grad.is_sparse:
            if not self._aps_sparse_as_dense:
                raise AutoPSError(f"parameter {self._aps_names[p]!r} has a sparse gradient (e.g. nn.Embedding("
                                  f"sparse=True)): pass sparse_as_dense=True to DistributedOptimizer to push it as dense")
            p.grad = grad = grad.to_dense()
        if not grad.is_contiguous():
            p.grad = grad = grad.contiguous()
        it = self._aps_iter[p] = self._aps_iter.get(p, 0) + 1
        single_server = self._aps_mode == "server" and not self._aps_two_phase
        hp = self._aps_changed_hp(p) if single_server else None
        self._aps_handles[p] = self._aps_send(self._aps_grad_key[p], grad, self._aps_staging[p] if single_server
                                              else None, it, hp)
        self._aps_pushed[p] = (grad, grad._version)

    def _aps_send(self, key: str, tensor: torch.Tensor, out: torch.Tensor | None, it: int,
                  hp: dict | None) -> Handle:
        """push_pull ``tensor`` to ``key``; the result lands in ``out`` (None: in ``tensor``)."""
        ctx, agent = self._aps_ctx, self._aps_ctx.agent
        if on_device(tensor):
            if out is None:
                return ctx.stager().submit(key, tensor, lambda g: agent.push_pull(key, g, g, it, hp=hp), result=tensor)
            host_out = host_array(out)
            return ctx.stager().submit(key, tensor, lambda g: agent.push_pull(key, g, host_out, it, hp=hp))
        g = flat_numpy(tensor)
        return agent.push_pull(key, g, g if out is None else flat_numpy(out), it, hp=hp)

    # --- between backward and step ------------------------------------------------------
    def _aps_check_pushed(self) -> None:
        """Refuse gradients changed in place after their push (they reached the pushes of
        some ranks and not of others, or were overwritten by the result)."""
        for p, (grad, version) in self._aps_pushed.items():
            if p.grad is not grad or grad._version != version:
                hint = (" (in server mode, construct DistributedOptimizer with clip_grad_norm=MAX_NORM to clip, or "
                        "averaged_grads=True to change the averaged gradients)"
                        if self._aps_mode == "server" and not self._aps_two_phase else "")
                raise AutoPSError(
                    f"gradient of {self._aps_names[p]!r} was changed after backward() pushed it (e.g. clipped or "
                    f"unscaled before synchronize()): call opt.synchronize() first, change the averaged gradients, "
                    f"then step in `with opt.skip_synchronize(): opt.step()`{hint}")

    def _aps_used_somewhere(self) -> set:
        """The parameters that at least one rank has a gradient for this step (a summed mask)."""
        order = list(self._aps_names)
        mask = torch.tensor([1.0 if p.grad is not None else 0.0 for p in order], dtype=torch.float32)
        key = self._aps_usage_key
        ctx = self._aps_ctx
        it = ctx.iterations[key] = ctx.iterations.get(key, 0) + 1
        arr = flat_numpy(mask)
        ctx.agent.push_pull(key, arr, arr, it).wait()
        return {p for p, used in zip(order, mask.tolist()) if used > 0}

    def synchronize(self) -> None:
        """Wait for every gradient's push; ``p.grad`` then holds the average over all workers
        (in ``server`` mode only with ``averaged_grads=True``), clipped if ``clip_grad_norm``
        was given. Parameters no rank used keep ``p.grad = None``. Idempotent within a step."""
        if self._aps_synced:
            return
        agent = self._aps_ctx.agent
        if agent is None or not self._aps_names:
            self._aps_clip_grads()
            self._aps_synced = True
            return
        self._aps_check_pushed()
        for handle in self._aps_handles.values():
            if isinstance(handle, StagedHandle):
                handle.submitted()       # staged pushes reach the agent before it flushes its batches
        used = self._aps_used_somewhere()
        for p in self._aps_names:
            if p not in self._aps_handles and p in used:
                self._aps_push_grad(p)
        agent.flush()
        handles, self._aps_handles = self._aps_handles, {}
        self._aps_pushed = {}
        self._aps_passes = {}
        for handle in handles.values():
            handle.wait()
        self._aps_synced = True
        self._aps_stepped = set(handles)
        if self._aps_mode == "sum" or self._aps_two_phase:
            self._aps_clip_grads()
        else:
            self._aps_synced_versions = {p: p.grad._version for p in handles}

    def _aps_clip_grads(self) -> None:
        if self._aps_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in self._aps_names if p.grad is not None], self._aps_clip)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; gradients pushed since the last step (a GAN's discriminator in
        the generator's backward) are first waited for and thrown away -- every rank does the same
        -- except in single-phase server mode, where the aggregators already stepped with them."""
        if self._aps_handles:
            if self._aps_mode == "server" and not self._aps_two_phase:
                names = sorted(self._aps_names[p] for p in self._aps_handles)
                raise AutoPSError(
                    f"zero_grad() would throw away gradients already pushed ({', '.join(names[:3])}"
                    f"{', ...' if len(names) > 3 else ''}): in server mode the aggregators step with every pushed "
                    f"gradient; freeze the model with requires_grad_(False) during the backward that should not "
                    f"update it, or construct DistributedOptimizer with averaged_grads=True")
            self.synchronize()
            self._aps_synced = False
        super().zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize again (call ``synchronize()`` first)."""
        self._aps_skip = True
        try:
            yield
        finally:
            self._aps_skip = False

    def step(self, closure=None):
        ctx = self._aps_ctx
        if ctx.agent is None or not self._aps_names:
            self.synchronize()
            self._aps_synced = False
            return super().step(closure)
        if closure is not None:
            raise AutoPSError("step(closure) is not supported by DistributedOptimizer")
        if not self._aps_synced:
            if self._aps_skip:
                raise AutoPSError("step() inside skip_synchronize() before synchronize(): call opt.synchronize() "
                                  "after backward() and before the block")
            self.synchronize()
        self._aps_synced = False
        if self._aps_mode == "sum":
            return super().step()
        if self._aps_two_phase:
            self._aps_server_step()
        else:
            for p, version in self._aps_synced_versions.items():
                if p.grad is not None and p.grad._version != version:
                    raise AutoPSError(
                        f"gradient of {self._aps_names[p]!r} was changed after synchronize(): in server mode the "
                        f"aggregators already stepped with the gradients pushed in backward(); construct "
                        f"DistributedOptimizer with clip_grad_norm=MAX_NORM to clip, or averaged_grads=True to "
                        f"change the averaged gradients before step()")
        with torch.no_grad():
            for p in self._aps_stepped:
                p.copy_(self._aps_staging[p])
        return None

    def _aps_server_step(self) -> None:
        """Two-phase server mode: send the averaged gradients (rank 0's; zeros from the other
        ranks, summed) to the server keys, and pull the parameters the aggregators' optimizer made."""
        ctx = self._aps_ctx
        handles = {}
        for p, name in self._aps_names.items():
            if p.grad is None:           # no rank used it: not stepped, as in one process
                continue
            grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            if ctx.rank != 0:
                grad = self._aps_zeros.get(p)
                if grad is None:
                    grad = self._aps_zeros[p] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            it = self._aps_server_iter[p] = self._aps_server_iter.get(p, 0) + 1
            handles[p] = self._aps_send(name, grad, self._aps_staging[p], it, self._aps_changed_hp(p))
        for handle in handles.values():
            if isinstance(handle, StagedHandle):
                handle.submitted()
        ctx.agent.flush()
        for handle in handles.values():
            handle.wait()
        self._aps_stepped = set(handles)

    # --- checkpoints --------------------------------------------------------------------
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
        iterations = self._aps_server_iter if self._aps_two_phase else self._aps_iter
        handles = {p: agent.fetch_state(name, iterations.get(p, 0)) for p, name in self._aps_names.items()}
        for p, handle in handles.items():
            handle.wait()
            state: dict[str, Any] = {}
            if self._aps_optimizer != "sgd":        # torch's Adam/AdamW keep the step as a tensor
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(float(handle.step), dtype=scalar)
            for key, value in handle.state.items():
                state[key] = torch.from_numpy(value).view(p.shape).to(device=p.device, dtype=p.dtype)
            self.state[p] = state


def create_missing_state(optimizer: torch.optim.Optimizer, params: list) -> None:
    """Give ``params`` the optimizer state a first step makes (to be overwritten by a
    broadcast): one step of the unwrapped optimizer with zero gradients, the parameters and
    gradients restored afterwards."""
    if not params:
        return
    others = [p for group in optimizer.param_groups for p in group["params"] if p not in set(params)]
    saved = {p: (p.detach().clone(), p.grad) for p in params}
    hidden = {p: p.grad for p in others}
    try:
        for p in others:
            p.grad = None
        for p in params:
            p.grad = torch.zeros_like(p)
        step = super(DistributedMixin, optimizer).step if isinstance(optimizer, DistributedMixin) else optimizer.step
        step()
    finally:
        with torch.no_grad():
            for p, (value, grad) in saved.items():
                p.copy_(value)
                p.grad = grad
        for p, grad in hidden.items():
            p.grad = grad


def group_scalars(group: dict) -> torch.Tensor | None:
    """A param group's numeric options (lr, betas, weight_decay, ...) in one float64 tensor."""
    values = []
    for key in sorted(k for k in group if k != "params"):
        value = group[key]
        items = value if isinstance(value, tuple) else (value,)
        if items and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            values.extend(float(v) for v in items)
    return torch.tensor(values, dtype=torch.float64) if values else None


def set_group_scalars(group: dict, values: torch.Tensor | None) -> None:
    """Put back what ``group_scalars`` packed (with the types the options had)."""
    if values is None:
        return
    it = iter(values.tolist())
    for key in sorted(k for k in group if k != "params"):
        value = group[key]
        items = value if isinstance(value, tuple) else (value,)
        if items and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            new = tuple(type(v)(next(it)) for v in items)
            group[key] = new if isinstance(value, tuple) else new[0]


def wrap_optimizer(optimizer: torch.optim.Optimizer, ctx: WorkerContext, named_parameters=None,
                   mode: str = "sum", **options: Any) -> torch.optim.Optimizer:
    """``optimizer`` as an instance of a subclass of its class with ``DistributedMixin``,
    sharing its state (see ``autops.torch.DistributedOptimizer`` for the options)."""
    if mode not in ("sum", "server"):
        raise ValueError(f"mode must be 'sum' or 'server', got {mode!r}")
    passes = options.get("backward_passes_per_step", 1)
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
    clip = options.get("clip_grad_norm")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ValueError(f"clip_grad_norm must be a positive number, got {clip!r}")
    cls = type(optimizer.__class__.__name__, (DistributedMixin, optimizer.__class__), {})
    wrapped = object.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__
    wrapped._aps_setup(ctx, named_parameters, mode, optimizer.__class__.__name__, **options)
    return wrapped
