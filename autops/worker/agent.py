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

This module holds the ``Agent`` (the user threads' side); the I/O thread is ``ioloop.IOLoop``,
which the agent's methods reach only through typed commands (``commands``) and the shared
objects its constructor takes. ``Handle``, ``Table``, ``MasterClient`` and the errors live in
modules of their own and are importable from here as before.

Every rank presents its job's secret (from its launcher: ``secret=`` or
``$AUTOPS_JOB_SECRET``, ``AgentConfig``; ``jobauth``) to pMaster and with every data request; pMaster never
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
import logging
import os
import threading
import weakref
from typing import Iterable

import numpy as np

from dlrt import requeue
from dlrt.curve import Security, default_security
from dlrt.procs import name_this_thread

from ..config import DEFAULT_TIMEOUT, SECRET_ENV, WARM_BYTES, AgentConfig
from ..wire import protocol as wire
from ..wire.partition import KeySpec
from ..transport import TRANSPORTS, make_context
from ..transport.cma import require_cma
from ..transport.rdma_verbs import require_device
from .commands import (BcastCmd, Command, CommandQueue, FlushCmd, InitCmd, PullCmd, PushCmd, StateCmd,
                       StopCmd, TableCmd)
from .errors import AuthRefused, AutoPSError, BadSetting, MasterUnreachable, PoolBusy
from .handles import Handle, Part, StateHandle
from .ioloop import PROBE_AFTER, PROFILE_PERIOD, IOLoop, Request
from .masterclient import MasterClient
from .shared import Counters, LoopConfig, Registration
from .table import SharedTable, Table

# the names importable from here (several live in the modules above since the I/O loop has its own)
__all__ = ["Agent", "AuthRefused", "AutoPSError", "BadSetting", "DEFAULT_TIMEOUT", "EXIT_DONE_TIMEOUT",
           "Handle", "JOB_DONE_TIMEOUT", "MasterClient", "MasterUnreachable", "PROBE_AFTER", "PROFILE_PERIOD",
           "Part", "PoolBusy", "Request", "StateHandle", "Table", "WARM_BYTES", "config_from_env"]

log = logging.getLogger("autops.worker.agent")

JOB_DONE_TIMEOUT = 5.0     # seconds a finished rank waits for pMaster to take its JOB_DONE
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


def config_from_env() -> AgentConfig:
    """``AgentConfig.from_env()``, a bad value raised as ``BadSetting`` (an ``AutoPSError``
    and a ``ValueError``, naming the variable)."""
    try:
        return AgentConfig.from_env()
    except ValueError as exc:
        raise BadSetting(str(exc)) from None


