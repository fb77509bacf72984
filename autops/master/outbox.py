"""pMaster's outbox to its aggregators: control messages, and their replies matched to them.

``Outbox`` is all that elasticity (``elastic``) and live migration (``migration``) may do
beyond the pool state they are given: send a control message to an aggregator, optionally
with a function called once with the aggregator's reply, or with None when the aggregator is
unknown or no reply came within the timeout. ``AggregatorOutbox`` implements it over
pMaster's socket (a ``send(identity, frames)`` function); pMaster hands it the replies
(``deliver``) and the time (``expire``). Tests use a recording fake instead.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Protocol

from ..wire import protocol as wire
from .pool import PoolState

Reply = Callable[[wire.Message | None], None]


class Outbox(Protocol):
    """Control messages from pMaster to its aggregators."""

    def send_agg(self, agg: str, op: str, reply: Reply | None, **fields: Any) -> None:
        """``op`` with ``fields`` to aggregator ``agg``; ``reply(message or None)`` on its answer."""


class AggregatorOutbox:
    """``Outbox`` over pMaster's socket; replies are matched by the request id it adds."""

    def __init__(self, state: PoolState, send: Callable[[bytes, list], None], timeout: float) -> None:
        self.state = state
        self._send = send
        self.timeout = timeout
        self._reqs = itertools.count(1)
        self._waiting: dict[int, tuple[float, Reply, bytes]] = {}     # req -> (deadline, reply, identity)

    def send_agg(self, agg: str, op: str, reply: Reply | None, **fields: Any) -> None:
        info = self.state.aggs.get(agg)
        if info is None:
            if reply is not None:
                reply(None)
            return
        if reply is not None:
            req = next(self._reqs)
            fields["req"] = req
            self._waiting[req] = (self.state.clock() + self.timeout, reply, info.identity)
        self._send(info.identity, wire.encode(op, **fields))

    def deliver(self, msg: wire.Message, sender: bytes | None = None) -> bool:
        """An aggregator's OK or ERROR: True when it answered a message sent here (to
        ``sender``, when given: no other peer can answer for it)."""
        req = msg.get("req")
        waiting = self._waiting.get(req) if type(req) is int else None
        if waiting is None or (sender is not None and sender != waiting[2]):
            return False
        del self._waiting[req]
        waiting[1](msg)
        return True

    def expire(self, now: float) -> None:
        """Call ``reply(None)`` for every message whose answer is overdue at ``now``."""
        for req, (deadline, reply, _) in list(self._waiting.items()):
            if now > deadline:
                del self._waiting[req]
                reply(None)
