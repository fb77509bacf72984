"""Server-side optimizers (SGD, Adam, AdamW) for AutoPS aggregators, in numpy only.

This module owns the update rules an aggregator applies to its master copy of a parameter
(a flat, C-contiguous float32 or float64 numpy array) once the averaged gradient of an
iteration is in (their hyper-parameters are checked by ``autops.wire.optimizers``, which
workers and pMaster use too). It must not import torch: aggregators stay light.

Numerics follow ``torch.optim``'s default single-tensor CPU path (``foreach=False``) op by
op: Python-float scalars are computed in double exactly as torch computes them (``1 - beta1``,
``lr / (1 - beta1 ** step)``, ``(1 - beta2 ** step) ** 0.5``, ``1 - lr * weight_decay``) and
then rounded once to the parameter's dtype; every elementwise op rounds in that dtype in
torch's order (``lerp`` uses torch's two branches on ``|weight| < 0.5``, ``addcmul`` is
``self + (value * t1) * t2``, ``addcdiv`` is ``self + (value * t1) / t2``). torch's vectorized
x86 (AVX2/AVX512) and ARM kernels fuse the multiply-add of ``add(alpha=)``, ``lerp`` and
``addcmul`` into one rounding; with ``fma=True`` (the default) those fused multiply-adds are
reproduced for float32 through an exact float64 product. Measured against torch 2.13 on
AVX2 and AVX512, SGD is then bit-identical and Adam/AdamW differ only through ``sqrt``, which torch
takes from MKL (within 1 ulp, not always correctly rounded). ``fma=False`` rounds product and
sum separately, which is what torch's scalar (``ATEN_CPU_CAPABILITY=default``) kernels do.
For float64 parameters the multiply-adds are always unfused (differences near 1e-16).

Memory: state arrays are exactly torch's (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``). ``grad`` is read only. Every temporary lives in a small work array and
the update runs over the parameter in chunks of about :data:`SCRATCH_CHUNK_ELEMS` elements:
pass one array from :func:`make_scratch` as ``scratch`` to ``step`` (one per thread), or leave
it out and a work array shared by all optimizers of the calling thread is used (768 KiB per
thread). Nothing of the parameter's size is allocated besides the state.

One optimizer instance serves one parameter; instances are not thread-safe.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..wire.optimizers import check_name, hyperparameters, is_real, plain

__all__ = [
    "SCRATCH_CHUNK_ELEMS",
    "SGD",
    "Adam",
    "AdamW",
    "ServerOptimizer",
    "make_optimizer",
    "make_scratch",
]

#: Elements per chunk of the elementwise passes (float64 parameters; float32 ones take 1.5x).
SCRATCH_CHUNK_ELEMS = 1 << 15

# the elementwise square root (a module attribute so that tests can swap in torch's)
_sqrt = np.sqrt
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def make_scratch(chunk_elems: int = SCRATCH_CHUNK_ELEMS) -> np.ndarray:
    """A work array for ``step(..., scratch=)`` of any optimizer (float32 or float64
    parameter, any size): float64, ``3 * chunk_elems`` elements. Share one per thread."""
    if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, (int, np.integer)) or chunk_elems < 1:
        raise ValueError(f"chunk_elems must be a positive integer, got {chunk_elems!r}")
    return np.empty(3 * int(chunk_elems), dtype=np.float64)


_thread_scratch = threading.local()


def _default_scratch() -> np.ndarray:
    work = getattr(_thread_scratch, "work", None)
    if work is None:
        work = _thread_scratch.work = make_scratch()
    return work


# --- base class --------------------------------------------------------------------------

class ServerOptimizer(ABC):
    """An optimizer for one parameter held by an aggregator.

    ``hp`` takes torch's keyword names and defaults; unknown keys or bad values raise
    ``ValueError`` naming the key. ``step_count`` is the number of steps taken (torch's
    ``state["step"]`` for Adam/AdamW).
    """

    name: ClassVar[str] = ""

    def __init__(self, hp: Mapping[str, Any], *, fma: bool = True) -> None:
        #: reproduce the fused multiply-adds of torch's vectorized CPU kernels (float32)
        self.fma = bool(fma)
        self._hp: dict[str, Any] = hyperparameters(self.name, hp)
        self.step_count: int = 0
        self._size: int | None = None
        self._dtype: np.dtype | None = None

    # -- hyper-parameters
    @property
    def hp(self) -> dict[str, Any]:
        """A copy of the current hyper-parameters (all keys, defaults filled in)."""
        return dict(self._hp)

    def set_hp(self, hp: Mapping[str, Any]) -> None:
        """Change some or all hyper-parameters (e.g. the lr an LR scheduler set); the new set
        is validated as a whole and applied only if valid."""
        self._hp = hyperparameters(self.name, hp, current=self._hp)
        if self._size is not None:
            self._after_set_hp()

    def _after_set_hp(self) -> None:
        pass

    # -- state
    def init_state(self, param: np.ndarray, slots: Sequence[np.ndarray] = ()) -> None:
        """Bind to ``param`` (size and dtype) and allocate fresh state (zeros, step 0), as
        torch does on a parameter's first step. Calling it again resets the state.

        ``slots``: ``state_slots()`` zero-filled flat arrays of the parameter's size and dtype
        to hold the state (memory populated ahead of a migration); without them the
        optimizer allocates its own."""
        p = self._flat_param(param)
        given = list(slots)
        if given and (len(given) != self.state_slots() or any(
                not isinstance(a, np.ndarray) or a.ndim != 1 or a.size != p.size or a.dtype != p.dtype
                or not a.flags.writeable for a in given)):
            raise ValueError(f"{self.name}: state slots must be {self.state_slots()} writable flat arrays "
                             f"of {p.size} x {p.dtype}")
        self._size, self._dtype = p.size, p.dtype
        self.step_count = 0
        self._alloc_state(iter(given))

    @abstractmethod
    def state_slots(self) -> int:
        """How many arrays of the parameter's size the state takes (``init_state``'s slots)."""
        raise NotImplementedError

    @abstractmethod
    def _alloc_state(self, slots: Iterator[np.ndarray] | None = None) -> None:
        raise NotImplementedError

    def _zeros(self, slots: Iterator[np.ndarray] | None) -> np.ndarray:
        """The next given slot (zero-filled by its maker), else a new array of zeros."""
        given = next(slots, None) if slots is not None else None
        return np.zeros(self._size, dtype=self._dtype) if given is None else given

    @abstractmethod
    def state_arrays(self) -> dict[str, np.ndarray]:
        """The live state arrays under torch's names (flat; not copies). Empty before
        ``init_state``."""
        raise NotImplementedError

    def load_state(self, arrays: Mapping[str, Any], step: int) -> None:
        """Load torch-compatible state (``torch.optim`` names, any shape with the parameter's
        number of elements, anything ``np.asarray`` takes) and the step count. Without a
        prior ``init_state`` the state takes the arrays' size and dtype."""
        step = self._checked_step(step)
        if not isinstance(arrays, Mapping):
            raise ValueError(f"{self.name}: state must be a dict of arrays, got {type(arrays).__name__}")
        known = self._state_names()
        flat: dict[str, np.ndarray] = {}
        for key, value in arrays.items():
            if key not in known:
                raise ValueError(f"{self.name}: unknown state array {key!r} (accepted: {', '.join(known)})")
            if value is None:
                continue
            a = np.asarray(value)
            if a.dtype not in _FLOAT_DTYPES:
                raise ValueError(f"{self.name}: state array {key!r} has dtype {a.dtype}, "
                                 "expected float32 or float64")
            flat[key] = a.reshape(-1)
        if self._size is None:
            if not flat:
                raise ValueError(f"{self.name}: load_state before init_state needs state arrays")
            first = next(iter(flat.values()))
            self._size, self._dtype = first.size, first.dtype
            self._alloc_state()
        for key, a in flat.items():
            if a.size != self._size:
                raise ValueError(f"{self.name}: state array {key!r} has {a.size} elements, "
                                 f"the parameter has {self._size}")
        self._load(flat, step)
        self.step_count = step

    def _checked_step(self, step: Any) -> int:
        step = plain(step)
        if not is_real(step) or not float(step).is_integer() or step < 0:
            raise ValueError(f"{self.name}: step must be a non-negative integer, got {step!r}")
        return int(step)

    @abstractmethod
    def _state_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    @abstractmethod
    def _load(self, arrays: dict[str, np.ndarray], step: int) -> None:
        raise NotImplementedError

    # -- stepping
    def step(self, param: np.ndarray, grad: np.ndarray, scratch: np.ndarray | None = None) -> None:
        """Update ``param`` in place with the (already averaged) gradient ``grad``.

        ``grad`` is read only (same dtype and number of elements as ``param``; it must not
        overlap ``param``). ``scratch`` is an optional work array from :func:`make_scratch`
        (any float64 C-contiguous array of >= 3 elements); without it the calling thread's
        shared one is used.
        """
        p = self._flat_param(param)
        if self._size is None:
            self.init_state(p)
        elif p.size != self._size or p.dtype != self._dtype:
            raise ValueError(f"{self.name}: parameter is {p.size} x {p.dtype}, the optimizer "
                             f"state is {self._size} x {self._dtype}")
        if not isinstance(grad, np.ndarray):
            raise TypeError(f"{self.name}: grad must be a numpy array, got {type(grad).__name__}")
        if grad.dtype != p.dtype:
            raise TypeError(f"{self.name}: grad dtype {grad.dtype} differs from param dtype {p.dtype}")
        if grad.size != p.size:
            raise ValueError(f"{self.name}: grad has {grad.size} elements, param has {p.size}")
        if np.may_share_memory(p, grad):
            raise ValueError(f"{self.name}: grad must not overlap param")
        g = grad.reshape(-1)
        work = self._work(p, g, scratch)
        self.step_count += 1
        self._step(p, g, work)

    def _flat_param(self, param: np.ndarray) -> np.ndarray:
        if not isinstance(param, np.ndarray):
            raise TypeError(f"{self.name}: param must be a numpy array, got {type(param).__name__}")
        if param.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{self.name}: param dtype must be float32 or float64, got {param.dtype}")
        if not param.flags.c_contiguous or not param.flags.writeable:
            raise ValueError(f"{self.name}: param must be a writeable C-contiguous array")
        return param.reshape(-1)

    def _work(self, p: np.ndarray, g: np.ndarray, scratch: np.ndarray | None) -> _Work:
        if scratch is None:
            work = _default_scratch()
        else:
            if not isinstance(scratch, np.ndarray) or scratch.dtype != np.float64:
                raise TypeError(f"{self.name}: scratch must be a float64 numpy array (make_scratch())")
            if not scratch.flags.c_contiguous or not scratch.flags.writeable or scratch.size < 3:
                raise ValueError(f"{self.name}: scratch must be a writeable C-contiguous array "
                                 "of at least 3 elements")
            if np.may_share_memory(scratch, p) or np.may_share_memory(scratch, g):
                raise ValueError(f"{self.name}: scratch must not overlap param or grad")
            work = scratch.reshape(-1)
        return _Work(work, p.dtype, self.fma)

    @abstractmethod
    def _step(self, p: np.ndarray, g: np.ndarray, work: _Work) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._hp!r}, step_count={self.step_count})"


