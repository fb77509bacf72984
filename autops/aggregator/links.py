"""The narrow interfaces an aggregator gives the collaborators that serve part of its work.

A collaborator (``replicas.Replication``, ``recovery.Recovery``) never holds the aggregator
itself: it is given these, built by the aggregator from what it owns, or objects that own a
part of the work themselves (``commitments.Commitments``: the room and quota checks).

* ``Control``: answering pMaster over the sealed control channel, under the id pMaster gave
  (which changes when the aggregator registers again).
* ``Peers``: reaching other aggregators on the data path -- a channel to one (its replies
  are polled by the aggregator's loop), the proof of the cluster key bound to a job, and
  the next request id (one sequence for every request the aggregator waits an answer for).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..transport import Channel
from ..wire import protocol as wire
from .store import JobState

__all__ = ["Control", "Peers"]


@dataclass(frozen=True)
class Control:
    """``send``: a control message to pMaster (sealed with the registration's session);
    ``agg_id``: this aggregator's id now (None before it registered)."""
    send: Callable[[list], None]
    agg_id: Callable[[], str | None]

    def ok(self, req: int | None, **fields: Any) -> None:
        """Answer pMaster's request ``req``: done."""
        self.send(wire.encode(wire.OK, req=req, agg=self.agg_id(), **fields))

    def error(self, text: str, req: int | None) -> None:
        """Answer pMaster's request ``req``: refused, with why."""
        self.send(wire.error(text, req=req, agg=self.agg_id()))


@dataclass(frozen=True)
class Peers:
    """``connect(info)``: the channel to the aggregator ``info`` names (``agg``, endpoints,
    host); ``ticket(state)``: what proves to it that this aggregator holds the cluster key,
    bound to the job (``clusterauth.peer_ticket``); ``next_req()``: a request id no other
    request of this aggregator uses."""
    connect: Callable[[dict], Channel]
    ticket: Callable[[JobState], bytes]
    next_req: Callable[[], int]
