"""Where server-mode keys are replicated (pure choices over the pool state).

Scheme (chosen for its cost; see docs/autops.md "Failures"): the owner of a ``server``-mode
key sends its replica the whole state once (master copy, optimizer state, step, iteration)
and then, after every optimizer step, only that step's averaged gradient; the replica
applies the same deterministic update, so it holds exactly the owner's state while moving
one key's bytes per iteration instead of two to three (Adam's moments). The owner answers
the pulls of an iteration only once the replica acknowledged it, so whatever a worker has
read survives the loss of the owner. A replica lives on another aggregator, on another host
when the pool has one.
"""
from __future__ import annotations

from typing import Iterable

from .pool import PoolState


def pick_replica(owner: str, owner_host: str | None, candidates: Iterable[tuple[str, str, int]]) -> str | None:
    """The replica for a key owned by ``owner``: among ``(aggregator, host, bytes held)``
    candidates other than the owner, one on another host if any, then the least loaded,
    then by name. None when there is no other aggregator."""
    others = [c for c in candidates if c[0] != owner]
    if not others:
        return None
    return min(others, key=lambda c: (c[1] == owner_host, c[2], c[0]))[0]


def choose_replica(state: PoolState, owner: str, exclude: Iterable[str] = ()) -> str | None:
    """``pick_replica`` over the live aggregators of ``state`` (minus ``exclude``)."""
    skip = set(exclude)
    load = state.load_bytes()
    info = state.aggs.get(owner)
    live = [(a.agg_id, a.host, load.get(a.agg_id, 0)) for a in state.live_aggregators() if a.agg_id not in skip]
    return pick_replica(owner, info.host if info else None, live)


def replica_info(state: PoolState, agg: str) -> dict:
    """How an owner reaches replica ``agg``: its id, endpoints and host."""
    info = state.aggs[agg]
    return {"agg": agg, "endpoints": info.endpoints, "host": info.host}