class _Work:
    """Chunked views of a float64 work array: ``d`` (float64, for multiply-adds) and two
    temporaries ``s1``/``s2`` of the parameter's dtype, each ``chunk`` elements."""

    __slots__ = ("chunk", "d", "s1", "s2", "fused")

    def __init__(self, work: np.ndarray, dtype: np.dtype, fma: bool) -> None:
        if dtype == np.float32:
            chunk = work.size // 2
            s = work[chunk:2 * chunk].view(np.float32)
            self.s1, self.s2 = s[:chunk], s[chunk:]
        else:
            chunk = work.size // 3
            self.s1, self.s2 = work[chunk:2 * chunk], work[2 * chunk:3 * chunk]
        self.chunk = chunk
        self.d = work[:chunk]
        # float32 products are exact in float64: a*b + c rounded once (to double, then to
        # float32: double rounding, wrong only on exact float32 midpoints) is torch's fmadd
        self.fused = fma and dtype == np.float32

    def madd(self, x: np.ndarray, y: Any, c: np.ndarray, out: np.ndarray) -> None:
        """``out = x * y + c`` with torch's rounding; ``out`` may be ``x`` or ``c``."""
        d = self.d[:out.size]
        if self.fused:
            np.multiply(x, y, out=d, dtype=np.float64)
            np.add(d, c, out=out, casting="same_kind")
        else:
            t = d if out.dtype == np.float64 else d.view(out.dtype)[:out.size]
            np.multiply(x, y, out=t)
            np.add(c, t, out=out)


