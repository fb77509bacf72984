"""The aggregator's keyed tensor store (mechanism, no sockets).

Per key ``(job, key)``: a preallocated accumulator (copy on the first push of an iteration,
in-place add after), the completed iteration counter, and the published value:

* ``sum`` mode publishes the sum (or mean) of the ``W`` pushes of iteration ``i``. Two
  buffers alternate by iteration parity so that iteration ``i+1`` can accumulate while
  slower workers still read iteration ``i``.
* ``server`` mode keeps the master copy and a server-side optimizer; when all ``W``
  pushes of ``i`` are in, the optimizer updates the master copy, which is what pulls of
  ``i`` return (pulls of ``0`` return the initial value set by ``INIT``).

A pull of iteration ``i`` is ready when ``i`` is published; the store never blocks, it
tells the caller which keys became ready so the server loop can answer parked pulls.
Every violation (unknown job or key, wrong secret, shape, dtype or iteration) raises
``StoreError`` with a message naming the problem; the store's state is unchanged then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .partition import KeySpec

MODES = ("sum", "server")


def _optim():
    from . import optim   # server mode only
    return optim


class StoreError(Exception):
    """A request that cannot be applied; the text goes back to that client only."""


@dataclass
class KeyState:
    spec: KeySpec
    mode: str
    world_size: int
    average: bool
    completed: int = 0                 # iterations whose aggregation is done
    ranks: set = field(default_factory=set)   # ranks that pushed the open iteration
    buffers: list = field(default_factory=list)  # sum: 2 alternating accumulators
    param: np.ndarray | None = None    # server: master copy (None until INIT)
    grad: np.ndarray | None = None     # server: gradient accumulator
    optimizer: Any = None
    cpu_seconds: float = 0.0           # time spent aggregating this key (profiling)
    bytes_in: int = 0

    @property
    def open_iteration(self) -> int:
        return self.completed + 1

    @property
    def published(self) -> int:
        """Latest iteration a pull can read; -1 when nothing is readable yet."""
        if self.mode == "server" and self.param is None:
            return -1
        return self.completed

    def accumulator(self) -> np.ndarray:
        if self.mode == "sum":
            return self.buffers[self.open_iteration % 2]
        return self.grad

    def value(self, iteration: int) -> np.ndarray:
        if self.mode == "sum":
            return self.buffers[iteration % 2]
        return self.param


@dataclass
class JobState:
    job: str
    secret: str
    world_size: int
    mode: str
    average: bool
    optimizer: str | None
    hp: dict
    keys: dict = field(default_factory=dict)
    broadcasts: dict = field(default_factory=dict)   # (name, seq) -> [array, gets left]


class Store:
    """All jobs' keys held by one aggregator."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobState] = {}

    # --- control (from the master) ------------------------------------------------
    def assign(self, job: str, secret: str, world_size: int, mode: str, keys: list[KeySpec],
               average: bool = True, optimizer: str | None = None, hp: dict | None = None) -> None:
        """Create the job if new and preallocate the given keys (idempotent per key)."""
        if mode not in MODES:
            raise StoreError(f"job {job}: unknown mode {mode!r} (sum or server)")
        if world_size < 1:
            raise StoreError(f"job {job}: world size must be >= 1")
        if mode == "server":
            _optim().make_optimizer(optimizer or "", hp or {})   # validate before creating anything
        state = self.jobs.get(job)
        if state is None:
            state = JobState(job, secret, world_size, mode, average, optimizer, dict(hp or {}))
            self.jobs[job] = state
        elif state.secret != secret or state.world_size != world_size:
            raise StoreError(f"job {job}: assignment with a different secret or world size")
        for spec in keys:
            if spec.key in state.keys:
                continue
            ks = KeyState(spec, mode, state.world_size, average)
            if mode == "sum":
                ks.buffers = [np.empty(spec.numel, spec.dtype), np.empty(spec.numel, spec.dtype)]
            else:
                ks.grad = np.empty(spec.numel, spec.dtype)
                ks.optimizer = _optim().make_optimizer(optimizer, hp or {})
            state.keys[spec.key] = ks

    def release(self, job: str) -> None:
        self.jobs.pop(job, None)

    # --- data plane -----------------------------------------------------------------
    def job(self, job: str, secret: str) -> JobState:
        state = self.jobs.get(job)
        if state is None:
            raise StoreError(f"job {job!r} is not served by this aggregator")
        if secret != state.secret:
            raise StoreError(f"job {job!r}: wrong secret; a job can only use its own tensors")
        return state

    def key(self, state: JobState, key: str) -> KeyState:
        ks = state.keys.get(key)
        if ks is None:
            raise StoreError(f"job {state.job!r}: key {key!r} is not declared on this aggregator")
        return ks

    @staticmethod
    def _check_rank(state: JobState, rank: int) -> None:
        if not 0 <= rank < state.world_size:
            raise StoreError(f"job {state.job!r}: rank {rank} outside world size {state.world_size}")

    def check_push(self, state: JobState, rank: int, key: str, iteration: int,
                   data: np.ndarray) -> KeyState:
        """Validate one push item without changing anything."""
        self._check_rank(state, rank)
        ks = self.key(state, key)
        spec = ks.spec
        if data.dtype != np.dtype(spec.dtype) or data.size != spec.numel:
            raise StoreError(
                f"job {state.job!r}: push of {key!r} carries {data.size} x {data.dtype}, "
                f"expected {spec.numel} x {spec.dtype}")
        if iteration != ks.open_iteration:
            raise StoreError(
                f"job {state.job!r}: push of {key!r} for iteration {iteration}, "
                f"but the open iteration is {ks.open_iteration}")
        if rank in ks.ranks:
            raise StoreError(f"job {state.job!r}: rank {rank} already pushed {key!r} iteration {iteration}")
        return ks

    def push(self, ks: KeyState, rank: int, data: np.ndarray) -> bool:
        """Apply a validated push; True when it completed the iteration (value published)."""
        start = time.thread_time()
        acc = ks.accumulator()
        if not ks.ranks:
            np.copyto(acc, data)
        else:
            np.add(acc, data, out=acc)
        ks.ranks.add(rank)
        ks.bytes_in += data.nbytes
        done = self._maybe_complete(ks)
        ks.cpu_seconds += time.thread_time() - start
        return done

    def _maybe_complete(self, ks: KeyState) -> bool:
        if len(ks.ranks) < ks.world_size:
            return False
        if ks.mode == "server" and ks.param is None:
            return False          # waits for INIT of the master copy
        acc = ks.accumulator()
        if ks.average and ks.world_size > 1:
            np.divide(acc, ks.world_size, out=acc)
        if ks.mode == "server":
            ks.optimizer.step(ks.param, acc)
        ks.ranks.clear()
        ks.completed += 1
        return True

    def init(self, state: JobState, key: str, data: np.ndarray, hp: dict | None = None,
             opt_state: dict | None = None, step: int | None = None) -> bool:
        """Set a server-mode master copy (and optionally optimizer state); True if it completed
        an iteration that only waited for it."""
        ks = self.key(state, key)
        if ks.mode != "server":
            raise StoreError(f"job {state.job!r}: INIT is only for server mode")
        if data.dtype != np.dtype(ks.spec.dtype) or data.size != ks.spec.numel:
            raise StoreError(f"job {state.job!r}: INIT of {key!r} has {data.size} x {data.dtype}, "
                             f"expected {ks.spec.numel} x {ks.spec.dtype}")
        if ks.param is None:
            ks.param = np.empty(ks.spec.numel, ks.spec.dtype)
            ks.optimizer.init_state(ks.param)
        np.copyto(ks.param, data)
        if hp:
            ks.optimizer.set_hp(hp)
        if opt_state:
            ks.optimizer.load_state(opt_state, int(step or 0))
        return self._maybe_complete(ks)

    @staticmethod
    def set_hp(ks: KeyState, hp: dict) -> None:
        """Hyper-parameters changed on the workers (an LR scheduler); server mode only."""
        if ks.mode == "server":
            ks.optimizer.set_hp(hp)

    def pull_ready(self, ks: KeyState, iteration: int) -> bool:
        """True if ``iteration`` can be read now, False if the pull must wait; raises when stale."""
        published = ks.published
        if iteration == published:
            return True
        if iteration == published + 1:
            return False
        if iteration < published:
            raise StoreError(f"key {ks.spec.key!r}: pull of iteration {iteration} is stale "
                             f"(iteration {published} is published)")
        raise StoreError(f"key {ks.spec.key!r}: pull of iteration {iteration} is ahead of "
                         f"the open iteration {ks.open_iteration}")

    def missing_ranks(self, ks: KeyState) -> list[int]:
        return [r for r in range(ks.world_size) if r not in ks.ranks]

    # --- broadcast -----------------------------------------------------------------
    def bcast_put(self, state: JobState, name: str, seq: int, data: np.ndarray) -> None:
        if state.world_size == 1:
            return
        state.broadcasts[(name, seq)] = [np.array(data, copy=True), state.world_size - 1]

    def bcast_get(self, state: JobState, name: str, seq: int) -> np.ndarray | None:
        entry = state.broadcasts.get((name, seq))
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] <= 0:
            del state.broadcasts[(name, seq)]
        return entry[0]

    # --- reporting -----------------------------------------------------------------
    def bytes_held(self) -> int:
        total = 0
        for state in self.jobs.values():
            for ks in state.keys.values():
                total += sum(b.nbytes for b in ks.buffers)
                for arr in (ks.param, ks.grad):
                    total += arr.nbytes if arr is not None else 0
                if ks.optimizer is not None and ks.param is not None:
                    total += sum(a.nbytes for a in ks.optimizer.state_arrays().values())
        return total
