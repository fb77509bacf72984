"""The narrow interfaces an aggregator gives the collaborators that serve part of its work.

A collaborator (``replicas.Replication``, ``recovery.Recovery``) never holds the aggregator
itself: it is given these, built by the aggregator from what it owns.

* ``Control``: answering pMaster over the sealed control channel, under the id pMaster gave
  (which changes when the aggregator registers again).
* ``Commitments``: committing a job's bytes here -- the room and quota checks, the tenant
  pMaster named, bytes pending while a helper thread allocates them, and the allocation
  that was checked already (the store's allocator does not check it again).
* ``Peers``: reaching other aggregators on the data path -- a channel to one (its replies
  are polled by the aggregator's loop), the proof of the cluster key bound to a job, and
  the next request id (one sequence for every request the aggregator waits an answer for).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from ..transport import Channel
from ..wire import protocol as wire
from .store import JobState

__all__ = ["Control", "Commitments", "Peers"]


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
class Commitments:
    """``check_room(job, nbytes)``: ``StoreError`` (``NoRoom``, counted) when ``nbytes`` more
    for ``job`` do not fit here or pass a per-job or per-tenant limit; ``learn_tenant(job,
    tenant)``: pMaster named the job's tenant in a sealed command; ``pend``/``unpend(job,
    nbytes)``: bytes being allocated for ``job`` off the loop, committed until the store
    holds them; ``prechecked(job)``: a context in which the store allocates for ``job``
    without checking the room again (the caller checked it)."""
    check_room: Callable[[str, int], None]
    learn_tenant: Callable[[str, object], None]
    pend: Callable[[str, int], None]
    unpend: Callable[[str, int], None]
    prechecked: Callable[[str], ContextManager[None]]


@dataclass(frozen=True)
class Peers:
    """``connect(info)``: the channel to the aggregator ``info`` names (``agg``, endpoints,
    host); ``ticket(state)``: what proves to it that this aggregator holds the cluster key,
    bound to the job (``clusterauth.peer_ticket``); ``next_req()``: a request id no other
    request of this aggregator uses."""
    connect: Callable[[dict], Channel]
    ticket: Callable[[JobState], bytes]
    next_req: Callable[[], int]
