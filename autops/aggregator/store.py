"""The aggregator's keyed tensor store (mechanism, no sockets).

Per key ``(job, key)``: a preallocated accumulator (copy on the first push of an iteration,
in-place add after), the completed iteration counter, and the published value:

* ``sum`` mode publishes the sum (or mean) of the ``W`` pushes of iteration ``i``. Two
  buffers alternate by iteration parity so that iteration ``i+1`` can accumulate while
  slower workers still read iteration ``i``.
* ``server`` mode keeps the master copy and a server-side optimizer; when all ``W``
  pushes of ``i`` are in, the optimizer updates the master copy, which is what pulls of
  ``i`` return (pulls of ``0`` return the initial value set by ``INIT``).

Pushes that arrive in shared memory (same-host workers) are not copied: the store keeps
a view of the worker's buffer (the worker does not touch it before its pull of ``i``
returns) and sums all views once, when the last push of ``i`` is in, straight into the
published buffer (sum) or into the first worker's staging buffer, which the optimizer then
reads (server: no gradient buffer on the aggregator at all). Pushes
that arrive as socket frames go to the accumulator: the first of an iteration is kept as it
is (the received frame, which nothing else writes) and added to the second in one pass,
straight into the accumulator, instead of being copied there first. Published buffers come
from an injectable allocator so the aggregator can place them in shared memory.

A pull of iteration ``i`` is ready when ``i`` is published; the store never blocks, it
tells the caller which keys became ready so the server loop can answer parked pulls.
Every violation (unknown job or key, wrong secret, shape, dtype or iteration) raises
``StoreError`` with a message naming the problem; the store's state is unchanged then.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..wire.optimizers import MODES
from ..wire.partition import KeySpec
from .moves_state import Arrival, Handover, Move
from .precopy import Follower


def _optim():
    from . import optim   # server mode only
    return optim


class StoreError(Exception):
    """A request that cannot be applied; the text goes back to that client only."""


class SecretMismatch(StoreError):
    """A request that did not present its job's secret (refused and counted)."""


@dataclass
class KeyState:
    spec: KeySpec
    mode: str
    world_size: int
    average: bool
    completed: int = 0                 # iterations whose aggregation is done
    ranks: set = field(default_factory=set)   # ranks that pushed the open iteration
    buffers: list = field(default_factory=list)  # sum: 2 alternating accumulators
    buffer_refs: list = field(default_factory=list)  # how the transport sends them (from the allocator)
    param: np.ndarray | None = None    # server: master copy
    param_ref: Any = None
    initialized: bool = False          # server: master copy set by INIT
    grad: np.ndarray | None = None     # server: accumulator of socket pushes (allocated on first use)
    inline: int = 0                    # pushes of the open iteration already in the accumulator
    first: np.ndarray | None = None    # the open iteration's first socket push, added to the next one
    deferred: list = field(default_factory=list)   # shared-memory views of the open iteration
    optimizer: Any = None
    # live migration (§4.3.2, ``moves_state``): one slot per phase, None outside it. The old
    # side hands over after ``move.cutover``; the new side holds pushes until the copy arrived
    # and reports once the workers' first iteration here is complete
    handover: Handover | None = None   # old side: waiting for its followers to decide the cutover
    move: Move | None = None           # old side: the cutover decided
    followers: dict[str, Follower] = field(default_factory=dict)   # old side: by agg (server mode)
    arrival: Arrival | None = None     # new side
    # pushes held while the copy is missing (migrating here) or while recovering after a
    # failure: (rank, iteration, data, deferred, replay)
    held: list = field(default_factory=list)
    # failures: a sum-mode key taken over without state waits for every rank's last pulled
    # iteration (rank -> iteration) and holds pushes meanwhile; a server-mode key with a
    # replica publishes an iteration only once the replica acknowledged it
    recovering: dict | None = None
    recovered: int = -1                # the latest iteration whose value a rank gave while recovering
    replica: dict | None = None        # {"agg", "endpoints", "host"} of the replica
    replicated: int = -1               # last iteration the replica acknowledged
    replica_sent: int = -1             # last iteration sent to it (-1: full state still to send)
    init_waiters: list = field(default_factory=list)   # INIT replies waiting for the replica
    job: str = ""
    # profiling: CPU seconds spent on this key and iterations completed since the last report
    cpu: float = 0.0
    cpu_iters: int = 0

    @property
    def open_iteration(self) -> int:
        return self.completed + 1

    @property
    def published(self) -> int:
        """Latest iteration a pull can read; -1 when nothing is readable yet."""
        if self.mode == "server" and not self.initialized:
            return -1
        if self.replica is not None and self.mode == "server":
            return min(self.completed, self.replicated)
        return self.completed

    def accumulator(self) -> np.ndarray:
        if self.mode == "sum":
            return self.buffers[self.open_iteration % 2]
        if self.grad is None:
            self.grad = np.empty(self.spec.numel, self.spec.dtype)
        return self.grad

    def value_ref(self, iteration: int) -> Any:
        return self.buffer_refs[iteration % 2] if self.mode == "sum" else self.param_ref

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
    replicas: dict = field(default_factory=dict)     # key -> KeyState this aggregator backs up
    readied: dict = field(default_factory=dict)      # key -> (param, ref, slots) made ready for its replica


