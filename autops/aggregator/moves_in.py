"""The new owner's side of live migration (thesis §4.3.2, Fig. 4.5): taking keys over from another aggregator.

``MovesIn`` owns it for one aggregator. MIGRATE_PREPARE (``prepare``) creates the keys in
their incoming state (``moves_state.Arrival``: the data path holds their pushes and parks
their pulls), committed as declared keys are, in buffers the job's keys left here when they
moved away (``spare.SpareBuffers``) or in memory a helper thread makes ready first. A
server-mode key's state may come ahead of the switch (``precopy``: REPLICATE with
``incoming``), followed by the old owner's steps. The hand-over (``copy``: TENSOR_COPY)
takes each key over -- from the copy, or from the state that came ahead -- and applies the
pushes held meanwhile; once a key's first iteration here is complete (``served``) the batch
is reported to pMaster (``report``: WORKER_DONE, with when its first push and hand-over came).
MIGRATE_DROP (``drop``) forgets keys that moved on, and what a move that failed left here;
their buffers become the job's spares.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from ..transport import Sender
from ..transport.zmq import heap_kept
from ..wire import protocol as wire
from ..wire.partition import KeySpec
from .batch_reports import BatchReports
from .commitments import Commitments
from .links import Control
from .moves_state import Arrival
from .replicas import Replication
from .reserve import MemoryReadier, timed
from .spare import SpareBuffers
from .store import JobState, KeyState, Store, StoreError

__all__ = ["MovesIn"]

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


class MovesIn:
    """The keys other aggregators hand over to this one.

    ``store``: the keys; ``stats``: the aggregator's figures (``migrated_in``,
    ``taken_over_ahead``, ``state_install_*``, ``state_takeover_*``, ``errors``); ``readier``:
    memory made ready for arriving keys; ``control``: answers and reports to pMaster;
    ``commitments``: the room and quota checks the keys pass; ``spare``: buffers of the
    job's keys that moved away, for keys moving back; ``replication``: the state sent to a
    key's replica once it is served here, and the old owner's steps applied to a key whose
    state came ahead; ``published(key)``: answer the pulls parked on a key taken over;
    ``refuse_waiters(key, why)``: answer the pulls parked on a key that moved on with an error."""

    def __init__(self, store: Store, stats: dict, readier: MemoryReadier, control: Control,
                 commitments: Commitments, spare: SpareBuffers, replication: Replication,
                 published: Callable[[KeyState], None], refuse_waiters: Callable[[KeyState, str], None]) -> None:
        self.store = store
        self.stats = stats
        self.readier = readier
        self.memory = readier.memory
        self.control = control
        self.commitments = commitments
        self.spare = spare
        self.replication = replication
        self.published = published
        self.refuse_waiters = refuse_waiters
        # WORKER_DONE, once per batch, with the longest any key's first iteration waited here,
        # whole, for its hand-over
        self.worker_reports = BatchReports()
        # the switch as seen here, per batch: when the first push of its keys and the
        # hand-over came (time.monotonic), reported with WORKER_DONE (``_switch_times``)
        self.switch_seen: dict[int, dict] = {}                         # mid -> {"job", "first_push", "handover"}

    # --- pMaster's commands -------------------------------------------------------------
    def prepare(self, msg: wire.Message) -> None:
        """MIGRATE_PREPARE: create the keys in the incoming state (pushes held, pulls parked).

        Buffers the job's keys left here when they moved away are used again; large new ones
        are created and populated by a helper thread first, so neither the jobs this
        aggregator already serves nor the migrating job wait for page faults. The keys are
        committed as a declaration is (``Commitments.check_room``: room, ``--max-job-bytes``,
        ``--max-tenant-bytes``); a move that does not fit is refused before anything is
        allocated (pMaster fails the batch with that error; the old owner keeps the keys)."""
        try:
            keys = [KeySpec.from_wire(k) for k in msg["keys"]]
            sizes = Store.buffer_sizes(msg["mode"], keys)
            # server mode: the gradient accumulators and optimizer state, which the state copy
            # ahead of the switch fills; made ready here too, or that copy pays their faults
            private = Store.private_sizes(msg["mode"], msg.get("optimizer"), msg.get("hp"), keys)
            nbytes = sum(numel * np.dtype(dtype).itemsize for numel, dtype in sizes + private)
            self.commitments.learn_tenant(msg["job"], msg.get("tenant"))
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            self.control.error(str(exc), msg.get("req"))
            return
        reused = self.spare.take(msg["job"], sizes)
        # the spares are committed to the job already: only the rest is new
        need = nbytes - sum(buf.array.nbytes for buf in reused or ())
        try:
            self.commitments.check_room(msg["job"], need)
        except StoreError as exc:
            self.spare.keep(msg["job"], reused or ())
            log.warning("refused keys moving here: %s", exc)
            self.control.error(f"cannot take the keys: {exc}", msg.get("req"))
            return
        self.commitments.pend(msg["job"], need)
        if reused is not None:
            self._finish_prepare(msg, keys, sizes, (reused, None), pended=need)
            return
        if not self.memory.slow_to_allocate(nbytes):
            self._finish_prepare(msg, keys, sizes, pended=need)
            return

        # the workers' pushes of the new keys arrive in received-message buffers: warm the
        # heap they come from, or the switch iteration pays its page faults (one worker's
        # pushes: the keys' bytes once)
        warm = min(sum(spec.nbytes for spec in keys), heap_kept() // 2)
        self.readier.ready_in_background(msg["job"], sizes, private, nbytes, warm,
                                         lambda made, arrays: self._finish_prepare(msg, keys, sizes, made, arrays,
                                                                                   need))

    def _finish_prepare(self, msg: wire.Message, keys: list, sizes: list, made: tuple | None = None,
                        private: list | None = None, pended: int = 0) -> None:
        """Create the incoming keys in ``made`` -- ``(buffers, allocation error)`` from a
        helper thread, with ``private``: their server-mode arrays (``Store.private_sizes``) --
        or in memory allocated now; ``pended``: the bytes committed for them meanwhile."""
        try:
            self._prepare_keys(msg, keys, sizes, made, private)
        finally:
            self.commitments.unpend(msg["job"], pended)      # the store holds them now, or nothing was made

    def _prepare_keys(self, msg: wire.Message, keys: list, sizes: list, made: tuple | None,
                      private: list | None) -> None:
        """``_finish_prepare``'s work; answers pMaster."""
        req = msg.get("req")
        try:
            state = self.store.jobs.get(msg["job"])
            for spec in keys:
                if state is not None and spec.key in state.keys:
                    raise StoreError(f"key {spec.key!r} of job {msg['job']!r} is already here")
            buffers, error = made or self.readier.allocate(sizes, msg["job"])
            if error is not None:
                raise StoreError(f"cannot allocate memory for the incoming keys: {error}")
            with self.commitments.prechecked(msg["job"]):    # committed in ``prepare``
                self.store.assign(msg["job"], msg["secret"], msg["world_size"], msg["mode"], keys,
                                  average=bool(msg.get("average", True)), optimizer=msg.get("optimizer"),
                                  hp=msg.get("hp") or {}, buffers=[(buf.array, buf) for buf in buffers],
                                  private=private)
            state = self.store.jobs[msg["job"]]
            replicas = msg.get("replicas") or {}
            for spec in keys:
                ks = state.keys[spec.key]
                ks.arrival = Arrival(msg["mid"])
                if ks.mode == "server" and replicas.get(spec.key):
                    ks.replica = dict(replicas[spec.key])
            self.worker_reports.expect(msg["mid"], msg["job"], len(keys))
            # the new buffers are mapped and populated by now; agents can map them early
            segments = self.memory.handles_of(buffers)
            self.control.ok(req, segments=segments)
        except (StoreError, ValueError, TypeError) as exc:
            self.control.error(str(exc), req)

    def drop(self, msg: wire.Message) -> None:
        """MIGRATE_DROP: forget keys that moved away, or -- a new replica of a move that failed --
        what was readied for them and the backups the state sent ahead made (``backups``): all
        of it goes to the job's spares."""
        self.spare.keep(msg["job"], self.store.take_readied(msg["job"], list(msg["keys"])))
        if msg.get("backups") is True:
            self.spare.keep(msg["job"], [rks.param_ref for rks in self.store.drop_replicas(msg["job"],
                                                                                         list(msg["keys"]))])
        for ks in self.store.drop_keys(msg["job"], list(msg["keys"])):
            self.spare.keep(ks.job, ks.buffer_refs if ks.mode == "sum" else [ks.param_ref])
            self.refuse_waiters(ks, f"key {ks.spec.key!r} moved to another aggregator")

    def release(self, job: str) -> None:
        """The job left this aggregator: its spares are freed with it, nothing of it is reported."""
        self.spare.release(job)
        self.worker_reports.forget(job)
        for mid in [m for m, seen in self.switch_seen.items() if seen["job"] == job]:
            del self.switch_seen[mid]

    # --- from the old owner -------------------------------------------------------------
    def precopy(self, reply: Sender, msg: wire.Message) -> None:
        """REPLICATE with ``incoming``: the old owner's state of server-mode keys migrating
        here, sent ahead of the switch (``Store.precopy``), or one of its steps after it."""
        if msg.get("kind") != "state":
            state = self.store.job(msg["job"], msg["secret"])
            self.replication.apply_steps(reply, msg, lambda key: self._following(state, key))
            return
        for key, meta, views in wire.key_copies(msg):
            ks = self.store.key(self.store.job(msg["job"], msg["secret"]), key)
            with timed(self.stats, "state_install"):
                self.store.precopy(ks, meta, [np.frombuffer(view, dtype=ks.spec.dtype) for view in views])
        reply.send(wire.header(wire.OK, req=msg.get("req")))

    @staticmethod
    def _following(state: JobState, key: str) -> KeyState | None:
        """The key migrating here whose state came ahead and follows the old owner's steps."""
        ks = state.keys.get(key)
        arrival = ks.arrival if ks is not None else None
        return ks if arrival is not None and arrival.copy_missing and arrival.precopied else None

    def copy(self, reply: Sender, msg: wire.Message) -> None:
        """TENSOR_COPY: take the keys over -- from the copy, or from the state that came ahead
        (``precopy``, or this aggregator's replica of the key) -- apply the held pushes, answer
        parked pulls. The answer lists the keys ``refused`` (their state did not arrive
        ahead after all: the old owner sends it). A copy without keys names the workers'
        buffers to map ahead."""
        state = self.store.job(msg["job"], msg["secret"])
        self.memory.premap(msg.get("segments"))
        if msg.get("items"):          # a hand-over (a copy without keys only names buffers to map)
            self.switch_seen.setdefault(msg["mid"], {"job": state.job}).setdefault("handover", time.monotonic())
        installed, refused = [], {}
        for key, meta, views in wire.key_copies(msg):
            self.memory.premap(meta.get("segments"))     # the workers' buffers, before their pushes come
            try:
                ks = self.store.key(state, key)
                self._take_over(state, ks, meta, [np.frombuffer(view, dtype=ks.spec.dtype) for view in views],
                                msg["mid"])
            except StoreError as exc:
                refused[key] = str(exc)
                continue
            installed.append(ks)
        self.stats["migrated_in"] += len(installed)
        reply.send(wire.header(wire.OK, req=msg.get("req"), **({"refused": refused} if refused else {})))
        for ks in installed:
            self.published(ks)

    def _take_over(self, state: JobState, ks: KeyState, meta: dict, arrays: list, mid: int) -> None:
        """One key of a TENSOR_COPY; StoreError (the key unchanged) when it cannot be taken."""
        t0 = time.thread_time()
        first = meta.get("completed", 0) + 1 if isinstance(meta.get("completed"), int) else 1
        arrival = self.store.waiting_copy(ks)
        # how long its first iteration here, whole, waited for this hand-over (0: it came first)
        waited = time.monotonic() - arrival.whole_at if arrival.whole_at is not None else 0.0
        arrival.whole_at = None
        hp = arrival.hp
        if meta.get("ahead"):
            with timed(self.stats, "state_takeover"):
                self.store.take_ahead(ks, meta.get("completed"), state.replicas.get(ks.spec.key))
            self.stats["taken_over_ahead"] += 1
            if hp:
                self.store.set_hp(ks, hp)
        else:
            if hp:
                # hyper-parameters the workers sent with held pushes apply after the copy's own
                meta = {**meta, "hp": {**(meta.get("hp") or {}), **hp}}
            self.store.take_copy(ks, meta, arrays)
        arrival.hp = None
        state.replicas.pop(ks.spec.key, None)       # owned here now: a replica of it here is of no use
        replica_current = ks.replica is not None and ks.replica.get("agg") in (meta.get("current") or ())
        if replica_current:
            ks.replica_sent = ks.replicated = ks.completed      # it was sent this state already
        _, problems = self.store.apply_held(ks)
        ks.cpu += time.thread_time() - t0
        arrival.mid, arrival.first, arrival.waited = mid, first, waited
        for problem in problems:
            self.stats["errors"] += 1
            log.error("held push of migrated key %s dropped: %s", ks.spec.key, problem)
        if ks.replica is not None and not replica_current:
            self.replication.replicate_state(ks)

    # --- the switch -----------------------------------------------------------------------
    def pushed(self, mid: int, job: str, now: float) -> None:
        """A push of a key of migration ``mid`` came (``time.monotonic`` ``now``): the first
        one is the batch's ``first_push``."""
        seen = self.switch_seen.get(mid)
        if seen is None:
            self.switch_seen[mid] = seen = {"job": job}
        if "first_push" not in seen:
            seen["first_push"] = now

    def served(self, ks: KeyState) -> None:
        """The first iteration of ``ks`` here is complete: the move is over, reported with its batch."""
        arrival, ks.arrival = ks.arrival, None
        self.worker_reports.add(arrival.mid, ks.job, [ks.spec.key], 1e3 * arrival.waited)

    def report(self) -> None:
        """WORKER_DONE for the batches whose keys were all served here (``BatchReports.due``)."""
        for report in self.worker_reports.due():
            self.control.send(wire.encode(wire.WORKER_DONE, mid=report.mid, job=report.job, keys=report.keys,
                                          agg=self.control.agg_id(), wait_ms=round(report.wait_ms, 3),
                                          **self._switch_times(report.mid)))

    def _switch_times(self, mid: int) -> dict:
        """The batch's switch as seen here, for its (first) WORKER_DONE: when the first push of
        its keys came (``first_push_at``), its hand-over (``handover_at``) and now, as its keys'
        first iteration is complete (``done_at``); ``time.monotonic`` seconds."""
        seen = self.switch_seen.pop(mid, None) or {}
        return {"done_at": round(time.monotonic(), 6),
                **{f"{k}_at": round(v, 6) for k, v in seen.items() if k != "job"}}
