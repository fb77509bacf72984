"""Taking over the keys of a lost aggregator (failures, docs/autops.md).

``Recovery`` owns an aggregator's side of it: pMaster's FAILOVER gives it a lost aggregator's
keys -- ``promote`` keys are served from this aggregator's replica of them, the others (sum
mode) are recovered from the workers: each worker's RECOVER says the last iteration it pulled
of each key (and the value it pulled then, where it kept it), and its replayed pushes follow
(``Store.start_recovery``, ``Store.recover_report``). It owns no state of its own: a key's
recovery state stays in ``KeyState`` (``recovering``, ``recovered``), which the store's
push and publish paths read.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from ..transport import Sender
from ..wire import protocol as wire
from ..wire.partition import KeySpec
from .commitments import Commitments
from .links import Control
from .store import JobState, KeyState, Store, StoreError

__all__ = ["Recovery"]

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


class Recovery:
    """One aggregator's take-overs of lost aggregators' keys.

    ``store``: the keys; ``stats``: the aggregator's figures (a replayed push dropped counts
    in ``errors``); ``control``: answers to pMaster; ``commitments``: the room and quota
    checks a take-over passes; ``set_replica(key, info)``: who backs a key taken over up
    (``Replication.set_replica``); ``forget_waiters(key)``: drop the pulls parked on a key
    replaced here, unanswered (their workers resend them); ``published(key)``: answer the
    pulls parked on a key that became readable."""

    def __init__(self, store: Store, stats: dict, control: Control, commitments: Commitments,
                 set_replica: Callable[[KeyState, dict | None], None], forget_waiters: Callable[[KeyState], None],
                 published: Callable[[KeyState], None]) -> None:
        self.store = store
        self.stats = stats
        self.control = control
        self.commitments = commitments
        self.set_replica = set_replica
        self.forget_waiters = forget_waiters
        self.published = published

    def failover(self, msg: wire.Message) -> None:
        """FAILOVER: pMaster lost an aggregator and gives its keys here: ``promote`` keys are served
        from this aggregator's replica of them; the others (sum mode) are recovered from the
        workers (``RECOVER`` and replayed pushes). Anything this aggregator still held for such
        a key (an unfinished migration) is dropped: the workers resend all of it."""
        req = msg.get("req")
        try:
            state = self.store.ensure_job(msg["job"], msg["secret"], msg["world_size"], msg.get("mode") or "sum",
                                          bool(msg.get("average", True)), msg.get("optimizer"),
                                          msg.get("hp") or {})
            keys = [KeySpec.from_wire(k) for k in msg["keys"]]
            replicas = dict(msg.get("replicas") or {})
            self.commitments.learn_tenant(msg["job"], msg.get("tenant"))
            # committed as a declaration is: a take-over that does not fit fails the job with the reason
            self.commitments.check_room(msg["job"], self.failover_bytes(state, msg, keys))
            missing = []
            with self.commitments.prechecked(msg["job"]):
                self._take_keys(state, msg, keys, replicas, missing)
            if missing:
                raise StoreError(f"no replica of {missing[:4]} here")
            self.control.ok(req)
        except (StoreError, ValueError, TypeError) as exc:
            self.control.error(str(exc), req)

    @staticmethod
    def failover_bytes(state: JobState, msg: wire.Message, keys: list[KeySpec]) -> int:
        """The bytes a FAILOVER ``msg`` of ``keys`` commits here beyond what ``state`` holds of
        them (a promoted backup becomes the key: its gradient accumulator is new)."""
        mode = msg.get("mode") or "sum"
        need = 0
        for spec in keys:
            new = sum(n * np.dtype(d).itemsize for n, d in
                      Store.buffer_sizes(mode, [spec]) +
                      Store.private_sizes(mode, msg.get("optimizer"), msg.get("hp"), [spec]))
            old = state.keys.get(spec.key)
            held = Store.key_bytes(old) if old is not None else 0
            backup = state.replicas.get(spec.key) if msg.get("promote") else None
            held += Store.key_bytes(backup, accumulator=False) if backup is not None else 0
            need += max(0, new - held)
        return need

    def _take_keys(self, state: JobState, msg: wire.Message, keys: list[KeySpec], replicas: dict,
                   missing: list) -> None:
        """``failover``'s keys, taken over (``missing``: those with no backup here to promote)."""
        for spec in keys:
            old = state.keys.get(spec.key)
            if old is not None:
                self.forget_waiters(old)
            if msg.get("promote"):
                ks = self.store.promote(state, spec.key)
                if ks is None:
                    missing.append(spec.key)
                    continue
            else:
                state.keys.pop(spec.key, None)
                self.store.assign(msg["job"], msg["secret"], msg["world_size"], msg["mode"], [spec],
                                  average=bool(msg.get("average", True)), optimizer=msg.get("optimizer"),
                                  hp=msg.get("hp") or {})
                ks = state.keys[spec.key]
                self.store.start_recovery(ks)
            ks.move = ks.arrival = None
            self.set_replica(ks, replicas.get(spec.key))

    def recover(self, reply: Sender, msg: wire.Message) -> None:
        """A worker's RECOVER: the last iteration it pulled of each key taken over here, and
        the value it pulled then where it kept it."""
        state = self.store.job(msg["job"], msg["secret"])
        rank = msg["rank"]
        self.store._check_rank(state, rank)
        resumed = []
        for item in msg.items(wire.RecoverItem):
            ks = self.store.key(state, item.key)
            value = msg.array(item.value, ks.spec.dtype) if item.value is not None else None
            done, problems = self.store.recover_report(ks, rank, item.pulled, value)
            for problem in problems:
                self.stats["errors"] += 1
                log.error("replayed push of %s dropped: %s", item.key, problem)
            if done:
                resumed.append(ks)
        reply.send(wire.header(wire.OK, req=msg.get("req")))
        for ks in resumed:
            log.info("key %s of job %s recovered at iteration %d", ks.spec.key, ks.job, ks.completed)
            self.published(ks)
