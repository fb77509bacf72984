"""The agent inside each training worker: mapping table, async push/pull, iteration counters.

The agent registers its job with pMaster, declares tensors, and caches the table
``key -> aggregator`` that pMaster owns. During a live migration a key has a second owner
from a given iteration on: the agent learns it from pMaster's table, from the old owner's
pull reply of the cutover iteration, or from a REDIRECT, and routes each request by its
iteration, so no request reaches an aggregator that no longer (or not yet) serves it.
Once per profiling period the I/O thread sends pMaster one PROFILE record (iteration
count and mean iteration duration), which also tells pMaster the worker is alive.
User threads (training loop, autograd hooks) enqueue operations; one I/O thread owns the
``Transport`` and its channels, sends pushes and pulls (``wire`` records) without copying
the tensors -- staging a push in memory the channel lends when that saves the aggregator a
copy -- batches small keys into one message per aggregator, sends the large keys' pushes
to one aggregator that it takes in one burst as one message of up to a partition over a
socket (``coalesce``), copies pull replies into the caller's buffers, and fails requests
that get no reply within the timeout with an error that says what it waited for.
In server mode ``fetch_state`` brings a tensor's master copy, optimizer state and step back
from its aggregators (for checkpoints), reassembled from its partitions.

Every rank presents its job's secret (from its launcher: ``secret=`` or
``$AUTOPS_JOB_SECRET``, ``jobauth``) to pMaster and with every data request; pMaster never
sends it. A refusal raises ``AuthRefused`` naming it. Sockets run CURVE beyond loopback when
the key directory holds the cluster's CURVE keys (``dlrt.curve``).

Leaving: ``close`` (``autops.torch.shutdown``) tells pMaster the rank is done, and an agent
still open when its process exits does so at exit; pMaster releases the job once every rank
is done. A registration pMaster refuses for now (admission control, a pool restarting:
``PoolBusy``) or that it does not answer (``MasterUnreachable``) also asks the run's launcher
to requeue it (``dlrt.requeue``), e.g. the Tiresias master, rather than fail it.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import zmq

from dlrt import requeue
from dlrt.curve import Security, default_security
from dlrt.procs import name_this_thread
from dlrt.waker import Waker

from ..wire import protocol as wire
from .coalesce import Coalescer
from ..wire.jobauth import ENV as SECRET_ENV, secret_from_env
from ..wire.partition import KeySpec
from ..transport import TRANSPORTS, Channel, Inbound, Shared, Transport, TransportError, make_context
from ..transport.cma import require_cma
from ..transport.rdma_verbs import require_device

log = logging.getLogger("autops.worker.agent")

DEFAULT_TIMEOUT = 60.0
JOB_DONE_TIMEOUT = 5.0     # seconds a finished rank waits for pMaster to take its JOB_DONE
PROFILE_PERIOD = float(os.environ.get("AUTOPS_PROFILE_PERIOD", "1.0"))
# a request unanswered this long makes the agent ask pMaster whether an aggregator was lost
PROBE_AFTER = float(os.environ.get("AUTOPS_PROBE_AFTER", "1.0"))
PARTITION_ENV = "AUTOPS_PARTITION_BYTES"   # the job's partition size where the caller sets none
# "0": each large key's push goes as a message of its own, also within a burst (``coalesce``)
COALESCE_ENV = "AUTOPS_COALESCE"
# bytes carried to a move's new owner and back over each TCP connection opened for the move,
# before its switch (``_IOLoop.warm``); "0" turns it off
WARM_ENV = "AUTOPS_WARM_BYTES"
WARM_BYTES = 32 << 20
# agents not closed yet; at interpreter exit each leaves its job (``_leave_at_exit``), waiting
# at most this long for pMaster's answer (a pool already gone must not hold the exit up)
_OPEN: "weakref.WeakSet[Agent]" = weakref.WeakSet()
EXIT_DONE_TIMEOUT = 2.0


def _leave_at_exit() -> None:
    """At interpreter exit every agent this process left open leaves its job (JOB_DONE,
    as ``close``): a script that ends without ``autops.torch.shutdown()`` -- by returning,
    by ``sys.exit``, by ``tiresias.job.exit_stopped()`` -- frees its registration at pMaster
    once all its ranks are gone, instead of after pMaster's ``--job-timeout``, so a resumed
    run of the job finds its aggregators free."""
    for agent in list(_OPEN):
        if agent._pid != os.getpid():
            continue                                  # a forked child's copy: not its job
        try:
            agent._master.timeout = min(agent._master.timeout, EXIT_DONE_TIMEOUT)
            agent.close()
        except Exception as exc:                      # exiting anyway: say it, do not raise
            log.warning("could not leave job %s at exit: %s", agent.job, exc)


atexit.register(_leave_at_exit)


class AutoPSError(RuntimeError):
    """An error reply from the parameter service, or a failure to reach it."""


def _as_autops_error(exc: BaseException, what: str) -> AutoPSError:
    """What the caller's handle reports for a failure of its ``what`` operation."""
    return exc if isinstance(exc, AutoPSError) else AutoPSError(f"{what} failed: {exc}")


class MasterUnreachable(AutoPSError):
    """pMaster did not answer (it may be restarting)."""


class PoolBusy(AutoPSError):
    """pMaster cannot take the job now (admission refused, the pool restarting): retry later."""


class AuthRefused(AutoPSError):
    """pMaster refused a request for want of the right secret or token (the text says which)."""


def warm_bytes_from_env() -> int:
    """``$AUTOPS_WARM_BYTES``, else ``WARM_BYTES``: what an agent warms a move's new TCP
    connections with when its caller says nothing."""
    text = os.environ.get(WARM_ENV)
    if not text:
        return WARM_BYTES
    try:
        return int(text)
    except ValueError:
        raise AutoPSError(f"${WARM_ENV}={text!r} is not a number of bytes") from None


class Handle:
    """Completion of one asynchronous operation on one tensor (all its keys)."""

    @classmethod
    def of(cls, name: str, agent: "Agent", specs: list[KeySpec], parts: int) -> "Handle":
        """A handle for ``parts`` requests on ``specs``; ``batched`` is known before the I/O
        thread sees the operation, so a ``wait()`` right after submitting flushes the batch."""
        handle = cls(name, agent)
        handle._add(parts)
        handle.batched = any(spec.small for spec in specs)
        return handle

    def __init__(self, name: str, agent: "Agent") -> None:
        self.name = name
        self._agent = agent
        self._pending = 0
        self._lock = threading.Lock()
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.batched = False     # has parts waiting in a small-key batch
        self.done_at: float | None = None    # time.monotonic() when it completed

    def _add(self, n: int = 1) -> None:
        with self._lock:
            self._pending += n

    def _part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._pending -= 1
            if self._pending <= 0:
                self._complete()

    def _seal(self) -> None:
        with self._lock:
            if self._pending <= 0:
                self._complete()

    def _complete(self) -> None:
        if self.done_at is None:
            self.done_at = time.monotonic()
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; re-raises the service's error."""
        if self.batched and not self._event.is_set():
            self._agent.flush()
        if not self._event.wait(timeout if timeout is not None else self._agent.timeout * 2 + 5):
            raise TimeoutError(f"operation on {self.name!r} did not complete")
        if self.error is not None:
            raise self.error