class Agent:
    """A worker's client of the parameter service."""

    def __init__(self, master: str, job: str, rank: int, world_size: int, mode: str = "sum",
                 num_aggregators: int = 0, average: bool = True, optimizer: str | None = None,
                 hp: dict | None = None, timeout: float = DEFAULT_TIMEOUT, transport: str = "auto",
                 partition_bytes: int | None = None, small_bytes: int | None = None,
                 secret: str | None = None, fault_tolerant: bool = True, security: Security | None = None,
                 warm_bytes: int | None = None, config: AgentConfig | None = None) -> None:
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
        0: none, at most ``wire.MAX_WARM_BYTES``).
        ``config``: what the environment sets where these arguments say nothing -- the secret,
        the partition and warm sizes, coalescing and the transport's settings (default
        ``config_from_env()``, read here); the other arguments keep their own defaults."""
        config = config if config is not None else config_from_env()
        secret = secret or config.secret
        if partition_bytes is None:
            partition_bytes = config.partition_bytes
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
            warm_bytes = config.warm_bytes
        if not 0 <= warm_bytes <= wire.MAX_WARM_BYTES:
            raise AutoPSError(f"warm_bytes {warm_bytes} outside 0..{wire.MAX_WARM_BYTES}")
        self.warm_bytes = warm_bytes
        # what the I/O thread counts: redirects and connections warmed (``redirects``, ``warmed``)
        self._counters = Counters()
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
        # what this rank told pMaster, to tell a restarted pMaster again (``IOLoop.rejoin``)
        self._registration = Registration(dict(
            job=job, world_size=world_size, rank=rank, num_aggregators=num_aggregators, mode=mode, average=average,
            optimizer=optimizer, hp=hp or {}, partition_bytes=partition_bytes, small_bytes=small_bytes,
            replicate=fault_tolerant), secret)
        try:
            reply = self._master.call(wire.REGISTER_JOB, secret=secret, **self._registration.fields)
        except BaseException as exc:
            self._master.close()
            self.ctx.term()
            if isinstance(exc, (PoolBusy, MasterUnreachable)):     # a launcher may run it again later
                requeue.request(f"AutoPS pool refused the job for now: {str(exc).removeprefix('master: ')}")
            raise
        self.aggregators: list[str] = list(reply["aggregators"])
        table = Table()
        table.aggs = dict(reply.get("endpoints") or {})
        table.home = reply.get("home") or (self.aggregators[0] if self.aggregators else None)
        self._tables = SharedTable(table)      # read here, replaced by a declare or by the I/O thread
        self._sizes: dict[str, tuple] = {}     # name -> (table entry, dtype, numel), for _check
        self._commands = CommandQueue()
        self._closed = False
        # what the I/O thread needs of this agent, all of it (it never sees the agent)
        self._loop_config = LoopConfig(job=job, rank=rank, master=master,
                                       aggregators=tuple(self.aggregators), timeout=timeout,
                                       fault_tolerant=fault_tolerant, mode=mode, warm_bytes=warm_bytes,
                                       transport=transport, security=self.security, ctx=self.ctx,
                                       coalesce=config.coalesce, transport_config=config.transport_config)
        self._io = threading.Thread(target=self._io_main, name=f"autops-agent-{rank}", daemon=True)
        self._io_ready = threading.Event()
        self._io.start()
        self._io_ready.wait()
        self._submit(TableCmd(table))
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
        self._registration.declared.extend(entries)
        if reply.get("partition_bytes"):        # pMaster's choice, told again to a restarted pMaster
            self._registration.fields["partition_bytes"] = int(reply["partition_bytes"])
        self._set_table(reply)

    @property
    def partition_bytes(self) -> int | None:
        """The job's partition size: the one set, else pMaster's choice (known after a declare)."""
        return self._registration.partition_bytes

    @property
    def secret(self) -> str:
        """The job's secret, sent with every request (set: the next requests carry the new one)."""
        return self._registration.secret

    @secret.setter
    def secret(self, value: str) -> None:
        self._registration.secret = value

    @property
    def table(self) -> Table:
        """The table this agent routes by now (pMaster's, as last declared, redirected or failed over)."""
        return self._tables.current

    @property
    def redirects(self) -> int:
        """Requests an aggregator answered with REDIRECT (the key had moved): each costs a round
        trip and a resend; live migration tells the agents ahead, so it should stay 0."""
        return self._counters.redirects

    @property
    def warmed(self) -> int:
        """Connections warmed ahead of a move (``IOLoop.warm``): answers that came back."""
        return self._counters.warmed

    def _set_table(self, reply: wire.Message) -> None:
        table = Table()
        table.load(reply)
        self._tables.replace(table)
        self._submit(TableCmd(table))

    def keys_of(self, name: str) -> list[KeySpec]:
        with self._tables.locked() as table:
            specs = table.by_tensor.get(name)
        if specs is None:
            raise AutoPSError(f"tensor {name!r} was not declared; declare it before push/pull")
        return specs

    def placement(self) -> dict[str, list[str]]:
        """aggregator id -> keys it serves for this job."""
        out: dict[str, list[str]] = {}
        with self._tables.locked() as table:
            for key in list(table.owner):
                out.setdefault(table.final_owner(key), []).append(key)
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
        self._submit(PushCmd(specs, flat, iteration, handle, hp))
        return handle

    def pull(self, name: str, out: np.ndarray, iteration: int) -> Handle:
        """Fill ``out`` (contiguous) with the published value of ``iteration``."""
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise AutoPSError(f"pull of {name!r}: the output array must be contiguous and writeable")
        specs, flat = self._check(name, out)
        handle = Handle.of(name, self, specs, len(specs))
        self._submit(PullCmd(specs, flat, iteration, handle))
        return handle

    def push_pull(self, name: str, array: np.ndarray, out: np.ndarray, iteration: int,
                  hp: dict | None = None) -> Handle:
        """Push ``array`` for ``iteration`` and pull the result into ``out``: one handle for both."""
        specs, flat = self._check(name, array)
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise AutoPSError(f"push_pull of {name!r}: the output array must be contiguous and writeable")
        _, out_flat = self._check(name, out)
        handle = Handle.of(name, self, specs, 2 * len(specs))
        self._submit(PushCmd(specs, flat, iteration, handle, hp, out_flat))
        return handle

    def init(self, name: str, array: np.ndarray, hp: dict | None = None,
             opt_state: dict[str, np.ndarray] | None = None, step: int = 0) -> Handle:
        """Server mode: set the master copy (and optimizer state) of ``name`` on the aggregators."""
        specs, flat = self._check(name, array)
        state = {k: np.ascontiguousarray(v).reshape(-1) for k, v in (opt_state or {}).items()}
        handle = Handle(name, self)
        handle._add(len(specs))
        self._submit(InitCmd(specs, flat, handle, hp, state, step))
        return handle

    def fetch_state(self, name: str, iteration: int) -> StateHandle:
        """Server mode: fetch the master copy, optimizer state and step of ``name`` as they are
        right after ``iteration`` (the last one this worker completed; for checkpoints)."""
        specs = self.keys_of(name)
        shape, dtype = self.table.tensors[name]
        handle = StateHandle(name, self, int(np.prod(shape, dtype=np.int64)), dtype)
        handle._add(len(specs))
        self._submit(StateCmd(specs, iteration, handle))
        return handle

    def broadcast(self, name: str, array: np.ndarray, root: int, seq: int) -> Handle:
        """Copy ``array`` of rank ``root`` into ``array`` of every other rank (bytes, any dtype)."""
        flat = np.ascontiguousarray(array).reshape(-1)
        handle = Handle(name, self)
        if self.world_size == 1:
            handle._seal()
            return handle
        handle._add(1)
        self._submit(BcastCmd(name, flat, root, seq, handle))
        return handle

    def flush(self) -> None:
        """Send batched small keys now (a wait on a handle does this itself)."""
        self._submit(FlushCmd())

    def job_done(self) -> None:
        """Tell pMaster this rank has finished; the job is released when all ranks have."""
        if self._registration.done:
            return
        self._registration.done = True
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
        self._submit(StopCmd())
        self._io.join(timeout=5)
        self._master.close()
        self._commands.close()
        self.ctx.term()

    def _submit(self, cmd: Command) -> None:
        if self._closed and not isinstance(cmd, StopCmd):
            raise AutoPSError("agent is closed")
        self._commands.put(cmd)

    # --- I/O thread ---------------------------------------------------------------------
    def _io_main(self) -> None:
        name_this_thread()
        io = IOLoop(self._loop_config, self._commands, self._tables, self._counters, self._registration)
        self._io_ready.set()
        try:
            io.run()
        except Exception:  # surface instead of hanging the workers
            log.exception("agent I/O thread failed")
            io.fail_all(AutoPSError("agent I/O thread failed; see the log"))
        finally:
            io.close()