def _effective_grad(pc: np.ndarray, gc: np.ndarray, a: np.ndarray, b: np.ndarray,
                    wd: Any, maximize: bool, w: _Work) -> tuple[np.ndarray, np.ndarray, bool]:
    """torch: ``grad = -grad if maximize``; ``grad = grad.add(param, alpha=wd)`` if ``wd``.

    Returns (effective grad, a free temporary, whether the effective grad is a temporary).
    """
    if maximize:
        np.negative(gc, out=a)
        if wd is not None:
            w.madd(pc, wd, a, out=a)
        return a, b, True
    if wd is not None:
        w.madd(pc, wd, gc, out=a)
        return a, b, True
    return gc, a, False


# --- SGD -----------------------------------------------------------------------------------

class SGD(ServerOptimizer):
    """torch.optim.SGD (``_single_tensor_sgd``). ``lr`` is required."""

    name = "sgd"

    def __init__(self, hp: Mapping[str, Any], *, fma: bool = True) -> None:
        self._buf: np.ndarray | None = None
        self._buf_valid = False
        super().__init__(hp, fma=fma)

    def state_slots(self) -> int:
        return 1 if self._hp["momentum"] != 0 else 0

    def _alloc_state(self, slots: Iterator[np.ndarray] | None = None) -> None:
        # torch creates the buffer on the first momentum step (a clone of the gradient);
        # allocate it up front when momentum is on, but mark it not yet valid.
        self._buf = self._zeros(slots) if self._hp["momentum"] != 0 else None
        self._buf_valid = False

    def _state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def state_arrays(self) -> dict[str, np.ndarray]:
        if self._buf is not None and self._buf_valid:
            return {"momentum_buffer": self._buf}
        return {}

    def _load(self, arrays: dict[str, np.ndarray], step: int) -> None:
        buf = arrays.get("momentum_buffer")
        if buf is None:            # torch: no buffer yet (or momentum == 0)
            self._buf_valid = False
            return
        if self._buf is None:
            self._buf = np.empty(self._size, dtype=self._dtype)
        np.copyto(self._buf, buf, casting="same_kind")
        self._buf_valid = True

    def _step(self, p: np.ndarray, g: np.ndarray, work: _Work) -> None:
        hp = self._hp
        dt = p.dtype.type
        neg_lr = dt(-hp["lr"])                       # param.add_(grad, alpha=-lr)
        wd = dt(hp["weight_decay"]) if hp["weight_decay"] != 0 else None
        momentum = hp["momentum"]
        mom = dt(momentum)
        alpha = 1 - hp["dampening"]                  # buf.add_(grad, alpha=1 - dampening)
        alpha_c = dt(alpha)
        nesterov, maximize = hp["nesterov"], hp["maximize"]
        use_mom = momentum != 0
        first = False
        buf = self._buf
        if use_mom:
            if buf is None:
                buf = self._buf = np.empty(p.size, dtype=p.dtype)
            first = not self._buf_valid
        n, chunk = p.size, work.chunk
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            k = hi - lo
            pc, gc, a, b = p[lo:hi], g[lo:hi], work.s1[:k], work.s2[:k]
            u, free, _ = _effective_grad(pc, gc, a, b, wd, maximize, work)
            if use_mom:
                bc = buf[lo:hi]
                if first:
                    np.copyto(bc, u)                 # buf = clone(grad)
                else:
                    np.multiply(bc, mom, out=bc)     # buf.mul_(momentum).add_(grad, alpha=...)
                    if alpha == 1:
                        np.add(bc, u, out=bc)        # x + 1*y: one rounding either way
                    else:
                        work.madd(u, alpha_c, bc, out=bc)
                if nesterov:                         # grad = grad.add(buf, alpha=momentum)
                    work.madd(bc, mom, u, out=free)
                    u = free
                else:
                    u = bc
            work.madd(u, neg_lr, pc, out=pc)
        if use_mom:
            self._buf_valid = True


