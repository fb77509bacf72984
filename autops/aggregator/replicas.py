"""Replication of server-mode keys between aggregators (failures: a replica takes a lost owner's key over).

``Replication`` owns both sides of it for one aggregator. As a key's owner it sends the key's
replica the whole state (``replicate_state``: master copy, optimizer state, step) and then
every step's averaged gradient (``step``, the store's hook), and takes the replica's answers
(``waits``, ``acked``): a server-mode key with a replica publishes an iteration only once the
replica acknowledged it (``KeyState.published``), and INIT replies wait for it likewise. As a
replica it readies the memory of keys it will back up (``prepare``, REPLICA_PREPARE), installs
whole states and applies steps (``receive``, REPLICATE; ``apply_steps`` also applies the old
owner's steps to a key migrating here whose state came ahead, for ``moves_in.MovesIn``).
pMaster says which aggregator backs a key up (``set_keys``, REPLICA_SET; ``set_replica``).

The per-key replication state stays in ``KeyState`` (``replica``, ``replicated``,
``replica_sent``, ``init_waiters``), which the store's publishing reads; what this class
owns is the REPLICATE requests waiting for their answer.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import numpy as np

from ..transport import Sender
from ..wire import protocol as wire
from ..wire.partition import KeySpec
from .commitments import Commitments
from .links import Control, Peers
from .reserve import MemoryReadier, timed
from .store import KeyState, Store, StoreError

__all__ = ["Replication", "ReplicaWait"]

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


class ReplicaWait(NamedTuple):
    """A REPLICATE sent to ``replica`` (its ``agg``) about ``key``, up to ``iteration``."""
    key: KeyState
    iteration: int
    replica: str


class Replication:
    """The replication of one aggregator's keys, and its backups of other aggregators' keys.

    ``store``: the keys; ``stats``: the aggregator's figures, to which this adds the
    ``replica_install`` and ``state_install`` times; ``readier``: memory made ready for
    backups; ``control``: answers to pMaster; ``commitments``: the room and quota checks a
    backup's bytes pass; ``peers``: channels to the replicas; ``published``: the data path's
    answer to the pulls parked on a key, called when what the key may publish changed."""

    def __init__(self, store: Store, stats: dict, readier: MemoryReadier, control: Control,
                 commitments: Commitments, peers: Peers, published: Callable[[KeyState], None]) -> None:
        self.store = store
        self.stats = stats
        self.readier = readier
        self.memory = readier.memory
        self.control = control
        self.commitments = commitments
        self.peers = peers
        self.published = published
        # steps and states sent to replicas, waiting for their ack
        self.waits: dict[int, ReplicaWait] = {}   # req -> (key, iteration, replica)

    # --- pMaster's commands -------------------------------------------------------------
    def prepare(self, msg: wire.Message) -> None:
        """REPLICA_PREPARE: a new replica of server-mode keys: the memory for their state (master
        copy, optimizer state) is allocated and populated by a helper thread -- at the prefault
        pace for migrating keys, at once (``at_once``) where the job waits
        for it: its new keys, a new replica after a failure -- and kept for
        ``install_replica``; answered once ready."""
        req = msg.get("req")
        try:
            held = self.store.jobs.get(msg["job"])
            # not for keys held here already (their state came first): nothing would take it
            keys = [spec for spec in map(KeySpec.from_wire, msg["keys"])
                    if held is None or (spec.key not in held.replicas and spec.key not in held.keys)]
            params = [(spec.numel, spec.dtype) for spec in keys]
            private = Store.private_sizes(msg["mode"], msg.get("optimizer"), msg.get("hp"), keys, accumulator=False)
            nbytes = sum(numel * np.dtype(dtype).itemsize for numel, dtype in params + private)
            self.commitments.learn_tenant(msg["job"], msg.get("tenant"))
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            self.control.error(str(exc), req)
            return
        if msg["mode"] != "server" or not keys:
            self.control.ok(req)
            return
        try:
            self.commitments.check_room(msg["job"], nbytes)     # the backups count as the keys do
        except StoreError as exc:
            self.control.error(f"cannot back the keys up: {exc}", req)
            return
        if not self.memory.slow_to_allocate(nbytes):
            self.control.ok(req)
            return
        self.commitments.pend(msg["job"], nbytes)
        self.readier.ready_in_background(msg["job"], params, private, nbytes, 0,
                                         lambda made, slots: self._readied(msg, keys, made, slots, nbytes),
                                         at_once=bool(msg.get("at_once")))

    def _readied(self, msg: wire.Message, keys: list, made: tuple, slots: list | None, pended: int = 0) -> None:
        try:
            self._keep_readied(msg, keys, made, slots)
        finally:
            self.commitments.unpend(msg["job"], pended)  # the store holds them now (``readied``), or nothing

    def _keep_readied(self, msg: wire.Message, keys: list, made: tuple, slots: list | None) -> None:
        req = msg.get("req")
        buffers, error = made
        if error is not None:
            self.control.error(f"cannot allocate memory for the replicas: {error}", req)
            return
        try:
            state = self.store.ensure_job(msg["job"], msg["secret"], msg["world_size"], msg["mode"],
                                          bool(msg.get("average", True)), msg.get("optimizer"), msg.get("hp") or {})
        except StoreError as exc:
            self.control.error(str(exc), req)
            return
        per_key, given = len(slots or ()) // len(keys), iter(slots or ())
        for spec, buf in zip(keys, buffers):
            self.store.ready_replica(state, spec, buf.array, buf, [next(given) for _ in range(per_key)])
        self.control.ok(req)

    def set_keys(self, msg: wire.Message) -> None:
        """REPLICA_SET: replicate these keys to ``replica`` (or stop: None) from now on."""
        state = self.store.jobs.get(msg["job"])
        for key in msg["keys"]:
            ks = state.keys.get(key) if state is not None else None
            if ks is not None:
                self.set_replica(ks, msg.get("replica"))
        self.control.ok(msg.get("req"))

    def set_replica(self, ks: KeyState, info: dict | None) -> None:
        """``ks`` is backed up by the aggregator ``info`` names from now on (None: by none)."""
        if ks.mode != "server":
            return
        ks.replica = dict(info) if info else None
        ks.replicated = ks.replica_sent = -1
        if ks.replica is None:
            self.published(ks)       # pulls that waited for the old replica
        elif ks.initialized and (ks.arrival is None or not ks.arrival.copy_missing):
            self.replicate_state(ks)

    # --- the owner's side ---------------------------------------------------------------
    def replicate_state(self, ks: KeyState) -> None:
        """Send the whole server-side state of ``ks`` to its replica (REPLICATE ``state``)."""
        ks.replica_sent = ks.completed
        self._send_replica(ks, ks.completed, "state", *self.snapshot(ks))

    def snapshot(self, ks: KeyState) -> tuple[list, list]:
        """REPLICATE ``state`` items and arrays of ``ks``: its whole state, copied now (the
        next step may change the live arrays before they are sent)."""
        state = self.store.jobs[ks.job]
        meta, arrays = self.store.export_key(ks)
        meta.update(spec=ks.spec.to_wire(), mode=ks.mode, average=ks.average, world_size=state.world_size,
                    optimizer=state.optimizer if ks.optimizer is None else ks.optimizer.name)
        return [wire.KeyCopy(ks.spec.key, meta, len(arrays)).to_wire()], [np.array(a) for a in arrays]

    def step(self, ks: KeyState, grad: np.ndarray) -> tuple[list, np.ndarray | None]:
        """Right after the optimizer step of iteration ``completed + 1``: send the replica that
        step's averaged gradient (it applies the same deterministic update). One that has not
        been sent the previous iteration gets nothing: it is sent the whole state. Returns the
        step's REPLICATE items, and the copy of ``grad`` sent (None: none was), for the key's
        followers (``precopy``) to be sent the same."""
        iteration = ks.completed + 1
        items = [wire.StepItem(ks.spec.key, iteration, 0, dict(ks.optimizer.hp)).to_wire()]
        copy = None
        if ks.replica is not None and ks.replica_sent == ks.completed:
            ks.replica_sent = iteration
            copy = np.array(grad)
            self._send_replica(ks, iteration, "step", items, [copy])
        return items, copy

    def _send_replica(self, ks: KeyState, iteration: int, kind: str, items: list, arrays: list) -> None:
        req = self.send(ks.replica, ks, kind, items, arrays)
        if req is not None:
            self.waits[req] = ReplicaWait(ks, iteration, ks.replica.get("agg", ""))

    def send(self, info: dict, ks: KeyState, kind: str, items: list, arrays: list, **fields: Any) -> int | None:
        """One REPLICATE of ``kind`` about ``ks`` to the aggregator ``info`` names: its
        request id, None when it could not be sent."""
        state = self.store.jobs[ks.job]
        req = self.peers.next_req()
        try:
            self.peers.connect(info).send(wire.header(wire.REPLICATE, req=req, kind=kind, job=ks.job,
                                                      secret=state.secret, peer=self.peers.ticket(state), items=items,
                                                      **fields), arrays)
        except Exception as exc:  # an unreachable replica must not stop the data path
            log.error("cannot replicate %s of job %s to %s: %s", ks.spec.key, ks.job, info.get("agg"), exc)
            return None
        return req

    def acked(self, msg: wire.Message) -> None:
        """A replica's answer to a REPLICATE of ``waits``."""
        ks, iteration, replica = self.waits.pop(msg["req"])
        if ks.replica is None or ks.replica.get("agg", "") != replica:
            return          # an answer from a replica this key no longer uses
        if msg.op == wire.ERROR and msg.get("no_room"):
            # it will not hold the backup (room, --max-job-bytes, --max-tenant-bytes): sending the
            # state again would be refused again; the key goes on without a replica
            log.error("replica %s of %s of job %s: %s; the key has no replica from now on", replica, ks.spec.key,
                      ks.job, msg["message"])
            ks.replica = None
            ks.replicated = ks.replica_sent = -1
        elif msg.op == wire.ERROR:
            log.warning("replica of %s of job %s: %s; sending the whole state", ks.spec.key, ks.job, msg["message"])
            self.replicate_state(ks)
            return
        if iteration > ks.replicated:
            ks.replicated = iteration
        for waiter in ks.init_waiters:
            waiter[2].discard(id(ks))
            if not waiter[2]:
                waiter[0].send(wire.header(wire.OK, req=waiter[1]))
        ks.init_waiters = []
        self.published(ks)

    # --- the replica's side -------------------------------------------------------------
    def receive(self, reply: Sender, msg: wire.Message) -> None:
        """REPLICATE to a backup: install a whole state, or apply one step of the owner (to a
        key migrating here whose state the old owner sends ahead: ``MovesIn.precopy``)."""
        if msg.get("kind") != "state":
            state = self.store.job(msg["job"], msg["secret"])
            self.apply_steps(reply, msg, state.replicas.get)
            return
        for key, meta, views in wire.key_copies(msg):
            try:
                spec = KeySpec.from_wire(meta["spec"])
                state = self.store.ensure_job(msg["job"], msg["secret"], int(meta["world_size"]), meta["mode"],
                                              bool(meta.get("average", True)), meta.get("optimizer"),
                                              meta.get("hp") or {})
            except (KeyError, TypeError, ValueError) as exc:
                raise wire.ProtocolError(f"replicate: bad state of {key!r}: {exc}") from None
            arrays = [np.frombuffer(view, dtype=spec.dtype) for view in views]
            if key not in state.replicas and key not in state.readied:
                # a new backup, with no memory made ready for it: committed as the key is
                try:
                    sizes = [(spec.numel, spec.dtype), *Store.private_sizes(
                        meta["mode"], meta.get("optimizer"), meta.get("hp"), [spec], accumulator=False)]
                except ValueError as exc:
                    raise wire.ProtocolError(f"replicate: bad state of {key!r}: {exc}") from None
                self.commitments.check_room(msg["job"], sum(n * np.dtype(d).itemsize for n, d in sizes))
            with self.commitments.prechecked(msg["job"]), timed(self.stats, "replica_install"):
                self.store.install_replica(state, spec, meta["mode"], bool(meta.get("average", True)),
                                           meta.get("optimizer"), meta.get("hp") or {}, meta, arrays)
        reply.send(wire.header(wire.OK, req=msg.get("req")))

    def apply_steps(self, reply: Sender, msg: wire.Message, find: Callable[[str], KeyState | None]) -> None:
        """REPLICATE of kind ``step``: the owner's steps, each to the key ``find(key)`` gives
        (None: none here follows it), checked first, acknowledged, then applied."""
        steps = []
        for item in msg.items(wire.StepItem):
            rks = find(item.key)
            grad = msg.whole(item.payload, rks.spec.dtype) if rks is not None else None
            if rks is None or not self.store.replica_accepts(rks, item.iteration, grad):
                raise StoreError(f"replica of {item.key!r} misses the steps before {item.iteration}")
            steps.append((rks, item, grad))
        # acknowledged on receipt, applied right after: nothing else runs in between here,
        # so a promotion always finds the step applied
        reply.send(wire.header(wire.OK, req=msg.get("req")))
        for rks, item, grad in steps:
            self.store.replica_step(rks, item.iteration, grad, item.hp)
