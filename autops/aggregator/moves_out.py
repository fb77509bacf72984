"""The old owner's side of live migration (thesis §4.3.2, Fig. 4.5): handing keys over to another aggregator.

``MovesOut`` owns it for one aggregator. MIGRATE_INIT (``init``) gives each key its
hand-over: a key without followers gets its cutover at once (its open iteration plus the
lead); a server-mode key with followers -- its new owner, a new replica -- first sends them
its state (``precopy.Precopies`` paces the sends) and every step after it
(``followers_step``), and gets its cutover once they all hold it (MIGRATE_CUTOVER to pMaster).
The data path serves the key up to its cutover, naming the new owner in those pull replies,
and redirects anything later (``moves_state.Move``); once the cutover iteration is complete
it queues the key's hand-over here (``hand_over``). The hand-overs due go out once per turn
of the loop, one TENSOR_COPY per migration (``send_due``); the new owner's answers
(``copy_answered``) become TENSOR_COPY_DONE reports to pMaster (``report``). MIGRATE_ABORT
(``abort``): the new owner was lost, the keys stay here.

The per-key state stays in ``KeyState`` (``handover``, ``move``, ``followers``); what this
class owns is the followers' sends and the answers it waits for, the hand-overs due and the
reports.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

import numpy as np

from ..transport import Transport
from ..wire import protocol as wire
from .batch_reports import BatchReports
from .links import Control, Peers
from .moves_state import Handover
from .precopy import Follower, Precopies
from .replicas import Replication
from .reserve import timed
from .store import KeyState, Store, StoreError

__all__ = ["MovesOut"]

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


class MovesOut:
    """The keys one aggregator hands over to others.

    ``store``: the keys; ``stats``: the aggregator's figures (``migrated_out``,
    ``handover_*``, ``states_sent_ahead``, ``state_snapshot_*``); ``control``: answers and
    reports to pMaster; ``peers``: channels to the new owners and followers, and request
    ids; ``transport``: the workers' buffers a new owner maps ahead (``handles_for``);
    ``replication``: a key's state as REPLICATE sends it, and the sends to followers."""

    def __init__(self, store: Store, stats: dict, control: Control, peers: Peers, transport: Transport,
                 replication: Replication) -> None:
        self.store = store
        self.stats = stats
        self.control = control
        self.peers = peers
        self.transport = transport
        self.replication = replication
        self.precopies = Precopies()
        # copies sent to new owners, waiting for their answer (those that sent no state
        # because it went ahead: ``ahead_copies``); states and steps sent to followers, likewise
        self.copy_waits: dict[int, tuple[int, str, list[str]]] = {}   # req -> (mid, job, keys)
        self.ahead_copies: dict[int, set[str]] = {}                    # req -> keys sent without state
        self.follow_waits: dict[int, tuple[KeyState, Follower, str]] = {}   # req -> (key, follower, kind)
        # hand-overs due, sent once per turn of the loop for all keys that came due in it (one
        # message, not one per key, on the data path's busiest moment)
        self.due_copies: dict[int, list[KeyState]] = {}                # mid -> keys
        self.copy_reports = BatchReports()      # TENSOR_COPY_DONE, once per batch

    # --- pMaster's commands -------------------------------------------------------------
    def init(self, msg: wire.Message) -> None:
        """MIGRATE_INIT: hand the keys over after their open iteration plus ``lead`` (the
        cutover); the new owner learns at once which workers' buffers to map. A key with
        ``followers`` (server mode) first sends them its state (``precopy``); its cutover is
        decided once they hold it (``MIGRATE_CUTOVER``)."""
        req = msg.get("req")
        try:
            state = self.store.jobs.get(msg["job"])
            if state is None:
                raise StoreError(f"job {msg['job']!r} is not served here")
            lead = msg.get("lead") or 0
            if type(lead) is not int or lead < 0:
                raise StoreError(f"bad lead {lead!r}")
            followers = msg.get("followers") or {}
            found = []
            for key in msg["keys"]:
                ks = state.keys.get(key)
                if ks is None:
                    raise StoreError(f"key {key!r} of job {msg['job']!r} is not here")
                if ks.move is not None or ks.arrival is not None and ks.arrival.copy_missing \
                        or ks.handover is not None:
                    raise StoreError(f"key {key!r} of job {msg['job']!r} is already migrating")
                infos = followers.get(key) or []
                if not isinstance(infos, list) or not all(isinstance(i, dict) and i.get("agg") for i in infos) \
                        or (infos and ks.mode != "server"):
                    raise StoreError(f"bad followers of key {key!r}: {infos!r}")
                found.append((ks, infos))
        except (StoreError, ValueError, TypeError, AttributeError) as exc:
            self.control.error(str(exc), req)
            return
        cutovers = {}
        self.copy_reports.expect(msg["mid"], msg["job"], len(found))
        for ks, infos in found:
            ks.handover = Handover(msg["mid"], msg["to"], msg["info"], lead)
            if not infos:
                cutovers[ks.spec.key] = self._start_handover(ks)
                continue
            ks.followers = {i["agg"]: Follower(dict(i), incoming=i["agg"] == msg["to"]) for i in infos}
            self.precopies.start(ks, list(ks.followers.values()), self._state_bytes(ks))
        self.control.ok(req, cutovers=cutovers)
        segments = self.transport.handles_for(msg["info"], state.job)
        if segments:
            # a copy without keys: the workers' buffers, mapped there before their first push
            self.peers.connect(msg["info"]).send(wire.header(wire.TENSOR_COPY, mid=msg["mid"], job=state.job,
                                                             secret=state.secret, items=[], segments=segments,
                                                             peer=self.peers.ticket(state)))
        self._pump()

    def abort(self, msg: wire.Message) -> None:
        """MIGRATE_ABORT: the new owner of a migration was lost: keep serving the keys (their
        state here is whole up to the cutover; later pushes were redirected and are resent)
        and stop sending their state ahead."""
        state = self.store.jobs.get(msg["job"])
        for key in msg["keys"]:
            ks = state.keys.get(key) if state is not None else None
            if ks is not None:
                ks.followers.clear()
                ks.handover = None
            if ks is not None and ks.move is not None:
                ks.move = None
                log.info("migration of %s of job %s aborted: the new owner was lost", key, msg["job"])
        self.precopies.forget(msg["job"], set(msg["keys"]))
        self.control.ok(msg.get("req"))

    def release(self, job: str) -> None:
        """The job left this aggregator: nothing of it is sent ahead or reported any more."""
        self.precopies.forget(job)
        self.copy_reports.forget(job)

    # --- the cutover ----------------------------------------------------------------------
    @staticmethod
    def _start_handover(ks: KeyState) -> int:
        """The key's cutover: its open iteration plus the hand-over's lead; returns it."""
        ks.move, ks.handover = ks.handover.move(ks.open_iteration), None
        return ks.move.cutover

    def _followed(self, ks: KeyState) -> None:
        """Every follower of ``ks`` holds its state (or gave up): decide its cutover, tell pMaster."""
        if ks.handover is None:
            return
        mid = ks.handover.mid
        cutover = self._start_handover(ks)
        self.control.send(wire.encode(wire.MIGRATE_CUTOVER, mid=mid, job=ks.job, cutovers={ks.spec.key: cutover},
                                      agg=self.control.agg_id()))

    # --- the followers (server-mode state sent ahead) ---------------------------------------
    @staticmethod
    def _state_bytes(ks: KeyState) -> int:
        arrays = 1 + len(ks.optimizer.state_arrays()) if ks.optimizer is not None else 1
        return arrays * ks.spec.numel * np.dtype(ks.spec.dtype).itemsize

    def _pump(self) -> None:
        """Send the followers' states whose turn it is (``Precopies`` bounds the bytes in flight)."""
        for ks, follower in self.precopies.due():
            state = self.store.jobs.get(ks.job)
            if ks.followers.get(follower.agg) is not follower or state is None or state.keys.get(ks.spec.key) is not ks:
                self.precopies.holds(ks.job, ks.spec.key, follower.agg)     # the key moved on: nothing to wait for
                continue
            follower.sent = ks.completed
            with timed(self.stats, "state_snapshot"):
                snapshot = self.replication.snapshot(ks)
            self._send_follower(ks, follower, "state", *snapshot)

    def followers_step(self, ks: KeyState, grad: np.ndarray, items: list, copy: np.ndarray | None) -> None:
        """Right after the optimizer step of iteration ``completed + 1`` of ``ks``, a key with
        followers: send them that step's averaged gradient (``items``: the step's REPLICATE
        items; ``copy``: the copy of ``grad`` sent to the replica, None: none was). One that has
        not been sent the previous iteration gets nothing: it is sent the whole state."""
        iteration = ks.completed + 1
        for follower in [f for f in ks.followers.values() if f.sent == ks.completed]:
            follower.sent = iteration
            copy = np.array(grad) if copy is None else copy
            self._send_follower(ks, follower, "step", items, [copy])

    def refollow(self, ks: KeyState) -> None:
        """The state of ``ks`` changed outside a step (INIT): its followers get it again."""
        for follower in ks.followers.values():
            follower.sent = -1
            self.precopies.requeue(ks, follower, self._state_bytes(ks))
        self._pump()

    def _send_follower(self, ks: KeyState, follower: Follower, kind: str, items: list, arrays: list) -> None:
        req = self.replication.send(follower.info, ks, kind, items, arrays, incoming=follower.incoming)
        if req is None:
            self._drop_follower(ks, follower, "it cannot be reached")
        else:
            self.follow_waits[req] = (ks, follower, kind)

    def follower_acked(self, msg: wire.Message) -> None:
        """A follower's answer to a REPLICATE of ``follow_waits``."""
        ks, follower, kind = self.follow_waits.pop(msg["req"])
        if ks.followers.get(follower.agg) is not follower:
            return              # an answer about a follower this key no longer has
        if msg.op == wire.ERROR:
            self._drop_follower(ks, follower, msg["message"])
        elif kind == "state":
            self.stats["states_sent_ahead"] += 1
            if self.precopies.holds(ks.job, ks.spec.key, follower.agg):
                self._followed(ks)
            self._pump()

    def _drop_follower(self, ks: KeyState, follower: Follower, why: str) -> None:
        """Stop sending ``ks``'s steps to ``follower`` (its hand-over then carries the state)."""
        log.warning("%s of job %s: %s no longer follows it: %s", ks.spec.key, ks.job, follower.agg, why)
        ks.followers.pop(follower.agg, None)
        if self.precopies.holds(ks.job, ks.spec.key, follower.agg):
            self._followed(ks)
        self._pump()

    # --- the hand-over ----------------------------------------------------------------------
    def hand_over(self, ks: KeyState) -> None:
        """The cutover iteration of ``ks`` is complete: its hand-over goes out at the end of
        this turn of the loop (``send_due``), with the other keys of its migration due then."""
        mv = ks.move
        mv.sent = True
        self.due_copies.setdefault(mv.mid, []).append(ks)

    def send_due(self) -> None:
        """The hand-overs that came due in this turn of the loop: one TENSOR_COPY per migration."""
        due, self.due_copies = self.due_copies, {}
        for keys in due.values():
            with self._handover_cpu():
                self._send_copies(keys)
            self.stats["handover_messages"] += 1

    @contextlib.contextmanager
    def _handover_cpu(self) -> Iterator[None]:
        """Add this thread's CPU in the block to ``handover_cpu_s`` (the old owner's hand-overs)."""
        started = time.thread_time()
        try:
            yield
        finally:
            self.stats["handover_cpu_s"] = round(self.stats["handover_cpu_s"] + time.thread_time() - started, 4)

    def _send_copies(self, keys: list[KeyState], full: bool = False) -> None:
        """TENSOR_COPY (Fig. 4.5 step 4) of keys of one migration whose cutover iteration is
        complete: each key's counter and, in server mode, its master copy, optimizer state and
        step -- unless the new owner holds them already (a follower, or the key's replica) and
        not ``full``. ``current`` names the aggregators that were sent the cutover iteration's
        state: the new owner keeps such a replica without sending it the state again."""
        mv = keys[0].move
        state = self.store.jobs[keys[0].job]
        items, arrays, ahead = [], [], set()
        # the workers' buffers this aggregator maps: the new owner maps them before the
        # workers' first push reaches it, not on that push's path
        segments = self.transport.handles_for(mv.info, state.job)
        for ks in keys:
            current = [f.agg for f in ks.followers.values() if f.sent == ks.completed]
            if ks.replica is not None and ks.replica_sent == ks.completed:
                current.append(ks.replica.get("agg"))
            ks.followers.clear()       # no step follows the cutover here
            if ks.mode == "server" and mv.to in current and not full:
                meta, key_arrays = {"completed": ks.completed, "ahead": True}, []
                ahead.add(ks.spec.key)
            else:
                meta, key_arrays = self.store.export_key(ks)
            meta.update(current=current, segments=segments)
            items.append(wire.KeyCopy(ks.spec.key, meta, len(key_arrays)).to_wire())
            arrays.extend(key_arrays)
        req = self.peers.next_req()
        self.copy_waits[req] = (mv.mid, state.job, [ks.spec.key for ks in keys])
        if ahead:
            self.ahead_copies[req] = ahead
        self.peers.connect(mv.info).send(wire.header(wire.TENSOR_COPY, req=req, mid=mv.mid, job=state.job,
                                                     secret=state.secret, items=items,
                                                     peer=self.peers.ticket(state)), arrays)

    def copy_answered(self, msg: wire.Message) -> None:
        """The new owner's answer to a TENSOR_COPY of ``copy_waits``."""
        waited = self.copy_waits.pop(msg["req"])
        with self._handover_cpu():
            self._copy_answered(msg, waited)

    def _copy_answered(self, msg: wire.Message, waited: tuple) -> None:
        """Report the keys the new owner took, send again the state it lacked, give up on the
        keys it refused."""
        mid, job, keys = waited
        ahead = self.ahead_copies.pop(msg.get("req"), set())
        if msg.op == wire.ERROR:
            refused = {key: msg["message"] for key in keys}
        else:
            refused = {k: str(v) for k, v in (msg.get("refused") or {}).items() if k in keys}
        # keys the new owner did not hold the state of, although they went ahead: send it
        again = self._copy_again(job, [k for k in refused if k in ahead], refused)
        failed = {k: why for k, why in refused.items() if k not in again}
        done = [k for k in keys if k not in refused]
        if done:
            self.stats["migrated_out"] += len(done)
            self.copy_reports.add(mid, job, done)
        if failed:
            log.error("copy of %s of job %s was refused: %s", sorted(failed), job, next(iter(failed.values())))
            self.copy_reports.give_up(mid, job, len(failed))
            self.control.send(wire.encode(wire.TENSOR_COPY_DONE, mid=mid, job=job, keys=sorted(failed),
                                          agg=self.control.agg_id(), error=next(iter(failed.values()))))

    def _copy_again(self, job: str, keys: list[str], why: dict[str, str]) -> set[str]:
        """The new owner did not hold the state a hand-over relied on: send it; returns the
        keys sent again."""
        state = self.store.jobs.get(job)
        again = [ks for ks in (state.keys.get(k) for k in keys) if ks is not None and ks.move is not None] \
            if state is not None else []
        if again:
            log.warning("%d keys of job %s, e.g. %s: %s; sending the whole state", len(again), job,
                        again[0].spec.key, why[again[0].spec.key])
            self._send_copies(again, full=True)
        return {ks.spec.key for ks in again}

    def report(self) -> None:
        """TENSOR_COPY_DONE for the batches whose hand-overs are done (``BatchReports.due``)."""
        for report in self.copy_reports.due():
            self.control.send(wire.encode(wire.TENSOR_COPY_DONE, mid=report.mid, job=report.job, keys=report.keys,
                                          agg=self.control.agg_id()))