# --- Adam / AdamW --------------------------------------------------------------------------

class Adam(ServerOptimizer):
    """torch.optim.Adam (``_single_tensor_adam``), including ``decoupled_weight_decay``."""

    name = "adam"
    _DECOUPLED: ClassVar[bool | None] = None     # None: from the hyper-parameter

    def __init__(self, hp: Mapping[str, Any], *, fma: bool = True) -> None:
        self._exp_avg: np.ndarray | None = None
        self._exp_avg_sq: np.ndarray | None = None
        self._max_exp_avg_sq: np.ndarray | None = None
        super().__init__(hp, fma=fma)

    @property
    def decoupled(self) -> bool:
        if self._DECOUPLED is not None:
            return self._DECOUPLED
        return bool(self._hp["decoupled_weight_decay"])

    def state_slots(self) -> int:
        return 3 if self._hp["amsgrad"] else 2

    def _alloc_state(self, slots: Iterator[np.ndarray] | None = None) -> None:
        self._exp_avg = self._zeros(slots)
        self._exp_avg_sq = self._zeros(slots)
        self._max_exp_avg_sq = self._zeros(slots) if self._hp["amsgrad"] else None

    def _after_set_hp(self) -> None:
        if self._hp["amsgrad"] and self._max_exp_avg_sq is None:
            self._max_exp_avg_sq = np.zeros(self._size, dtype=self._dtype)

    def _state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def state_arrays(self) -> dict[str, np.ndarray]:
        if self._exp_avg is None:
            return {}
        out = {"exp_avg": self._exp_avg, "exp_avg_sq": self._exp_avg_sq}
        if self._max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = self._max_exp_avg_sq
        return out

    def _load(self, arrays: dict[str, np.ndarray], step: int) -> None:
        if not arrays and step == 0:       # torch's state before the first step
            self._alloc_state()
            return
        required = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self._hp["amsgrad"] else [])
        for key in required:
            if key not in arrays:
                raise ValueError(f"{self.name}: state array {key!r} is missing")
        if "max_exp_avg_sq" in arrays and self._max_exp_avg_sq is None:
            self._max_exp_avg_sq = np.empty(self._size, dtype=self._dtype)
        for key, a in arrays.items():
            np.copyto(getattr(self, "_" + key), a, casting="same_kind")

    def _step(self, p: np.ndarray, g: np.ndarray, work: _Work) -> None:
        hp = self._hp
        dt = p.dtype.type
        beta1, beta2 = hp["betas"]
        lr, weight_decay, eps = hp["lr"], hp["weight_decay"], hp["eps"]
        amsgrad, maximize = hp["amsgrad"], hp["maximize"]
        step = self.step_count                       # already incremented, like step_t += 1
        # scalars in double exactly as torch computes them, then rounded to the dtype
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        neg_step_size = dt(-step_size)               # addcdiv_(..., value=-step_size)
        bc2_sqrt = dt(bias_correction2_sqrt)
        eps_c = dt(eps)
        weight = dt(1 - beta1)                       # lerp_(grad, 1 - beta1), weight in dtype
        weight_small = abs(weight) < 0.5
        weight_minus_1 = weight - dt(1)
        b2 = dt(beta2)
        one_minus_b2 = dt(1 - beta2)                 # addcmul_(grad, grad, value=1 - beta2)
        decay = l2 = None
        if weight_decay != 0:
            if self.decoupled:
                decay = dt(1 - lr * weight_decay)    # param.mul_(1 - lr * weight_decay)
            else:
                l2 = dt(weight_decay)                # grad = grad.add(param, alpha=wd)
        if amsgrad and self._max_exp_avg_sq is None:
            self._max_exp_avg_sq = np.zeros(p.size, dtype=p.dtype)
        m_all, v_all, vmax_all = self._exp_avg, self._exp_avg_sq, self._max_exp_avg_sq
        n, chunk = p.size, work.chunk
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            k = hi - lo
            pc, gc, a, b = p[lo:hi], g[lo:hi], work.s1[:k], work.s2[:k]
            m, v = m_all[lo:hi], v_all[lo:hi]
            if decay is not None:
                np.multiply(pc, decay, out=pc)
            e, free, _ = _effective_grad(pc, gc, a, b, l2, maximize, work)
            # exp_avg.lerp_(e, weight), torch's CPU lerp (vectorized: fmadd(coeff, e - m, base)):
            #   |weight| < 0.5: m + weight * (e - m)   else: e + (weight - 1) * (e - m)
            if weight_small:
                np.subtract(e, m, out=free)
                work.madd(free, weight, m, out=m)
            else:
                np.subtract(e, m, out=m)
                work.madd(m, weight_minus_1, e, out=m)
            # exp_avg_sq.mul_(beta2).addcmul_(e, e, value=1 - beta2): v + ((1 - beta2) * e) * e
            np.multiply(v, b2, out=v)
            np.multiply(e, one_minus_b2, out=free)
            work.madd(free, e, v, out=v)
            # denom = (v.sqrt() / bias_correction2_sqrt).add_(eps), v = max_exp_avg_sq if amsgrad
            if amsgrad:
                vmax = vmax_all[lo:hi]
                np.maximum(vmax, v, out=vmax)
                v = vmax
            _sqrt(v, out=a)
            np.divide(a, bc2_sqrt, out=a)
            np.add(a, eps_c, out=a)
            # param.addcdiv_(exp_avg, denom, value=-step_size): p + ((-step_size) * m) / denom
            np.multiply(m, neg_step_size, out=b)
            np.divide(b, a, out=b)
            np.add(pc, b, out=pc)


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (default 1e-2)."""

    name = "adamw"
    _DECOUPLED = True


_CLASSES: dict[str, type[ServerOptimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(name: str, hp: Mapping[str, Any], *, fma: bool = True) -> ServerOptimizer:
    """A server optimizer by name (``"sgd"``, ``"adam"`` or ``"adamw"``) with torch-named
    hyper-parameters; ``ValueError`` for an unknown name, unknown keys or bad values.
    ``fma``: see the module docstring."""
    return _CLASSES[check_name(name)](hp, fma=fma)
