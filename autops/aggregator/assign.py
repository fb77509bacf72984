"""pMaster's ASSIGN on an aggregator: a job's declared keys created here.

``Assignments`` commits the keys' bytes (``commitments.Commitments``: room, per-job and
per-tenant limits), creates the keys in the store and tells them which aggregator backs
them up. Large new buffers -- in server mode also the gradient accumulators and the
optimizer's state -- are allocated and populated by a helper thread, at once (the job waits
for them), while pMaster's later messages wait (``held.HeldMessages``), so the aggregator's
loop keeps serving and sending heartbeats (an allocation of a GiB holds it for a second) and
does not fault the state in at the job's first steps.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from ..wire import protocol as wire
from ..wire.partition import KeySpec
from .commitments import Commitments
from .held import HeldMessages
from .links import Control
from .reserve import MemoryReadier
from .store import KeyState, Store, StoreError

__all__ = ["Assignments"]

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


class Assignments:
    """The keys pMaster assigns to one aggregator.

    ``store``: where they are created; ``readier``: their memory, made ready off the loop
    when large; ``control``: answers to pMaster; ``commitments``: the checks their bytes pass;
    ``set_replica(key, info)``: who backs a key up (``Replication.set_replica``); ``held``:
    pMaster's messages that wait while keys are allocated off the loop, handed back to
    ``handle`` (the aggregator's dispatch of pMaster's messages) once they exist."""

    def __init__(self, store: Store, readier: MemoryReadier, control: Control, commitments: Commitments,
                 set_replica: Callable[[KeyState, dict | None], None], held: HeldMessages,
                 handle: Callable[[list], None]) -> None:
        self.store = store
        self.readier = readier
        self.memory = readier.memory
        self.control = control
        self.commitments = commitments
        self.set_replica = set_replica
        self.held = held
        self.handle = handle

    def assign(self, msg: wire.Message) -> None:
        """ASSIGN: create a job's keys; large new ones off the loop, while pMaster's later
        messages wait (``held``)."""
        try:
            keys = [KeySpec.from_wire(k) for k in msg["keys"]]
            state = self.store.jobs.get(msg["job"])
            fresh = [k for k in keys if state is None or k.key not in state.keys]
            sizes = Store.buffer_sizes(msg["mode"], fresh)
            private = Store.private_sizes(msg["mode"], msg.get("optimizer"), msg.get("hp"), fresh)
            nbytes = sum(numel * np.dtype(dtype).itemsize for numel, dtype in sizes + private)
            self.commitments.learn_tenant(msg["job"], msg.get("tenant"))
            if fresh:
                self.commitments.check_room(msg["job"], nbytes)
        except (KeyError, ValueError, TypeError, IndexError, StoreError) as exc:
            self.control.error(str(exc), msg.get("req"))
            return
        committed = nbytes if fresh else 0
        self.commitments.pend(msg["job"], committed)
        if not fresh or not self.memory.slow_to_allocate(nbytes):
            self._finish(msg, keys, committed=committed)
            return
        self.held.hold()
        log.info("job %s: allocating %d bytes for %d keys off the loop", msg["job"], nbytes, len(fresh))
        self.readier.ready_in_background(msg["job"], sizes, private, nbytes, 0,
                                         lambda made, arrays: self._finish(msg, keys, made, arrays, committed),
                                         at_once=True)

    def _finish(self, msg: wire.Message, keys: list, made: tuple | None = None,
                private: list | None = None, committed: int = 0) -> None:
        """Create ``keys`` (in ``made`` -- ``(buffers, allocation error)`` from a helper thread,
        with ``private``: their server-mode arrays -- or in memory allocated now), answer
        pMaster, then handle what it sent meanwhile."""
        req = msg.get("req")
        try:
            buffers = None
            if made is not None:
                shared, error = made
                if error is not None:
                    raise StoreError(f"job {msg['job']!r}: cannot allocate memory for its keys: {error}")
                buffers = [(buf.array, buf) for buf in shared]
            with self.commitments.prechecked(msg["job"]):    # checked, and pending (``assign``)
                self.store.assign(msg["job"], msg["secret"], msg["world_size"], msg["mode"], keys,
                                  average=bool(msg.get("average", True)), optimizer=msg.get("optimizer"),
                                  hp=msg.get("hp") or {}, buffers=buffers, private=private)
            state = self.store.jobs[msg["job"]]
            for key, info in (msg.get("replicas") or {}).items():
                if key in state.keys:
                    self.set_replica(state.keys[key], info)
            self.control.ok(req)
        except (StoreError, ValueError, TypeError) as exc:
            self.control.error(str(exc), req)
        finally:
            self.commitments.unpend(msg["job"], committed)   # the store holds them now, or nothing was made
            if made is not None:
                self.held.resume(self.handle)
