"""Remote slab placement: power of two choices over M_new / M_old (thesis §2.4.2).

This module owns *which daemon gets a slab*. It is pure: plain functions over plain
data, randomness only through an injected ``random.Random``; asking daemons for their
free memory (QUERY_MEM -> FREE_MEM) is the caller's job.

The paper's algorithm, for one hot slab of a block device:

1. split the daemons the device knows into ``M_new`` (no slab of this device yet)
   and ``M_old`` (already hosting one of its slabs) -- unreachable daemons are in
   neither;
2. pick two daemons at random from ``M_new`` (if ``M_new`` is empty, from ``M_old``;
   if the set holds one daemon, just that one) and query them;
3. map the slab on the queried daemon with the most free memory, among those that
   can hold one slab (``free_bytes >= slab_size``); ties go to the smaller address;
4. if none of the ``M_new`` candidates can hold it, try ``M_old`` the same way
   ("first selects from M_new and then, if required, from M_old"); else ``None``
   (the slab stays on the local disk and the device tries again later).

Split API for a caller that does the querying itself::

    addrs = candidates(views, rng)          # whom to send QUERY_MEM
    best = choose({a: free for a, free in replies}, slab_size)
    if best is None: addrs = candidates(views, rng, exclude=addrs) ...   # M_old stage

``place`` runs both stages on views whose ``free_bytes`` are taken as the replies;
``place_with`` does the same over pre-split address lists and a ``query`` callback
(what the cluster simulation uses, so it never rebuilds 1000 views per slab).
``random_choice`` and ``power_of_two_without_split`` are the baselines of the
simulation (uniform random; power of two over all machines, no M_new/M_old).

Addresses are opaque: any hashable, mutually orderable id (``"tcp://host:port"`` in the
device, a machine index in the simulation).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, Sequence, Union

__all__ = [
    "DaemonView", "split", "candidates", "choose", "place", "place_with",
    "random_choice", "random_choice_with", "power_of_two_without_split", "power_of_two_with",
]

Addr = Hashable
Replies = Union[Mapping[Addr, int], Iterable[tuple[Addr, int]]]
Query = Callable[[Sequence[Addr]], Replies]


@dataclass(frozen=True)
class DaemonView:
    """What a device knows about one daemon.

    ``free_bytes`` is the daemon's last FREE_MEM answer (bytes it can give to new slabs);
    ``has_my_slab`` is true when this daemon already hosts a slab of this device (M_old).
    """
    addr: Addr
    free_bytes: int = 0
    has_my_slab: bool = False
    reachable: bool = True


def split(daemons: Iterable[DaemonView], exclude: Iterable[Addr] = ()) -> tuple[list[Addr], list[Addr]]:
    """``(M_new, M_old)`` addresses of the reachable daemons not in ``exclude``, input order kept."""
    skip = set(exclude)
    m_new: list[Addr] = []
    m_old: list[Addr] = []
    for d in daemons:
        if not d.reachable or d.addr in skip:
            continue
        (m_old if d.has_my_slab else m_new).append(d.addr)
    return m_new, m_old


def _pick(pool: Sequence[Addr], rng: random.Random, k: int) -> list[Addr]:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return rng.sample(pool, min(k, len(pool))) if pool else []


def candidates(daemons: Iterable[DaemonView], rng: random.Random, k: int = 2,
               exclude: Iterable[Addr] = ()) -> list[Addr]:
    """The daemons to query for one slab: ``k`` at random from M_new, else from M_old.

    Fewer than ``k`` when the chosen set is smaller; ``[]`` when no daemon is reachable.
    Pass the already-queried addresses as ``exclude`` to get the next stage (the M_old
    stage after M_new's candidates could not hold the slab, or another round).
    """
    m_new, m_old = split(daemons, exclude)
    return _pick(m_new if m_new else m_old, rng, k)


def _items(replies: Replies) -> Iterable[tuple[Addr, int]]:
    return replies.items() if isinstance(replies, Mapping) else replies


def choose(replies: Replies, slab_size: int) -> Addr | None:
    """The queried daemon with the most free bytes among those with ``free >= slab_size``.

    ``replies`` maps address -> free bytes (or is an iterable of such pairs). Ties go to the
    smaller address, so the result does not depend on reply order. ``None`` if none fits.
    """
    if slab_size <= 0:
        raise ValueError(f"slab_size must be positive, got {slab_size}")
    best: Addr | None = None
    best_free = -1
    for addr, free in _items(replies):
        if free < slab_size:
            continue
        if free > best_free or (free == best_free and addr < best):  # type: ignore[operator]
            best, best_free = addr, free
    return best


def place_with(m_new: Sequence[Addr], m_old: Sequence[Addr], query: Query, slab_size: int,
               rng: random.Random, k: int = 2) -> Addr | None:
    """Both stages of §2.4.2 over pre-split address lists; ``query(addrs)`` returns the replies.

    Stage 1 queries ``k`` random daemons of ``m_new``; if none can hold a slab (or ``m_new``
    is empty), stage 2 queries ``k`` random daemons of ``m_old``. ``None`` if neither fits.
    """
    for pool in (m_new, m_old):
        addrs = _pick(pool, rng, k)
        if addrs:
            best = choose(query(addrs), slab_size)
            if best is not None:
                return best
    return None


def _views_query(daemons: Iterable[DaemonView]) -> tuple[list[DaemonView], Query]:
    views = list(daemons)
    free = {d.addr: d.free_bytes for d in views}
    return views, (lambda addrs: {a: free[a] for a in addrs})


def place(daemons: Iterable[DaemonView], slab_size: int, rng: random.Random, k: int = 2) -> Addr | None:
    """Power of two choices with M_new before M_old; the views' ``free_bytes`` act as replies."""
    views, query = _views_query(daemons)
    m_new, m_old = split(views)
    return place_with(m_new, m_old, query, slab_size, rng, k)


def power_of_two_with(pool: Sequence[Addr], query: Query, slab_size: int, rng: random.Random,
                      k: int = 2) -> Addr | None:
    """Baseline: ``k`` random daemons of the whole pool, the freest that fits (no M_new/M_old)."""
    addrs = _pick(pool, rng, k)
    return choose(query(addrs), slab_size) if addrs else None


def power_of_two_without_split(daemons: Iterable[DaemonView], slab_size: int, rng: random.Random,
                               k: int = 2) -> Addr | None:
    """Power of two choices over all reachable daemons, ignoring which hold this device's slabs."""
    views, query = _views_query(daemons)
    m_new, m_old = split(views)
    return power_of_two_with(m_new + m_old, query, slab_size, rng, k)


def random_choice_with(pool: Sequence[Addr], query: Query, slab_size: int, rng: random.Random,
                       attempts: int | None = None) -> Addr | None:
    """Baseline: query daemons one at a time in uniformly random order, take the first that fits.

    ``attempts`` bounds the number of queries (``None``: the whole pool, which makes the
    result uniform over the daemons that can hold a slab). No free-memory comparison.
    """
    n = len(pool) if attempts is None else min(attempts, len(pool))
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for addr in (rng.sample(pool, n) if n else []):
        if choose(query([addr]), slab_size) is not None:
            return addr
    return None


def random_choice(daemons: Iterable[DaemonView], slab_size: int, rng: random.Random,
                  attempts: int | None = None) -> Addr | None:
    """Uniformly random reachable daemon that can hold a slab (see ``random_choice_with``)."""
    views, query = _views_query(daemons)
    m_new, m_old = split(views)
    return random_choice_with(m_new + m_old, query, slab_size, rng, attempts)