class StateHandle(Handle):
    """A fetch of one tensor's server-side state; after ``wait()``: ``param`` (the master
    copy), ``state`` (optimizer arrays under torch's names) and ``step``, all flat."""

    def __init__(self, name: str, agent: "Agent", numel: int, dtype: str) -> None:
        super().__init__(name, agent)
        self.param = np.empty(numel, dtype)
        self.state: dict[str, np.ndarray] = {}
        self.step = 0

    def _absorb(self, spec: KeySpec, meta: dict, arrays: list[np.ndarray]) -> None:
        """Place one key's part of the state (I/O thread; read by the user after ``wait``)."""
        names = list(meta.get("state") or [])
        if len(arrays) != 1 + len(names) or any(a.size != spec.numel for a in arrays):
            raise AutoPSError(f"state of {spec.key!r}: {len(arrays)} arrays for {len(names)} state "
                              f"entries of {spec.numel} elements")
        sl = slice(spec.offset, spec.offset + spec.numel)
        self.param[sl] = arrays[0]
        for name, arr in zip(names, arrays[1:]):
            if name not in self.state:
                self.state[name] = np.zeros_like(self.param)
            self.state[name][sl] = arr
        self.step = int(meta.get("step") or 0)


class _Background(Handle):
    """The handle of a request nobody waits for (a push replayed after a failure)."""

    def __init__(self, name: str, agent: "Agent") -> None:
        super().__init__(name, agent)
        self._add(1 << 30)

    def _part_done(self, error: BaseException | None = None) -> None:
        if error is not None:
            log.error("replayed push of %s: %s", self.name, error)


@dataclass
class Part:
    """One key of one operation in flight; a push with ``out`` is a push_pull (PUSH_PULL:
    the aggregator answers it with the value of its iteration) and stands for two parts of
    its handle."""
    spec: KeySpec
    handle: Handle
    iteration: int
    data: np.ndarray | None = None     # push: the slice sent
    out: np.ndarray | None = None      # pull: where the reply is copied
    hp: dict | None = None             # push: changed hyper-parameters (server mode)
    staged: Shared | None = None       # push: the slice, copied into memory the transport lends

    @property
    def fused(self) -> bool:
        return self.data is not None and self.out is not None

    def finish(self, error: BaseException | None = None) -> None:
        """Complete this part (both halves of a push_pull) on its handle."""
        self.handle._part_done(error)
        if self.fused:
            self.handle._part_done(error)

    def halves(self) -> tuple["Part", "Part"]:
        """A push_pull as a plain push and a plain pull (resent separately after a failure)."""
        return (Part(self.spec, self.handle, self.iteration, data=self.data, hp=self.hp),
                Part(self.spec, self.handle, self.iteration, out=self.out))


@dataclass
class Request:
    kind: str
    agg: str
    parts: list
    deadline: float
    sent: float = 0.0
    resend: tuple | None = None        # (op, payloads, fields) for requests resent whole (INIT, ...)


