"""Broadcasts within a job (BCAST_PUT, BCAST_GET): one rank puts a named value, the others get it.

``Broadcasts`` owns an aggregator's side of it: the values live in the store (``JobState.broadcasts``,
``Store.bcast_put``, ``Store.bcast_get``, which drops one once every other rank got it); what this
class owns is the gets that came before their put, parked until it comes.
"""
from __future__ import annotations

import numpy as np

from ..transport import Sender
from ..wire import protocol as wire
from .store import JobState, Store

__all__ = ["Broadcasts"]


class Broadcasts:
    """One aggregator's broadcasts; ``store``: where their values live."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # gets that came before their put: (job, name, seq) -> [(reply, req)]
        self.waiting: dict[tuple[str, str, int], list[tuple[Sender, int | None]]] = {}

    def put(self, reply: Sender, msg: wire.Message) -> None:
        """BCAST_PUT: keep the value (one payload), acknowledge it, answer the gets parked on it."""
        state = self.store.job(msg["job"], msg["secret"])
        if len(msg.payloads) != 1:
            raise wire.ProtocolError("bcast_put: exactly one payload frame expected")
        data = msg.whole(0, np.uint8)
        self.store.bcast_put(state, msg["name"], msg["seq"], data)
        reply.send(wire.header(wire.OK, req=msg.get("req")))
        waiting = self.waiting.pop((msg["job"], msg["name"], msg["seq"]), [])
        for pending_reply, pending_req in waiting:
            self._answer(state, msg["name"], msg["seq"], pending_reply, pending_req)

    def get(self, reply: Sender, msg: wire.Message) -> None:
        """BCAST_GET: the value, now if it was put, else once it is."""
        state = self.store.job(msg["job"], msg["secret"])
        if (msg["name"], msg["seq"]) in state.broadcasts:
            self._answer(state, msg["name"], msg["seq"], reply, msg.get("req"))
        else:
            self.waiting.setdefault((msg["job"], msg["name"], msg["seq"]), []).append((reply, msg.get("req")))

    def _answer(self, state: JobState, name: str, seq: int, reply: Sender, req: int | None) -> None:
        data = self.store.bcast_get(state, name, seq)
        reply.send(wire.header(wire.PULL_REPLY, req=req, items=[wire.PullReplyItem(name, seq, 0).to_wire()]), [data])