class Store:
    """All jobs' keys held by one aggregator."""

    def __init__(self, allocate=None) -> None:
        self.jobs: dict[str, JobState] = {}
        self._allocate = allocate or (lambda job, sizes: [(np.empty(n, d), None) for n, d in sizes])
        self._scratch: dict[str, np.ndarray] = {}
        # server mode: called with (key, averaged gradient) right after each optimizer step,
        # before the iteration counts as completed (the aggregator replicates the step)
        self.on_step = None

    def scratch(self, numel: int, dtype: str) -> np.ndarray:
        """One buffer per dtype, as large as the largest key, reused by every server-mode update."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < numel:
            buf = self._scratch[dtype] = np.empty(numel, dtype)
        return buf[:numel]

    # --- control (from the master) ------------------------------------------------
    @staticmethod
    def buffer_sizes(mode: str, keys: list[KeySpec]) -> list[tuple[int, str]]:
        """The buffers ``assign`` allocates for new ``keys``, in order."""
        copies = 2 if mode == "sum" else 1
        return [(spec.numel, spec.dtype) for spec in dict((k.key, k) for k in keys).values() for _ in range(copies)]

    @staticmethod
    def private_sizes(mode: str, optimizer: str | None, hp: dict | None, keys: list[KeySpec],
                      accumulator: bool = True) -> list[tuple[int, str]]:
        """The arrays beside ``buffer_sizes`` that ``assign``'s ``private`` takes for new
        ``keys``, in order: per server-mode key its gradient accumulator (unless not
        ``accumulator``: a replica's) and its optimizer's state slots; none in sum mode.
        ``ValueError`` for an unknown optimizer."""
        if mode != "server":
            return []
        per_key = int(accumulator) + _optim().make_optimizer(optimizer or "", hp or {}).state_slots()
        return [(spec.numel, spec.dtype) for spec in dict((k.key, k) for k in keys).values() for _ in range(per_key)]

    def assign(self, job: str, secret: str, world_size: int, mode: str, keys: list[KeySpec],
               average: bool = True, optimizer: str | None = None, hp: dict | None = None,
               buffers: list | None = None, private: list | None = None) -> None:
        """Create the job if new and preallocate the given keys (idempotent per key).

        ``buffers``: ``(array, reference)`` pairs allocated beforehand for all of ``keys``
        (``buffer_sizes``), used instead of the allocator when every key is new; ``private``:
        zero-filled arrays for them (``private_sizes``), used likewise."""
        state = self.ensure_job(job, secret, world_size, mode, average, optimizer, hp)
        fresh = [spec for spec in dict((k.key, k) for k in keys).values() if spec.key not in state.keys]
        copies = 2 if mode == "sum" else 1
        if buffers is not None and len(fresh) * copies == len(buffers):
            arrays = iter(buffers)
        else:
            arrays = iter(self._allocate(job, [(spec.numel, spec.dtype) for spec in fresh for _ in range(copies)]))
        given, per_key = None, 0
        if private and len(private) == len(self.private_sizes(mode, optimizer, hp, fresh)):
            given, per_key = iter(private), len(private) // len(fresh)
        for spec in fresh:
            ks = KeyState(spec, mode, state.world_size, average, job=job)
            if mode == "sum":
                (a0, r0), (a1, r1) = next(arrays), next(arrays)
                ks.buffers, ks.buffer_refs = [a0, a1], [r0, r1]
            else:
                ks.param, ks.param_ref = next(arrays)
                ks.optimizer = _optim().make_optimizer(optimizer, hp or {})
                if given is not None:
                    ks.grad, *slots = (next(given) for _ in range(per_key))
                    ks.optimizer.init_state(ks.param, slots)
                else:
                    ks.optimizer.init_state(ks.param)
            state.keys[spec.key] = ks

    def ensure_job(self, job: str, secret: str, world_size: int, mode: str, average: bool = True,
                   optimizer: str | None = None, hp: dict | None = None) -> JobState:
        """The job's record, created if new; StoreError if the settings are invalid or differ."""
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
        return state

    def release(self, job: str) -> None:
        self.jobs.pop(job, None)

    # --- data plane -----------------------------------------------------------------
    def job(self, job: str, secret: str) -> JobState:
        state = self.jobs.get(job)
        if state is None:
            raise StoreError(f"job {job!r} is not served by this aggregator")
        if not isinstance(secret, str) or not hmac.compare_digest(secret.encode(), state.secret.encode()):
            raise SecretMismatch(f"wrong secret for job {job}; a job can only use its own tensors")
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

    def push(self, ks: KeyState, rank: int, data: np.ndarray, deferred: bool = False) -> bool:
        """Apply a validated push; True when it completed the iteration (value published).

        ``deferred``: ``data`` is a view of the worker's shared memory that stays valid until
        this iteration is published; it is summed at completion instead of copied now.
        """
        if deferred:
            ks.deferred.append(data)
        elif ks.inline == 0 and ks.first is None:
            ks.first = data          # kept (a received frame): summed with the next push in one pass
        else:
            acc = ks.accumulator()
            if ks.first is not None:
                np.add(ks.first, data, out=acc)
                ks.first = None
                ks.inline = 2
            else:
                np.add(acc, data, out=acc)
                ks.inline += 1
        ks.ranks.add(rank)
        return self._maybe_complete(ks)

    def _maybe_complete(self, ks: KeyState) -> bool:
        if len(ks.ranks) < ks.world_size:
            return False
        if ks.mode == "server" and not ks.initialized:
            return False          # waits for INIT of the master copy
        acc = self._reduce(ks)
        if ks.average and ks.world_size > 1:
            np.divide(acc, ks.world_size, out=acc)
        if ks.mode == "server":
            ks.optimizer.step(ks.param, acc)
            if self.on_step is not None:
                self.on_step(ks, acc)
        ks.ranks.clear()
        ks.deferred.clear()
        ks.inline = 0
        ks.first = None
        ks.completed += 1
        ks.cpu_iters += 1
        return True

    def _reduce(self, ks: KeyState) -> np.ndarray:
        """The sum of all pushes of the open iteration, in the accumulator or a scratch buffer."""
        views = ks.deferred if ks.first is None else [ks.first, *ks.deferred]
        if ks.inline:
            acc = ks.accumulator()
        elif ks.mode == "sum":
            acc = ks.buffers[ks.open_iteration % 2]
        elif views[0].flags.writeable:
            # server mode: sum into the first worker's staging buffer, which that worker does
            # not read and does not rewrite before this update has been published
            acc = views[0]
            for view in views[1:]:
                np.add(acc, view, out=acc)
            return acc
        else:
            acc = self.scratch(ks.spec.numel, ks.spec.dtype)
        if not ks.inline:
            if len(views) >= 2:
                np.add(views[0], views[1], out=acc)
                views = views[2:]
            else:
                np.copyto(acc, views[0])
                views = views[1:]
        for view in views:
            np.add(acc, view, out=acc)
        return acc

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
        np.copyto(ks.param, data)
        ks.initialized = True
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
        arrival = ks.arrival
        if arrival is not None and arrival.copy_missing or ks.recovering is not None:
            return False          # migrating here (the copy is missing) or recovering after a failure
        published = ks.published
        if iteration == published:
            return True
        if published < iteration <= ks.open_iteration:
            return False          # server mode may still wait for INIT of the master copy
        if iteration < published:
            raise StoreError(f"key {ks.spec.key!r}: pull of iteration {iteration} is stale "
                             f"(iteration {published} is published)")
        raise StoreError(f"key {ks.spec.key!r}: pull of iteration {iteration} is ahead of "
                         f"the open iteration {ks.open_iteration}")

    # --- live migration --------------------------------------------------------------
    @staticmethod
    def export_key(ks: KeyState) -> tuple[dict, list[np.ndarray]]:
        """What the new aggregator needs to continue ``ks``: counters, and in server mode the
        master copy, optimizer state and step. The arrays are the live ones (not copies)."""
        meta = {"completed": ks.completed, "initialized": ks.initialized, "state": []}
        arrays: list[np.ndarray] = []
        if ks.mode == "server":
            arrays.append(ks.param)
            for name, arr in ks.optimizer.state_arrays().items():
                meta["state"].append(name)
                arrays.append(arr)
            meta["step"] = ks.optimizer.step_count
            meta["hp"] = ks.optimizer.hp
        return meta, arrays

    def export_state(self, ks: KeyState, iteration: int) -> tuple[dict, list[np.ndarray]]:
        """``export_key`` of a server-mode key whose last completed iteration is ``iteration``
        (what a checkpoint taken after that iteration needs); StoreError otherwise."""
        if ks.mode != "server":
            raise StoreError(f"key {ks.spec.key!r} is in {ks.mode} mode: its optimizer state is on the workers")
        if ks.arrival is not None and ks.arrival.copy_missing or not ks.initialized:
            raise StoreError(f"key {ks.spec.key!r} has no master copy here yet; retry after the next step")
        if ks.completed != iteration:
            raise StoreError(f"state of {ks.spec.key!r} after iteration {iteration} is not available: "
                             f"iteration {ks.completed} is the last completed one")
        return self.export_key(ks)

    @staticmethod
    def waiting_copy(ks: KeyState) -> Arrival:
        """The arrival of ``ks``, a key migrating here whose copy is missing; StoreError otherwise
        (not migrating here, or taken over already)."""
        if ks.arrival is None or not ks.arrival.copy_missing:
            raise StoreError(f"key {ks.spec.key!r} is not waiting for a copy")
        return ks.arrival

    def take_copy(self, ks: KeyState, meta: dict, arrays: list[np.ndarray]) -> None:
        """Take over a migrated key from its copy; the pushes held meanwhile stay held."""
        arrival = self.waiting_copy(ks)
        self._load_copy(ks, meta, arrays)
        arrival.copy_missing = False
        arrival.precopied = False

    def precopy(self, ks: KeyState, meta: dict, arrays: list[np.ndarray]) -> None:
        """The old owner's state of a server-mode key still incoming here, sent ahead of the
        switch: loaded, pushes still held; the old owner's steps follow (``replica_step``)."""
        if ks.arrival is None or not ks.arrival.copy_missing or ks.mode != "server":
            raise StoreError(f"key {ks.spec.key!r} is not a server-mode key migrating here")
        self._load_copy(ks, meta, arrays)
        ks.arrival.precopied = True

    def take_ahead(self, ks: KeyState, completed: int, replica: KeyState | None) -> None:
        """Take over a migrated key whose old owner completed ``completed`` and sent no
        state: in ``server`` mode the state is here already, copied ahead into ``ks`` and
        kept current by the old owner's steps, or in ``replica`` (this aggregator was the
        key's replica). StoreError when neither is at ``completed``; held pushes stay held."""
        arrival = self.waiting_copy(ks)
        if not isinstance(completed, int) or completed < 0:
            raise StoreError(f"copy of {ks.spec.key!r}: bad iteration counter {completed!r}")
        if ks.mode == "server" and not (arrival.precopied and ks.initialized and ks.completed == completed):
            if replica is None or not replica.initialized or replica.completed != completed:
                raise StoreError(f"key {ks.spec.key!r}: no state of iteration {completed} arrived ahead "
                                 f"(it has {ks.completed if arrival.precopied else None}); send it")
            self._load_copy(ks, *self.export_key(replica))
        ks.completed = completed
        arrival.copy_missing = False
        arrival.precopied = False

    def _load_copy(self, ks: KeyState, meta: dict, arrays: list[np.ndarray]) -> None:
        """Set a key's counter and, in server mode, its master copy, optimizer state and
        step from a copy (``export_key``'s form); StoreError, changing nothing, when the copy
        does not fit the key."""
        completed = meta.get("completed")
        if not isinstance(completed, int) or completed < 0:
            raise StoreError(f"copy of {ks.spec.key!r}: bad iteration counter {completed!r}")
        if ks.mode == "server":
            names = list(meta.get("state") or [])
            if len(arrays) != 1 + len(names):
                raise StoreError(f"copy of {ks.spec.key!r}: {len(arrays)} arrays for {len(names)} state entries")
            for arr in arrays:
                if arr.size != ks.spec.numel or arr.dtype != np.dtype(ks.spec.dtype):
                    raise StoreError(f"copy of {ks.spec.key!r}: array of {arr.size} x {arr.dtype}, "
                                     f"expected {ks.spec.numel} x {ks.spec.dtype}")
            np.copyto(ks.param, arrays[0])
            ks.initialized = bool(meta.get("initialized", True))
            if meta.get("hp"):
                ks.optimizer.set_hp(meta["hp"])
            ks.optimizer.load_state(dict(zip(names, arrays[1:])), int(meta.get("step") or 0))
        ks.completed = completed

    def apply_held(self, ks: KeyState) -> tuple[int, list[str]]:
        """Apply the pushes held while ``ks`` waited (for a copy, or for the ranks' reports
        after a failure), by iteration then rank; pushes replayed after a failure that the key
        already contains are skipped. Returns (iterations completed, problems)."""
        held, ks.held = ks.held, []
        done, problems = 0, []
        for rank, iteration, data, deferred, replay in sorted(held, key=lambda h: (h[1], h[0])):
            try:
                if replay and self.already_has(ks, rank, iteration):
                    continue
                if iteration != ks.open_iteration:
                    raise StoreError(f"push of {ks.spec.key!r} for iteration {iteration}, but the open "
                                     f"iteration is {ks.open_iteration}")
                if rank in ks.ranks:
                    raise StoreError(f"rank {rank} pushed {ks.spec.key!r} iteration {iteration} twice")
                done += self.push(ks, rank, data, deferred=deferred)
            except StoreError as exc:
                problems.append(str(exc))
        return done, problems

    # --- failures --------------------------------------------------------------------
    @staticmethod
    def already_has(ks: KeyState, rank: int, iteration: int) -> bool:
        """True when a push of ``rank`` for ``iteration`` is already part of ``ks`` (a replay
        after a failure of a push the key had received)."""
        return iteration <= ks.completed or (iteration == ks.open_iteration and rank in ks.ranks)

    @staticmethod
    def start_recovery(ks: KeyState) -> None:
        """A sum-mode key taken over after its aggregator was lost: nothing is known until
        every rank said which iteration it last pulled; pushes are held, pulls wait."""
        ks.recovering = {}
        ks.recovered = -1
        ks.ranks.clear()
        ks.deferred.clear()
        ks.inline = 0
        ks.first = None
        ks.held = []

    def recover_report(self, ks: KeyState, rank: int, pulled: int,
                       value: np.ndarray | None = None) -> tuple[bool, list[str]]:
        """Rank ``rank`` last pulled ``pulled`` (and kept ``value``, what it pulled then).
        When every rank has reported, the key resumes after the largest such iteration if a
        rank gave its value: published again, it answers the others' pulls, and their pushes
        of it are replays the key already has. Otherwise it resumes after the smallest (every
        rank still holds its pushes from there on; no rank needs an older value). Then the
        held pushes are applied. Returns (resumed, problems with held pushes)."""
        if ks.recovering is None:
            return False, []
        if value is not None and ks.mode == "sum":
            if value.size != ks.spec.numel or value.dtype != np.dtype(ks.spec.dtype):
                raise StoreError(f"RECOVER of {ks.spec.key!r}: value of {value.size} x {value.dtype}, "
                                 f"expected {ks.spec.numel} x {ks.spec.dtype}")
            if pulled > ks.recovered:
                # ranks are at most one iteration apart: the two buffers hold both candidates
                np.copyto(ks.buffers[pulled % 2], value)
                ks.recovered = pulled
        ks.recovering[rank] = pulled
        if len(ks.recovering) < ks.world_size:
            return False, []
        latest = max(ks.recovering.values())
        ks.completed = latest if ks.recovered == latest else min(ks.recovering.values())
        ks.recovering = None
        _, problems = self.apply_held(ks)
        return True, problems

    def install_replica(self, state: JobState, spec: KeySpec, mode: str, average: bool, optimizer: str | None,
                        hp: dict, meta: dict, arrays: list[np.ndarray]) -> KeyState:
        """Back up a server-mode key (REPLICATE of kind ``state``): its master copy, optimizer
        state, step and iteration counter, replacing an older backup."""
        if mode != "server":
            raise StoreError(f"key {spec.key!r}: only server-mode keys are replicated")
        rks = state.replicas.get(spec.key)
        if rks is None:
            ready = state.readied.pop(spec.key, None)
            param, ref, slots = ready or (*self._allocate(state.job, [(spec.numel, spec.dtype)])[0], ())
            rks = KeyState(spec, mode, state.world_size, average, job=state.job, param=param, param_ref=ref,
                           optimizer=_optim().make_optimizer(optimizer, hp or {}))
            try:
                rks.optimizer.init_state(rks.param, slots)
            except ValueError:          # made ready for other settings: the optimizer's own
                rks.optimizer.init_state(rks.param)
        self._load_copy(rks, meta, arrays)
        state.replicas[spec.key] = rks
        return rks

    def ready_replica(self, state: JobState, spec: KeySpec, param: np.ndarray, ref: Any,
                      slots: list[np.ndarray]) -> bool:
        """Memory made ready for ``spec``'s replica here (``private_sizes`` without an
        accumulator): ``install_replica`` takes it. False, and nothing kept, when the key is
        backed up here already or the arrays do not fit it."""
        if (spec.key in state.replicas or spec.key in state.keys or param.size != spec.numel
                or str(param.dtype) != spec.dtype):
            return False
        state.readied[spec.key] = (param, ref, list(slots))
        return True

    @staticmethod
    def replica_accepts(rks: KeyState, iteration: int, grad: np.ndarray) -> bool:
        """Whether a backup can take the owner's step ``iteration`` (or already has it);
        False when a step before it is missing. Nothing changes."""
        if iteration <= rks.completed:
            return True
        if iteration != rks.completed + 1 or not rks.initialized:
            return False
        if grad.dtype != np.dtype(rks.spec.dtype) or grad.size != rks.spec.numel:
            raise StoreError(f"replica step of {rks.spec.key!r}: {grad.size} x {grad.dtype}, "
                             f"expected {rks.spec.numel} x {rks.spec.dtype}")
        return True

    @staticmethod
    def replica_step(rks: KeyState, iteration: int, grad: np.ndarray, hp: dict) -> None:
        """Apply the owner's step ``iteration`` (accepted by ``replica_accepts``) to a backup."""
        if iteration <= rks.completed:
            return
        if hp:
            rks.optimizer.set_hp(hp)
        rks.optimizer.step(rks.param, grad)
        rks.completed = iteration

    @staticmethod
    def promote(state: JobState, key: str) -> KeyState | None:
        """The owner of ``key`` was lost: its backup here becomes the key (None: no backup)."""
        rks = state.replicas.pop(key, None)
        if rks is not None:
            state.keys[key] = rks
        return rks

    def drop_keys(self, job: str, keys: list[str]) -> list[KeyState]:
        """Forget keys that moved away (the migration completed); returns the dropped states."""
        state = self.jobs.get(job)
        if state is None:
            return []
        return [ks for ks in (state.keys.pop(k, None) for k in keys) if ks is not None]

    def drop_replicas(self, job: str, keys: list[str]) -> list[KeyState]:
        """Forget the backups of ``keys`` held here (a move that would have made this their
        replica did not complete); returns them."""
        state = self.jobs.get(job)
        if state is None:
            return []
        return [rks for rks in (state.replicas.pop(k, None) for k in keys) if rks is not None]

    def take_readied(self, job: str, keys: list[str]) -> list[Any]:
        """Forget memory readied here for replicas of ``keys`` by a migration that did not
        complete; returns their master copies' references (as allocated) for reuse."""
        state = self.jobs.get(job)
        taken = [state.readied.pop(k, None) for k in keys] if state is not None else []
        return [ready[1] for ready in taken if ready is not None]

    def take_profile(self) -> dict:
        """{job: {key: [cpu seconds, iterations]}} since the last call, for keys with activity."""
        out: dict[str, dict] = {}
        for state in self.jobs.values():
            for key, ks in state.keys.items():
                if ks.cpu_iters or ks.cpu > 0:
                    out.setdefault(state.job, {})[key] = [round(ks.cpu, 6), ks.cpu_iters]
                    ks.cpu, ks.cpu_iters = 0.0, 0
        return out

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

    # --- commitments ----------------------------------------------------------------
    @staticmethod
    def key_bytes(ks: KeyState, accumulator: bool = True) -> int:
        """The bytes ``ks`` takes once every array of it is allocated (``buffer_sizes`` and
        ``private_sizes``: what a declaration of it commits): sum mode its two buffers; server
        mode its master copy, gradient accumulator (allocated on first use; not for a
        replica, ``accumulator`` False) and optimizer state."""
        nbytes = ks.spec.numel * np.dtype(ks.spec.dtype).itemsize
        if ks.mode == "sum":
            return 2 * nbytes
        slots = ks.optimizer.state_slots() if ks.optimizer is not None else 0
        return (1 + int(accumulator) + slots) * nbytes

    def footprint(self, job: str) -> int:
        """What ``job`` holds committed in the store: its keys, its replicas here and the
        memory made ready for replicas (``key_bytes``), allocated or still to be."""
        state = self.jobs.get(job)
        if state is None:
            return 0
        total = sum(self.key_bytes(ks) for ks in state.keys.values())
        total += sum(self.key_bytes(rks, accumulator=False) for rks in state.replicas.values())
        for param, _, slots in state.readied.values():
            total += param.nbytes + sum(a.nbytes for a in slots)
        return total

    # --- reporting -----------------------------------------------------------------
    def holding(self) -> dict:
        """What this aggregator holds, per job (for a restarted pMaster): the secret, world
        size and every key as ``[*spec, mode, average, optimizer, hp, role, completed]`` with
        role ``owner`` (``moving`` while it hands the key over) or ``replica``."""
        out = {}
        for job, state in self.jobs.items():
            keys = []
            for role, table in (("owner", state.keys), ("replica", state.replicas)):
                for ks in table.values():
                    if ks.arrival is not None and ks.arrival.copy_missing or ks.recovering is not None:
                        continue
                    optimizer = ks.optimizer.name if ks.optimizer is not None else None
                    hp = dict(ks.optimizer.hp) if ks.optimizer is not None else {}
                    keys.append([*ks.spec.to_wire(), ks.mode, ks.average, optimizer, hp,
                                 "moving" if ks.move is not None else role, ks.completed])
            out[job] = {"secret": state.secret, "world_size": state.world_size, "keys": keys}
        return out

    def bytes_held(self) -> int:
        total = 0
        for state in self.jobs.values():
            for ks in [*state.keys.values(), *state.replicas.values()]:
                total += sum(b.nbytes for b in ks.buffers)
                for arr in (ks.param, ks.grad):
                    total += arr.nbytes if arr is not None else 0
                if ks.optimizer is not None:
                    total += sum(a.nbytes for a in ks.optimizer.state_arrays().values())
            for param, _, slots in state.readied.values():
                total += param.nbytes + sum(a.nbytes for a in slots)
        return total