class MasterClient:
    """Request/reply to pMaster over a DEALER with a timeout; one per thread."""

    def __init__(self, ctx: zmq.Context, address: str, timeout: float, security: Security | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.sock = ctx.socket(zmq.DEALER)
        (security if security is not None else default_security()).client(self.sock, address)
        self.sock.connect(address)
        self._reqs = itertools.count(1)

    def send(self, op: str, **fields: Any) -> int:
        """Send a request without waiting; its reply arrives on ``sock`` with this ``req``."""
        req = next(self._reqs)
        self.sock.send_multipart(wire.encode(op, req=req, **fields), zmq.NOBLOCK)
        return req

    def call(self, op: str, timeout: float | None = None, **fields: Any) -> wire.Message:
        req = next(self._reqs)
        self.sock.send_multipart(wire.encode(op, req=req, **fields))
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise MasterUnreachable(f"AutoPS master at {self.address} did not answer {op} within "
                                        f"{timeout:.0f}s; is `autops master` running there?")
            reply = wire.decode(self.sock.recv_multipart())
            if reply.get("req") != req:
                continue      # a late reply to an earlier, timed-out request
            if reply.op == wire.ERROR:
                if reply.get("refused"):
                    raise AuthRefused(f"pMaster refused {op}: {reply['message']}")
                if reply.get("retry"):
                    raise PoolBusy(f"master: {reply['message']}")
                raise AutoPSError(f"master: {reply['message']}")
            return reply

    def close(self) -> None:
        self.sock.close(0)


class Table:
    """The cached assignment: tensor -> keys, key -> aggregator, aggregator -> endpoint."""

    def __init__(self) -> None:
        self.keys: dict[str, KeySpec] = {}
        self.owner: dict[str, str] = {}
        self.by_tensor: dict[str, list[KeySpec]] = {}
        self.aggs: dict[str, dict] = {}
        self.tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        self.moves: dict[str, tuple[str, int]] = {}   # key -> (new owner, first iteration there)
        self.home: str | None = None                  # the job's aggregator for broadcasts
        self.epoch = 0                                # failovers pMaster made (``failover``)
        self.lost: set[str] = set()                   # aggregators of the job that were lost

    def load(self, reply: wire.Message) -> None:
        keys, owner, by_tensor, moves = {}, {}, collections.defaultdict(list), {}
        for item in reply["keys"]:
            entry = wire.TableEntry.from_wire(item, reply.op)
            spec = entry.spec
            keys[spec.key] = spec
            owner[spec.key] = entry.owner
            if entry.move is not None:
                moves[spec.key] = entry.move
            by_tensor[spec.tensor].append(spec)
        self.keys, self.owner, self.by_tensor, self.moves = keys, owner, dict(by_tensor), moves
        self.aggs = dict(reply["aggregators"])
        self.tensors = {n: (tuple(s), d) for n, s, d in reply["tensors"]}
        self.home = reply.get("home")
        self.epoch = int(reply.get("epoch") or 0)
        self.lost = set(reply.get("lost") or ())

    def route(self, key: str, iteration: int) -> str:
        """The aggregator serving ``iteration`` of ``key``."""
        move = self.moves.get(key)
        if move is not None and iteration >= move[1]:
            return move[0]
        return self.owner[key]

    def learn(self, key: str, agg: str, first: int, info: dict) -> None:
        """A migration of ``key`` to ``agg`` from iteration ``first`` on (idempotent)."""
        if key not in self.owner:
            return
        self.aggs[agg] = info
        old = self.moves.get(key)
        if old is not None and old[1] < first and old[0] != agg:
            self.owner[key] = old[0]        # a later move: the earlier one is complete by now
        self.moves[key] = (agg, first)

    def final_owner(self, key: str) -> str:
        move = self.moves.get(key)
        return move[0] if move is not None else self.owner[key]


class Agent:
    """A worker's client of the parameter service."""

    def __init__(self, master: str, job: str, rank: int, world_size: int, mode: str = "sum",
                 num_aggregators: int = 0, average: bool = True, optimizer: str | None = None,
                 hp: dict | None = None, timeout: float = DEFAULT_TIMEOUT, transport: str = "auto",
                 partition_bytes: int | None = None, small_bytes: int | None = None,
                 secret: str | None = None, fault_tolerant: bool = True, security: Security | None = None,
                 warm_bytes: int | None = None) -> None:
        """``secret``: the job's secret, the same for every rank (default ``$AUTOPS_JOB_SECRET``;
        the launcher makes it: ``autops local``, the Tiresias master, ``autops secret``).
        ``fault_tolerant``: the job survives the loss of an aggregator -- each worker keeps
        its pushes until they cannot be needed again (in sum mode the staged push where one is
        staged in shared memory, else a copy; sum mode replays them to the new owner) and
        server-mode keys are replicated to a second aggregator. Off: less
        memory and no replication traffic, and the loss of an aggregator fails the job.
        ``security``: CURVE for the sockets (default: the key directory's).
        ``partition_bytes``: tensors larger than this are split into keys of about this size
        (default ``$AUTOPS_PARTITION_BYTES``, else pMaster chooses at the job's first
        declaration of a tensor over 1 MiB: ``autops.wire.partition.auto_partition_bytes``, 1 to 4 MiB).
        ``warm_bytes``: how much each TCP connection opened for a move carries to the new owner
        and back before the move's switch (default ``$AUTOPS_WARM_BYTES``, else ``WARM_BYTES``;
        0: none, at most ``wire.MAX_WARM_BYTES``)."""
        secret = secret_from_env(secret)
        if partition_bytes is None and os.environ.get(PARTITION_ENV):
            partition_bytes = int(os.environ[PARTITION_ENV])
        if not secret:
            raise AutoPSError(f"no secret for job {job}: pass secret= or set ${SECRET_ENV} the same for every "
                              f"rank (`autops local` and the Tiresias master do; for torchrun: "
                              f"`export {SECRET_ENV}=$(autops secret)`)")
        self.master = master
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self.timeout = timeout
        self.fault_tolerant = fault_tolerant
        if warm_bytes is None:
            warm_bytes = warm_bytes_from_env()
        if not 0 <= warm_bytes <= wire.MAX_WARM_BYTES:
            raise AutoPSError(f"warm_bytes {warm_bytes} outside 0..{wire.MAX_WARM_BYTES}")
        self.warm_bytes = warm_bytes
        # connections warmed ahead of a move (``_IOLoop.warm``): answers that came back
        self.warmed = 0
        if transport not in TRANSPORTS:
            raise AutoPSError(f"unknown transport {transport!r} (one of {', '.join(TRANSPORTS)})")
        if transport == "rdma":
            require_device()       # no device: fail here at once, not later in the I/O thread
        elif transport == "cma":
            require_cma()
        self.transport = transport
        self.security = security if security is not None else default_security()
        self.ctx = make_context()
        self._master = MasterClient(self.ctx, master, timeout, self.security)
        self._master_lock = threading.Lock()
        # what this rank told pMaster, to tell a restarted pMaster again (``_IOLoop.rejoin``)
        self._registration = dict(job=job, world_size=world_size, rank=rank, num_aggregators=num_aggregators,
                                  mode=mode, average=average, optimizer=optimizer, hp=hp or {},
                                  partition_bytes=partition_bytes, small_bytes=small_bytes, replicate=fault_tolerant)
        self._declared: list = []
        try:
            reply = self._master.call(wire.REGISTER_JOB, secret=secret, **self._registration)
        except BaseException as exc:
            self._master.close()
            self.ctx.term()
            if isinstance(exc, (PoolBusy, MasterUnreachable)):     # a launcher may run it again later
                requeue.request(f"AutoPS pool refused the job for now: {str(exc).removeprefix('master: ')}")
            raise
        self.secret: str = secret
        self.aggregators: list[str] = list(reply["aggregators"])
        self.table = Table()
        self.table.aggs = dict(reply.get("endpoints") or {})
        self.table.home = reply.get("home") or (self.aggregators[0] if self.aggregators else None)
        self._table_lock = threading.Lock()
        self._sizes: dict[str, tuple] = {}     # name -> (table entry, dtype, numel), for _check
        # requests an aggregator answered with REDIRECT (the key had moved): each costs a round
        # trip and a resend; live migration tells the agents ahead, so it should stay 0
        self.redirects = 0
        self._cmds: collections.deque = collections.deque()
        self._waker = Waker()
        self._closed = False
        self._done = False
        self._io = threading.Thread(target=self._io_main, name=f"autops-agent-{rank}", daemon=True)
        self._io_ready = threading.Event()
        self._io.start()
        self._io_ready.wait()
        self._submit(("table", self.table))
        self._pid = os.getpid()
        _OPEN.add(self)

    # --- control (user thread) --------------------------------------------------------
    def declare(self, tensors: Iterable[tuple]) -> None:
        """Declare tensors ``(name, shape, dtype[, options])``; blocks until pMaster assigned them.

        ``options`` may set ``mode`` ("sum"/"server"), ``average``, ``optimizer`` and ``hp`` per
        tensor; the job's registration gives the defaults.
        """
        entries = []
        for entry in tensors:
            name, shape, dtype = entry[:3]
            entries.append([name, [int(d) for d in shape], str(dtype), *([dict(entry[3])] if len(entry) > 3 else [])])
        with self._master_lock:
            reply = self._master.call(wire.DECLARE, job=self.job, secret=self.secret, tensors=entries)
        self._declared.extend(entries)
        if reply.get("partition_bytes"):        # pMaster's choice, told again to a restarted pMaster
            self._registration["partition_bytes"] = int(reply["partition_bytes"])
        self._set_table(reply)

    @property
    def partition_bytes(self) -> int | None:
        """The job's partition size: the one set, else pMaster's choice (known after a declare)."""
        return self._registration["partition_bytes"]

    def _set_table(self, reply: wire.Message) -> None:
        table = Table()
        table.load(reply)
        with self._table_lock:
            self.table = table
        self._submit(("table", table))

    def keys_of(self, name: str) -> list[KeySpec]:
        with self._table_lock:
            specs = self.table.by_tensor.get(name)
        if specs is None:
            raise AutoPSError(f"tensor {name!r} was not declared; declare it before push/pull")
        return specs

    def placement(self) -> dict[str, list[str]]:
        """aggregator id -> keys it serves for this job."""
        out: dict[str, list[str]] = {}
        with self._table_lock:
            for key in list(self.table.owner):
                out.setdefault(self.table.final_owner(key), []).append(key)
        return out

    # --- data (user thread -> I/O thread) --------------------------------------------
    def _check(self, name: str, array: np.ndarray) -> tuple[list[KeySpec], np.ndarray]:
        specs = self.keys_of(name)
        declared = self.table.tensors[name]
        known = self._sizes.get(name)
        if known is None or known[0] is not declared:     # per call: no np.prod over the shape
            shape, dtype = declared
            known = self._sizes[name] = (declared, np.dtype(dtype), int(np.prod(shape, dtype=np.int64)))
        flat = np.ascontiguousarray(array).reshape(-1)
        if array.dtype != known[1] or flat.size != known[2]:
            shape, dtype = declared
            raise AutoPSError(f"tensor {name!r} was declared {list(shape)} {dtype}, "
                              f"got {list(array.shape)} {array.dtype}")
        return specs, flat

    def push(self, name: str, array: np.ndarray, iteration: int, hp: dict | None = None) -> Handle:
        """Send ``array`` as this rank's contribution to ``iteration``; the handle completes on ack."""
        specs, flat = self._check(name, array)
        handle = Handle.of(name, self, specs, len(specs))
        self._submit(("push", specs, flat, iteration, handle, hp))
        return handle

    def pull(self, name: str, out: np.ndarray, iteration: int) -> Handle:
        """Fill ``out`` (contiguous) with the published value of ``iteration``."""
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise AutoPSError(f"pull of {name!r}: the output array must be contiguous and writeable")
        specs, flat = self._check(name, out)
        handle = Handle.of(name, self, specs, len(specs))
        self._submit(("pull", specs, flat, iteration, handle))
        return handle

    def push_pull(self, name: str, array: np.ndarray, out: np.ndarray, iteration: int,
                  hp: dict | None = None) -> Handle:
        """Push ``array`` for ``iteration`` and pull the result into ``out``: one handle for both."""
        specs, flat = self._check(name, array)
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise AutoPSError(f"push_pull of {name!r}: the output array must be contiguous and writeable")
        _, out_flat = self._check(name, out)
        handle = Handle.of(name, self, specs, 2 * len(specs))
        self._submit(("push", specs, flat, iteration, handle, hp, out_flat))
        return handle

    def init(self, name: str, array: np.ndarray, hp: dict | None = None,
             opt_state: dict[str, np.ndarray] | None = None, step: int = 0) -> Handle:
        """Server mode: set the master copy (and optimizer state) of ``name`` on the aggregators."""
        specs, flat = self._check(name, array)
        state = {k: np.ascontiguousarray(v).reshape(-1) for k, v in (opt_state or {}).items()}
        handle = Handle(name, self)
        handle._add(len(specs))
        self._submit(("init", specs, flat, handle, hp, state, step))
        return handle

    def fetch_state(self, name: str, iteration: int) -> StateHandle:
        """Server mode: fetch the master copy, optimizer state and step of ``name`` as they are
        right after ``iteration`` (the last one this worker completed; for checkpoints)."""
        specs = self.keys_of(name)
        shape, dtype = self.table.tensors[name]
        handle = StateHandle(name, self, int(np.prod(shape, dtype=np.int64)), dtype)
        handle._add(len(specs))
        self._submit(("state", specs, iteration, handle))
        return handle

    def broadcast(self, name: str, array: np.ndarray, root: int, seq: int) -> Handle:
        """Copy ``array`` of rank ``root`` into ``array`` of every other rank (bytes, any dtype)."""
        flat = np.ascontiguousarray(array).reshape(-1)
        handle = Handle(name, self)
        if self.world_size == 1:
            handle._seal()
            return handle
        handle._add(1)
        self._submit(("bcast", name, flat, root, seq, handle))
        return handle

    def flush(self) -> None:
        """Send batched small keys now (a wait on a handle does this itself)."""
        self._submit(("flush",))

    def job_done(self) -> None:
        """Tell pMaster this rank has finished; the job is released when all ranks have."""
        if self._done:
            return
        self._done = True
        with self._master_lock:
            try:      # bounded: a pMaster that is down releases the job after its --job-timeout
                self._master.call(wire.JOB_DONE, timeout=min(self._master.timeout, JOB_DONE_TIMEOUT),
                                  job=self.job, secret=self.secret, rank=self.rank)
            except AutoPSError as exc:
                log.warning("could not report job completion: %s", exc)

    def close(self) -> None:
        """Leave the job (as ``job_done``) and stop the I/O thread."""
        if self._closed:
            return
        _OPEN.discard(self)
        self.job_done()
        self._closed = True
        self._submit(("stop",))
        self._io.join(timeout=5)
        self._master.close()
        self._waker.close()
        self.ctx.term()

    def _submit(self, cmd: tuple) -> None:
        if self._closed and cmd[0] != "stop":
            raise AutoPSError("agent is closed")
        self._cmds.append(cmd)
        self._waker.wake()

    # --- I/O thread ---------------------------------------------------------------------
    def _io_main(self) -> None:
        name_this_thread()
        io = _IOLoop(self)
        self._io_ready.set()
        try:
            io.run()
        except Exception:  # surface instead of hanging the workers
            log.exception("agent I/O thread failed")
            io.fail_all(AutoPSError("agent I/O thread failed; see the log"))
        finally:
            io.close()


class _IOLoop:
    """State owned by the agent's I/O thread: channels, requests in flight, small-key batches."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.table = Table()
        self.transport = Transport(agent.ctx, agent.transport, label=f"autops-agent-{agent.rank}",
                                   security=agent.security)
        self.channel_agg: dict[Channel, str] = {}
        self.inflight: dict[int, Request] = {}
        self.reqs = itertools.count(1)
        self.poller = zmq.Poller()
        self.poller.register(agent._waker.fd, zmq.POLLIN)
        self.batch_push: dict[str, list[Part]] = collections.defaultdict(list)
        self.batch_pull: dict[str, list[Part]] = collections.defaultdict(list)
        self.batch_keys: dict[str, set[str]] = collections.defaultdict(set)     # the keys in batch_push
        # large keys' pushes of this burst of commands over sockets, per (aggregator, op)
        self.coalesced = Coalescer()
        self.coalesces = os.environ.get(COALESCE_ENV, "1") != "0"
        self.small: dict[str, set[str]] = {}
        self.routes: dict[str, Channel] = {}                       # agg -> its channel (as the table says)
        self.lending: dict[str, bool] = {}                         # agg -> staged pushes reach it by reference
        # key -> its lendable push buffers: one, or two where the push kept for a failure is
        # the staged one itself (``free_stage``), not a copy: with fault tolerance in sum
        # mode (a server-mode aggregator sums into the first staged push it holds)
        self.staging: dict[str, list[Shared]] = {}
        self.keeps_staged = agent.fault_tolerant and agent.mode == "sum"
        # sum mode over a socket: a push_pull's push is kept by reference until its pull is
        # answered (the caller leaves the array alone until then), then the value pulled (the
        # received frame) stands in for it: a RECOVER carries it, so no push is copied
        self.keeps_aggregates = agent.fault_tolerant and agent.mode == "sum"
        self.staged_busy: dict[str, int] = {}                      # key -> iteration not yet pulled
        self.ahead: set[str] = set()                               # aggregators keys move to: prepared ahead
        self.running = True
        self.master = MasterClient(agent.ctx, agent.master, agent.timeout, agent.security)
        # profiling: (iteration, time) of the first push of each new iteration this period
        self.last_iteration = 0
        self.marks: list[tuple[int, float]] = []
        self.next_profile = time.monotonic() + PROFILE_PERIOD
        # failures: each push until no rank can need it again (the pull of the next iteration
        # was answered, or this rank holds the value of its own), as a private copy (``owned``,
        # reused through ``spare``), a staged buffer or a reference to the caller's array; the
        # last iteration pulled per key and, in sum mode, the value pulled then; when to ask
        # pMaster next
        self.kept: dict[str, dict[int, np.ndarray]] = {}
        self.owned: dict[str, set[int]] = {}
        self.spare: dict[str, list[np.ndarray]] = {}
        self.pulled: dict[str, int] = {}
        self.aggregates: dict[str, np.ndarray] = {}                # key -> the value of pulled[key]
        self.next_probe = time.monotonic() + PROBE_AFTER
        self.probe_req: int | None = None
        self.poller.register(self.master.sock, zmq.POLLIN)

    def close(self) -> None:
        self.master.close()
        self.staging.clear()
        self.transport.close()

    def lends(self, agg: str) -> bool:
        """Whether pushes staged in lendable memory reach ``agg`` by reference and are read
        there in place (saving its copy): shm. Over a one-sided kind the aggregator READs
        the caller's array itself, so nothing is staged."""
        found = self.lending.get(agg)
        if found is None:
            found = self.lending[agg] = self.transport.reads_in_place(self.table.aggs.get(agg, {}))
        return found

    def free_stage(self, spec: KeySpec) -> Shared | None:
        """A lendable buffer of the key that nothing needs any more, or None: the aggregator
        may still read the key's last staged push (until it answers its pull), and a staged
        push kept for a failure stays until ``pulled_answered`` lets it go."""
        if spec.key in self.staged_busy:
            return None
        kept = self.kept.get(spec.key)
        for buf in self.stage(spec):
            if not kept or not any(arr is buf.array for arr in kept.values()):
                return buf
        return None

    def stage(self, spec: KeySpec) -> list[Shared]:
        """The lendable buffers of a key; allocated for all not-yet-staged large keys at once."""
        if spec.key not in self.staging:
            todo = [s for k, s in self.table.keys.items()
                    if not s.small and k not in self.staging and self.lends(self.table.final_owner(k))]
            if spec.key not in {s.key for s in todo}:
                todo.append(spec)
            copies = 2 if self.keeps_staged else 1
            buffers = self.transport.memory.allocate([(s.numel, s.dtype) for s in todo for _ in range(copies)],
                                                     self.agent.job)
            for n, s in enumerate(todo):
                self.staging[s.key] = buffers[n * copies:(n + 1) * copies]
        return self.staging[spec.key]

    def fail_all(self, exc: BaseException) -> None:
        for req in list(self.inflight.values()):
            for part in req.parts:
                part.finish(exc)
        self.inflight.clear()

    def forget_routes(self, agg: str | None = None) -> None:
        """The table changed (for ``agg``, or all): look channels and lending up again."""
        if agg is None:
            self.routes, self.lending = {}, {}
        else:
            self.routes.pop(agg, None)
            self.lending.pop(agg, None)

    def channel_for(self, agg: str) -> Channel:
        """The transport's channel to ``agg`` (one per address: if an aggregator's address
        changes, the old channel stays open so replies to requests in flight arrive)."""
        channel = self.routes.get(agg)
        if channel is not None:
            return channel
        info = self.table.aggs.get(agg)
        if info is None:
            raise AutoPSError(f"aggregator {agg!r} is not in the table")
        try:
            channel = self.transport.connect(info)
        except TransportError as exc:
            raise AutoPSError(f"aggregator {agg}: {exc}") from None
        if channel not in self.channel_agg:
            self.channel_agg[channel] = agg
            for pollable in channel.pollables:
                self.poller.register(pollable, zmq.POLLIN)
        self.routes[agg] = channel
        return channel

    def run(self) -> None:
        agent = self.agent
        waker = agent._waker
        while self.running:
            events = dict(self.poller.poll(100))
            if waker.fd in events:
                waker.clear()
            while agent._cmds:
                self.command(agent._cmds.popleft())
                if not self.running:
                    return
            self.send_coalesced()
            for channel in list(self.channel_agg):
                while (inbound := channel.recv()) is not None:
                    self.reply(channel, inbound)
            self.expire()
            self.master_replies()
            if (self.inflight or self.kept) and time.monotonic() >= self.next_probe and not agent._done:
                self.probe()
            if self.ahead and not self.inflight:
                self.prepare_ahead()        # once this iteration's requests are all answered
            if time.monotonic() >= self.next_profile:
                self.profile()

    def prepare_ahead(self) -> None:
        """Connect to the aggregators keys are moving to and map their published buffers (on
        a low-priority helper thread): the switch iteration's first requests then find the
        connection made (a TCP handshake, an RDMA queue pair) and the memory mapped."""
        payload = None
        for agg in sorted(self.ahead):
            known = len(self.channel_agg)
            try:
                channel = self.channel_for(agg)
                channel.open()
            except AutoPSError as exc:
                log.info("cannot connect to %s ahead of a move: %s", agg, exc)
            else:
                if len(self.channel_agg) > known and channel.kind == "tcp" and self.agent.warm_bytes:
                    payload = self.warm(channel, payload)
            info = self.table.aggs.get(agg)
            if info is not None:
                self.transport.premap(info)
        self.ahead.clear()

    def warm(self, channel: Channel, payload: np.ndarray | None) -> np.ndarray:
        """Carry ``warm_bytes`` to the new owner and back over a TCP connection just opened
        for a move. A fresh connection's first large transfer starts from the kernel's initial
        socket buffers and an unbounded slow-start threshold: it overshoots the link's queue,
        loses a burst and drains slowly (measured: it made a job's first move onto new
        aggregators its longest pause). Here that happens in the lead iterations' idle time,
        and the switch finds the connection grown. Returns the payload (one for every
        connection warmed at once; the channel keeps it until the peer has read it)."""
        if payload is None:
            payload = np.ones(self.agent.warm_bytes, np.uint8)     # filled: no shared zero pages to splice
        channel.send(wire.header(wire.WARM), [payload])
        return payload

    def profile(self) -> None:
        """One PROFILE record per period: iterations started and their mean duration."""
        now = time.monotonic()
        self.next_profile = now + PROFILE_PERIOD
        marks = self.marks
        count, duration = 0, None
        if len(marks) >= 2:
            count = marks[-1][0] - marks[0][0]
            duration = (marks[-1][1] - marks[0][1]) / count if count > 0 else None
        self.marks = marks[-1:]
        agent = self.agent
        try:
            self.master.sock.send_multipart(wire.encode(
                wire.PROFILE, job=agent.job, secret=agent.secret, rank=agent.rank,
                iteration=self.last_iteration, count=count, duration=duration), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass        # the master is unreachable; the next period tries again

    # commands ---------------------------------------------------------------------------
    def command(self, cmd: tuple) -> None:
        kind = cmd[0]
        try:
            if kind == "push":
                self.do_push(*cmd[1:])
            elif kind == "pull":
                self.do_pull(*cmd[1:])
            elif kind == "init":
                self.do_init(*cmd[1:])
            elif kind == "bcast":
                self.do_bcast(*cmd[1:])
            elif kind == "state":
                self.do_state(*cmd[1:])
            elif kind == "flush":
                self.flush_all()
            elif kind == "table":
                self.send_coalesced()          # routed by the table they were sent under
                self.table = cmd[1]
                self.small = {}
                self.forget_routes()
            elif kind == "stop":
                self.flush_all()
                self.send_coalesced()
                self.running = False
        except Exception as exc:  # report to the caller's handle instead of dying
            handle = next((c for c in cmd if isinstance(c, Handle)), None)
            if handle is None:
                raise
            err = _as_autops_error(exc, kind)
            while handle._pending > 0:
                handle._part_done(err)

    def small_of(self, agg: str, iteration: int) -> set[str]:
        """Small keys that ``agg`` serves at ``iteration`` (one batch per aggregator)."""
        cache = (agg, iteration if self.table.moves else None)
        if cache not in self.small:
            if len(self.small) > 256:
                self.small.clear()
            self.small[cache] = {k for k, s in self.table.keys.items()
                                 if s.small and self.table.route(k, iteration) == agg}
        return self.small[cache]

    def do_push(self, specs, flat, iteration, handle, hp, out=None) -> None:
        """Push ``flat`` (and, with ``out``, pull the result into it: one PUSH_PULL per key)."""
        if iteration > self.last_iteration:
            self.last_iteration = iteration
            self.marks.append((iteration, time.monotonic()))
        for spec in specs:
            agg = self.table.route(spec.key, iteration)
            sl = slice(spec.offset, spec.offset + spec.numel)
            part = Part(spec, handle, iteration, data=flat[sl], out=out[sl] if out is not None else None, hp=hp)
            self.route_push(agg, part)
            if self.agent.fault_tolerant:
                # after the send: a copy overlaps the transfer
                borrow = self.keeps_aggregates and part.fused and part.staged is None and not self.lends(agg)
                self.keep(spec, iteration, part.data, part.staged if self.keeps_staged else None, borrow)

    def route_push(self, agg: str, part: Part) -> None:
        """Batch a small key's push, or stage and send a large one's."""
        spec = part.spec
        if spec.small:
            if spec.key in self.batch_keys[agg]:
                self.flush(agg)
            self.batch_push[agg].append(part)
            self.batch_keys[agg].add(spec.key)
            part.handle.batched = True
            self.maybe_flush(agg)
            return
        staged = self.free_stage(spec) if self.lends(agg) else None
        if staged is not None:
            # the aggregator reads the staged copy in place until it answers our pull of
            # this iteration
            part.staged = staged
            np.copyto(staged.array, part.data)
            self.staged_busy[spec.key] = part.iteration
        op = wire.PUSH_PULL if part.fused else wire.PUSH
        if staged is not None or not self.coalesces:
            self.send(agg, op, [part])
            return
        limit = self.agent.partition_bytes or 0
        for parts in self.coalesced.add((agg, op), spec.key, part.data.nbytes, part, limit):
            self.send_parts(agg, op, parts)

    def send_coalesced(self) -> None:
        """The burst of commands ended: send the pushes still grouped, one message each."""
        for (agg, op), parts in self.coalesced.drain():
            self.send_parts(agg, op, parts)

    def send_parts(self, agg: str, op: str, parts: list[Part]) -> None:
        """``send``, with a failure reported to the parts' handles (they came from several
        commands, so no one command's error handling covers them)."""
        try:
            self.send(agg, op, parts)
        except Exception as exc:  # noqa: BLE001 -- to the callers, as a failed command would
            err = _as_autops_error(exc, "push")
            for part in parts:
                part.finish(err)

    def do_pull(self, specs, flat, iteration, handle) -> None:
        for spec in specs:
            agg = self.table.route(spec.key, iteration)
            part = Part(spec, handle, iteration, out=flat[spec.offset:spec.offset + spec.numel])
            if spec.small:
                self.batch_pull[agg].append(part)
                handle.batched = True
                self.maybe_flush(agg)
            else:
                self.send(agg, wire.PULL, [part])

    def maybe_flush(self, agg: str) -> None:
        """Send ``agg``'s batch once it holds every small key it serves (pushes, pulls, or both)."""
        batch_push, batch_pull = self.batch_push[agg], self.batch_pull[agg]
        batch = batch_push or batch_pull
        small = self.small_of(agg, batch[-1].iteration if batch else 0)
        if len(batch_push) < len(small) and len(batch_pull) < len(small):
            return              # cannot cover them yet (cheap: no sets per small key)
        pushed = self.batch_keys[agg]
        pulled = {p.spec.key for p in batch_pull} | {p.spec.key for p in batch_push if p.fused}
        if pushed >= small and (not pulled or pulled >= small):
            self.flush(agg)
        elif not pushed and pulled >= small:
            self.flush(agg)

    def flush(self, agg: str) -> None:
        pushes, pulls = self.batch_push.pop(agg, []), self.batch_pull.pop(agg, [])
        self.batch_keys.pop(agg, None)
        fused = [p for p in pushes if p.fused]
        if fused:
            self.send(agg, wire.PUSH_PULL, fused)
        if len(fused) < len(pushes):
            self.send(agg, wire.PUSH, [p for p in pushes if not p.fused])
        if pulls:
            self.send(agg, wire.PULL, pulls)

    def flush_all(self) -> None:
        for agg in list(set(self.batch_push) | set(self.batch_pull)):
            self.flush(agg)

    def request(self, agg: str, kind: str, parts: list[Part], op: str, payloads: list = (),
                **fields: Any) -> None:
        """Send one request of this job and rank to ``agg``; its reply completes ``parts``."""
        channel = self.channel_for(agg)
        req = next(self.reqs)
        agent = self.agent
        head = wire.header(op, req=req, job=agent.job, secret=agent.secret, rank=agent.rank, **fields)
        now = time.monotonic()
        self.inflight[req] = Request(kind, agg, parts, now + agent.timeout, now,
                                     (op, list(payloads), fields) if kind in (wire.INIT, wire.BCAST_PUT,
                                                                              wire.BCAST_GET) else None)
        channel.send(head, payloads)

    def send(self, agg: str, op: str, parts: list[Part], replay: bool = False) -> None:
        """A PUSH, PUSH_PULL, PULL or STATE_GET of ``parts``, all served by ``agg``; ``replay``:
        pushes resent after a failure (the aggregator skips what it has)."""
        if op not in (wire.PUSH, wire.PUSH_PULL):
            self.request(agg, op, parts, op, items=[wire.PullItem(p.spec.key, p.iteration).to_wire() for p in parts])
            return
        lends = self.lends(agg) and not replay
        items, payloads = [], []
        if len(parts) > 1 and all(p.spec.small for p in parts):
            # a batch of small keys: one payload for all of them, not one frame each
            blob, spans = wire.pack([p.data for p in parts])
            items = [wire.PushItem(p.spec.key, p.iteration, wire.Slice(0, offset, nbytes), p.hp).to_wire()
                     for p, (offset, nbytes) in zip(parts, spans)]
            payloads = [blob]
        else:
            for p in parts:
                items.append(wire.PushItem(p.spec.key, p.iteration, wire.Slice(len(payloads), 0, p.data.nbytes),
                                           p.hp).to_wire())
                payloads.append(p.staged if p.staged is not None and lends else p.data)
        if replay:
            self.request(agg, op, parts, op, payloads, items=items, replay=True)
        else:
            self.request(agg, op, parts, op, payloads, items=items)

    def do_init(self, specs, flat, handle, hp, state, step) -> None:
        per_agg: dict[str, list] = collections.defaultdict(list)
        for spec in specs:
            per_agg[self.table.route(spec.key, 0)].append(spec)
        for agg, agg_specs in per_agg.items():
            payloads, items, parts = [], [], []
            for spec in agg_specs:
                sl = slice(spec.offset, spec.offset + spec.numel)
                param = flat[sl]
                staged = self.free_stage(spec) if not spec.small and self.lends(agg) else None
                if staged is not None:                 # copied by the aggregator before it acks
                    np.copyto(staged.array, param)
                    self.staged_busy[spec.key] = 0
                    param = staged
                data = wire.Slice(len(payloads), 0, flat[sl].nbytes)
                payloads.append(param)
                slices = {}
                for name, arr in state.items():
                    slices[name] = wire.Slice(len(payloads), 0, arr[sl].nbytes)
                    payloads.append(arr[sl])
                items.append(wire.InitItem(spec.key, data, int(step), slices).to_wire())
                parts.append(Part(spec, handle, 0))
            self.request(agg, wire.INIT, parts, wire.INIT, payloads, items=items, hp=hp)

    def do_state(self, specs, iteration, handle) -> None:
        per_agg: dict[str, list[Part]] = collections.defaultdict(list)
        for spec in specs:
            per_agg[self.table.route(spec.key, iteration)].append(Part(spec, handle, iteration))
        for agg, parts in per_agg.items():
            self.send(agg, wire.STATE_GET, parts)

    def do_bcast(self, name, flat, root, seq, handle) -> None:
        agent = self.agent
        agg = self.table.home or agent.aggregators[0]
        part = Part(KeySpec(name, name, 0, flat.size, str(flat.dtype), False), handle, seq,
                    data=flat if agent.rank == root else None, out=None if agent.rank == root else flat)
        if agent.rank == root:
            self.request(agg, wire.BCAST_PUT, [part], wire.BCAST_PUT, [flat.view(np.uint8)], name=name, seq=seq,
                         dtype=str(flat.dtype), shape=[flat.size])
        else:
            self.request(agg, wire.BCAST_GET, [part], wire.BCAST_GET, name=name, seq=seq)

    # replies ----------------------------------------------------------------------------
    def reply(self, channel: Channel, inbound: Inbound) -> None:
        try:
            msg = wire.parse(inbound.header, inbound.payloads, inbound.lent)
        except wire.ProtocolError as exc:
            log.warning("bad reply from aggregator %s: %s", self.channel_agg.get(channel), exc)
            return
        if msg.op == wire.WARM:
            self.agent.warmed += 1
            return
        request = self.inflight.pop(msg.get("req"), None)
        if request is None:
            return      # timed out earlier
        if msg.op == wire.ERROR:
            err = AutoPSError(f"aggregator {request.agg}: {msg['message']}")
            if not request.parts:
                log.error("%s refused by aggregator %s: %s", request.kind, request.agg, msg["message"])
            for part in request.parts:
                part.finish(err)
        elif msg.op == wire.REDIRECT:
            self.redirect(request, msg)
        elif msg.op == wire.PULL_REPLY:
            self.fill(request, msg)
        elif msg.op == wire.STATE_REPLY:
            self.fill_state(request, msg)
        elif request.kind == wire.PUSH_PULL:
            err = AutoPSError(f"aggregator {request.agg} answered a push_pull with {msg.op}, not the pulled value")
            for part in request.parts:
                part.finish(err)
        else:
            if request.kind == wire.INIT:
                for part in request.parts:
                    if self.staged_busy.get(part.spec.key) == 0:
                        del self.staged_busy[part.spec.key]
            for part in request.parts:
                part.finish()

    def fill(self, request: Request, msg: wire.Message) -> None:
        try:
            items = msg.items(wire.PullReplyItem)
        except wire.ProtocolError as exc:
            items, error = [], AutoPSError(f"pull reply from {request.agg}: {exc}")
        else:
            error = None
        by_key = {p.spec.key: p for p in request.parts}
        moved: list[wire.Move] = []
        for item in items:
            part = by_key.pop(item.key, None)
            if part is None:
                continue
            try:
                data = item.data
                src = msg.whole(item.payload, part.out.dtype) if data is None else msg.array(data, part.out.dtype)
                lent = data is None and item.payload in msg.lent
            except wire.ProtocolError as exc:
                part.finish(AutoPSError(f"pull of {part.spec.key!r}: bad reply: {exc}"))
                continue
            if src.size != part.out.size:
                part.finish(AutoPSError(
                    f"pull of {part.spec.key!r}: reply has {src.size} elements, expected {part.out.size}"))
                continue
            pulled = request.kind in (wire.PULL, wire.PUSH_PULL)
            if pulled and self.keeps_aggregates and lent:
                self.own_kept(part.spec, part.iteration)    # before ``out`` (maybe the push) changes
            np.copyto(part.out, src)
            if pulled:
                self.pulled_answered(part.spec.key, part.iteration,
                                     src if self.keeps_aggregates and not lent else None)
            if self.staged_busy.get(part.spec.key, 1 << 62) <= part.iteration:
                del self.staged_busy[part.spec.key]     # the aggregator is done with our staged push
            part.finish()
            if item.moved is not None:
                moved.append(item.moved)
        for part in by_key.values():
            part.finish(error or AutoPSError(f"pull reply from {request.agg} lacks {part.spec.key!r}"))
        for move in moved:        # after the worker has its values: off its critical path
            self.learn_move(move)

    def fill_state(self, request: Request, msg: wire.Message) -> None:
        by_key = {p.spec.key: p for p in request.parts}
        try:
            copies = list(wire.key_copies(msg))
        except wire.ProtocolError as exc:
            copies, error = [], AutoPSError(f"state reply from {request.agg}: {exc}")
        else:
            error = AutoPSError(f"state reply from {request.agg} lacks a key")
        for key, meta, views in copies:
            part = by_key.pop(key, None)
            if part is None:
                continue
            try:
                arrays = [np.frombuffer(v, dtype=part.spec.dtype) for v in views]
                part.handle._absorb(part.spec, meta, arrays)
            except (AutoPSError, ValueError) as exc:
                part.handle._part_done(exc if isinstance(exc, AutoPSError) else AutoPSError(str(exc)))
                continue
            part.handle._part_done()
        for part in by_key.values():
            part.handle._part_done(error)

    def learn_move(self, move: wire.Move) -> None:
        """The old owner said: ``move.key`` is served by ``move.to`` from ``move.first`` on."""
        if self.table.moves.get(move.key) == (move.to, move.first):
            return
        self.table.learn(move.key, move.to, move.first, move.info)
        self.small = {}
        self.forget_routes(move.to)
        self.ahead.add(move.to)

    def redirect(self, request: Request, msg: wire.Message) -> None:
        """The key moved: learn where from the reply (or, without details, from pMaster's
        table) and resend every part of the request to its owner."""
        self.agent.redirects += 1
        try:
            moves = msg.items(wire.Move)
        except wire.ProtocolError as exc:
            log.warning("malformed redirect from %s: %s", request.agg, exc)
            moves = []
        if moves:
            for move in moves:
                self.learn_move(move)
        else:
            reply = self.master.call(wire.GET_TABLE, job=self.agent.job, secret=self.agent.secret)
            if int(reply.get("epoch") or 0) > self.table.epoch:
                self.failover(reply, [request])
                return
            table = Table()
            table.load(reply)
            self.table = table
            self.small = {}
            self.forget_routes()
            with self.agent._table_lock:
                self.agent.table = table
        table = self.table
        per_agg: dict[str, list[Part]] = collections.defaultdict(list)
        for part in request.parts:
            per_agg[table.route(part.spec.key, part.iteration)].append(part)
        for agg, parts in per_agg.items():
            self.send(agg, request.kind, parts)

    # failures ---------------------------------------------------------------------------
    def keep(self, spec: KeySpec, iteration: int, data: np.ndarray, staged: Shared | None = None,
             borrow: bool = False) -> None:
        """Keep this rank's push of ``iteration`` (replayed if its aggregator is lost): the
        ``staged`` copy itself when there is one -- ``free_stage`` leaves it alone until
        ``pulled_answered`` --, ``data`` itself when ``borrow`` (a push_pull over a socket:
        ``fill`` replaces it with the value pulled before the caller may touch it), else a
        copy."""
        kept = self.kept.setdefault(spec.key, {})
        owned = self.owned.setdefault(spec.key, set())
        old = kept.pop(iteration, None)
        if iteration not in owned:
            old = None                      # a staged or borrowed buffer is not ours to copy into
        owned.discard(iteration)
        if staged is not None or borrow:
            if old is not None:
                self.spare.setdefault(spec.key, []).append(old)
            kept[iteration] = staged.array if staged is not None else data
            return
        if old is None:
            spare = self.spare.get(spec.key)
            old = spare.pop() if spare else np.empty(spec.numel, spec.dtype)
        np.copyto(old, data)
        kept[iteration] = old
        owned.add(iteration)

    def own_kept(self, spec: KeySpec, iteration: int) -> None:
        """Copy a borrowed push of ``iteration`` before the caller's array is overwritten
        (its pull was answered with a value this rank cannot keep: lent memory)."""
        arr = self.kept.get(spec.key, {}).get(iteration)
        if arr is not None and iteration not in self.owned.get(spec.key, ()) \
                and not any(buf.array is arr for buf in self.staging.get(spec.key, ())):
            self.keep(spec, iteration, arr)

    def pulled_answered(self, key: str, iteration: int, value: np.ndarray | None = None) -> None:
        """The pull of ``iteration`` was answered: every rank has pushed it, hence pulled
        ``iteration - 1``, so no rank can need the pushes before ``iteration`` again. With
        the ``value`` pulled (memory of this rank's own, kept by reference): a RECOVER gives it
        to a new owner instead of this rank's push of ``iteration``, so that goes too."""
        if iteration <= self.pulled.get(key, 0):
            return
        self.pulled[key] = iteration
        if value is not None:
            self.aggregates[key] = value
        else:
            self.aggregates.pop(key, None)
        kept = self.kept.get(key)
        if not kept:
            return
        owned = self.owned.get(key, set())
        spare = self.spare.setdefault(key, [])
        for old in [it for it in kept if it < iteration or (value is not None and it == iteration)]:
            buf = kept.pop(old)
            if old in owned:
                owned.discard(old)
                if len(spare) < 2:
                    spare.append(buf)

    def probe(self) -> None:
        """Ask pMaster whether the job's keys moved after a failure (``epoch``; the answer is
        small when nothing moved). Not waited for: ``master_replies`` takes the answer."""
        self.next_probe = time.monotonic() + PROBE_AFTER
        agent = self.agent
        try:
            self.probe_req = self.master.send(wire.GET_TABLE, job=agent.job, secret=agent.secret,
                                              rank=agent.rank, since=self.table.epoch)
        except zmq.ZMQError:
            pass            # pMaster unreachable; the next period tries again

    def master_replies(self) -> None:
        """pMaster's answers to probes (other replies on this socket are stale)."""
        while True:
            try:
                frames = self.master.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = wire.decode(frames)
            except wire.ProtocolError as exc:
                log.warning("bad reply from pMaster: %s", exc)
                continue
            if self.probe_req is None or reply.get("req") != self.probe_req:
                continue
            self.probe_req = None
            if reply.op == wire.ERROR:
                if "is not registered" in reply["message"]:
                    self.rejoin()           # pMaster restarted
                else:
                    self.fail_all(AutoPSError(f"master: {reply['message']}"))   # e.g. state lost with an aggregator
            elif reply.get("keys") is not None and int(reply.get("epoch") or 0) > self.table.epoch:
                self.failover(reply)

    def rejoin(self) -> None:
        """pMaster restarted and does not know the job yet: register this rank again (with
        the job's secret) and declare its tensors again. pMaster rebuilt the table from what
        its aggregators hold; until they have registered it asks to retry (next probe)."""
        agent = self.agent
        short = min(agent.timeout, max(PROBE_AFTER, 1.0))
        try:
            self.master.call(wire.REGISTER_JOB, timeout=short, secret=agent.secret, rejoin=True,
                             **agent._registration)
            reply = self.master.call(wire.DECLARE, timeout=agent.timeout, job=agent.job, secret=agent.secret,
                                     tensors=list(agent._declared))
        except MasterUnreachable as exc:
            log.debug("rejoin: %s", exc)
            return
        except AutoPSError as exc:
            if "retry" in str(exc):
                return
            self.fail_all(exc)
            return
        log.warning("job %s rank %d: registered again with a restarted pMaster", agent.job, agent.rank)
        self.failover(reply)

    def failover(self, reply: wire.Message, extra: Iterable[Request] = ()) -> None:
        """pMaster moved keys after losing aggregators: take its table, tell each new owner
        of a moved key the last iteration this rank pulled (RECOVER), replay the pushes kept
        for those keys and resend every request that was waiting for them."""
        old, new = self.table, Table()
        new.load(reply)
        lost = new.lost

        def moved(key: str) -> bool:
            move = old.moves.get(key)
            return old.owner.get(key) in lost or (move is not None and move[0] in lost) \
                or new.owner.get(key) != old.owner.get(key)

        affected = {k for k in new.keys if moved(k)}
        dropped = list(extra)
        for req, request in list(self.inflight.items()):
            if request.agg in lost or any(p.spec.key in affected for p in request.parts):
                dropped.append(self.inflight.pop(req))
        unsent = [p for batch in (*self.batch_push.values(), *self.batch_pull.values()) for p in batch]
        self.batch_push.clear()
        self.batch_pull.clear()
        self.batch_keys.clear()
        self.table = new
        self.small = {}
        self.forget_routes()
        with self.agent._table_lock:
            self.agent.table = new
        if affected:
            log.warning("job %s rank %d: aggregator(s) %s lost; %d key(s) recover on %s", self.agent.job,
                        self.agent.rank, sorted(lost), len(affected), sorted({new.owner[k] for k in affected}))
        recover: dict[str, tuple[list, list]] = collections.defaultdict(lambda: ([], []))
        for key in sorted(affected):
            items, values = recover[new.owner[key]]
            held = self.aggregates.get(key)
            value = None
            if held is not None:
                value = wire.Slice(len(values), 0, held.nbytes)
                values.append(held)
            items.append(wire.RecoverItem(key, self.pulled.get(key, 0), value).to_wire())
        for agg, (items, values) in recover.items():
            self.request(agg, wire.RECOVER, [], wire.RECOVER, values, items=items)
        pushes: dict[tuple, Part] = {}
        pulls: list[Part] = []
        for request in dropped:
            if request.resend is not None:
                self.resend_whole(request)
                continue
            unsent.extend(request.parts)
        for part in unsent:                      # dropped, or batched and not sent yet
            push, pull = part.halves() if part.fused else (part, None) if part.data is not None else (None, part)
            if push is not None:
                pushes[(push.spec.key, push.iteration)] = push
            if pull is not None:
                pulls.append(pull)
        replay: dict[tuple, list[Part]] = collections.defaultdict(list)     # (iteration, agg) -> parts
        for key in sorted(affected):
            for it, copy in sorted(self.kept.get(key, {}).items()):
                part = pushes.pop((key, it), None)
                handle = part.handle if part is not None else _Background(key, self.agent)
                replay[(it, new.route(key, it))].append(Part(new.keys[key], handle, it, data=copy,
                                                             hp=part.hp if part is not None else None))
        for part in pushes.values():            # not kept (fault tolerance off) or not affected
            replay[(part.iteration, new.route(part.spec.key, part.iteration))].append(
                Part(new.keys.get(part.spec.key, part.spec), part.handle, part.iteration, data=part.data, hp=part.hp))
        for (_, agg), parts in sorted(replay.items(), key=lambda kv: kv[0]):
            self.send(agg, wire.PUSH, parts, replay=True)
        by_kind: dict[tuple, list[Part]] = collections.defaultdict(list)
        for part in pulls:
            kind = wire.STATE_GET if isinstance(part.handle, StateHandle) else wire.PULL
            by_kind[(new.route(part.spec.key, part.iteration), kind)].append(part)
        for (agg, kind), parts in by_kind.items():
            self.send(agg, kind, parts)

    def resend_whole(self, request: Request) -> None:
        """Resend an INIT or broadcast to whoever serves it now."""
        op, payloads, fields = request.resend
        if op == wire.INIT:
            agg = self.table.route(request.parts[0].spec.key, 0)
        else:
            agg = self.table.home or self.agent.aggregators[0]
        self.request(agg, request.kind, request.parts, op, payloads, **fields)

    def expire(self) -> None:
        now = time.monotonic()
        for req, request in list(self.inflight.items()):
            if now > request.deadline:
                del self.inflight[req]
                keys = ", ".join(p.spec.key for p in request.parts[:4])
                more = f" and {len(request.parts) - 4} more" if len(request.parts) > 4 else ""
                its = sorted({p.iteration for p in request.parts})
                err = TimeoutError(
                    f"job {self.agent.job} rank {self.agent.rank}: {request.kind} of {keys}{more} "
                    f"(iteration {its[0] if len(its) == 1 else its}) at aggregator {request.agg} got no reply "
                    f"within {self.agent.timeout:.0f}s; another worker of the job may have died or the "
                    f"aggregator is down (AUTOPS_TIMEOUT sets this limit)")
                for part in request.parts:
                    part.finish(err)
