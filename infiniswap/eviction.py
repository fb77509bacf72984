"""Daemon-side memory reclamation policy: batch eviction of E of E+E' slabs (thesis §2.5).

This module owns *how many* slabs a daemon releases or preallocates for a given free
memory and HeadRoom, and *which* mapped slabs it evicts. It is pure: plain functions
over plain data, randomness only through an injected ``random.Random``. Talking to
devices (CHECK_ACTIVITY -> ACTIVITY, EVICT -> DONE) is the caller's job.

Two-stage release (§2.5.2): when free memory drops below HeadRoom the daemon first
releases unmapped (preallocated, unused) slabs, then evicts mapped ones
(``slabs_to_release``). Preallocation (§2.5.1): while free memory stays above HeadRoom
by at least one slab, it allocates more (``slabs_to_preallocate``). Because release
starts below HeadRoom and preallocation stops a slab above it, the two never chase
each other.

Batch eviction (§2.5.2): to evict ``E`` slabs, ``sample`` ``E + E'`` mapped slabs at
random, ask their devices for the activity ``A(s)`` of each, and ``choose`` the ``E``
least active. ``random_evict`` is the no-communication baseline. With each slab busy
independently with probability ``p_b``, the probability that all ``E`` evicted slabs are
lightly active is::

    random:  (1 - p_b)^E                                        p_lightly_random
    batch:   sum_{i=E}^{E+E'} C(E+E', i) (1-p_b)^i p_b^(E+E'-i)  p_lightly_batch

(batch succeeds iff at least ``E`` of the ``E + E'`` sampled slabs are light, since every
light slab is less active than every busy one).
"""
from __future__ import annotations

import math
import random
from typing import Hashable, Mapping, Sequence, TypeVar

__all__ = [
    "sample", "choose", "random_evict", "p_lightly_random", "p_lightly_batch",
    "slabs_to_release", "slabs_to_preallocate",
]

T = TypeVar("T")
SlabKey = Hashable


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _seq(slabs: Sequence[T]) -> Sequence[T]:
    # ``random.sample`` needs a sequence; ranges, lists and tuples are sampled without a copy.
    # Sets are sorted first so the draw does not depend on hash order (reproducible per seed).
    if isinstance(slabs, (list, tuple, range)):
        return slabs
    return sorted(slabs) if isinstance(slabs, (set, frozenset)) else list(slabs)


def sample(mapped_slabs: Sequence[T], E: int, E_prime: int, rng: random.Random) -> list[T]:
    """``E + E'`` distinct mapped slabs drawn uniformly at random (all of them if fewer).

    These are the slabs whose devices get CHECK_ACTIVITY. Order is the draw order.
    """
    n = _count("E", E) + _count("E_prime", E_prime)
    pool = _seq(mapped_slabs)
    return rng.sample(pool, min(n, len(pool)))


def choose(activities: Mapping[SlabKey, float], E: int) -> list[SlabKey]:
    """The ``E`` least active slabs (all if fewer), least active first; ties by key.

    ``activities`` maps slab key -> ``A(s)`` from the ACTIVITY replies. Keys must be
    mutually orderable (e.g. ``(device_id, slab)`` tuples). A slab whose device did not
    answer is the caller's call -- an unreachable device no longer uses its slab, so
    ``0.0`` is the natural value. NaN is rejected.
    """
    _count("E", E)
    for key, a in activities.items():
        if a != a:  # NaN
            raise ValueError(f"activity of slab {key!r} is NaN")
    ranked = sorted(activities.items(), key=lambda kv: (kv[1], kv[0]))
    return [key for key, _ in ranked[:E]]


def random_evict(mapped_slabs: Sequence[T], E: int, rng: random.Random) -> list[T]:
    """Baseline without communication: ``E`` distinct mapped slabs uniformly at random."""
    pool = _seq(mapped_slabs)
    return rng.sample(pool, min(_count("E", E), len(pool)))


def _probability(p_b: float) -> float:
    if not 0.0 <= p_b <= 1.0:
        raise ValueError(f"p_b must be in [0, 1], got {p_b!r}")
    return float(p_b)


def p_lightly_random(p_b: float, E: int) -> float:
    """P(all ``E`` randomly evicted slabs are lightly active) = ``(1 - p_b)^E``."""
    return (1.0 - _probability(p_b)) ** _count("E", E)


def p_lightly_batch(p_b: float, E: int, E_prime: int) -> float:
    """P(at least ``E`` of ``E + E'`` sampled slabs are light), i.e. batch eviction finds E light ones.

    ``sum_{i=E}^{E+E'} C(E+E', i) (1 - p_b)^i p_b^(E+E'-i)``; equals ``p_lightly_random`` for E' = 0.
    """
    p = _probability(p_b)
    n = _count("E", E) + _count("E_prime", E_prime)
    q = 1.0 - p
    return math.fsum(math.comb(n, i) * q ** i * p ** (n - i) for i in range(E, n + 1))


def slabs_to_release(free_bytes: int, headroom: int, slab_size: int, unmapped_count: int,
                     mapped_count: int | None = None) -> tuple[int, int]:
    """``(n_unmapped_to_release, n_mapped_to_evict)`` to get free memory back to ``headroom``.

    Nothing while ``free_bytes >= headroom``. Otherwise the deficit is rounded up to whole
    slabs, served first from unmapped slabs, the rest by evicting mapped ones (capped at
    ``mapped_count`` when given -- a daemon cannot give back more than it holds).
    """
    if slab_size <= 0:
        raise ValueError(f"slab_size must be positive, got {slab_size}")
    _count("unmapped_count", unmapped_count)
    deficit = headroom - free_bytes
    if deficit <= 0:
        return 0, 0
    need = -(-deficit // slab_size)
    unmapped = min(need, unmapped_count)
    mapped = need - unmapped
    if mapped_count is not None:
        mapped = min(mapped, _count("mapped_count", mapped_count))
    return unmapped, mapped


def slabs_to_preallocate(free_bytes: int, headroom: int, slab_size: int, allocated: int = 0,
                         limit: int | None = None) -> int:
    """How many more slabs to allocate (unmapped) while keeping ``free_bytes >= headroom`` after.

    ``floor((free - headroom) / slab_size)`` when positive, capped so the daemon holds at most
    ``limit`` slabs in total (``allocated`` already held, mapped or not; ``None``: no cap).
    """
    if slab_size <= 0:
        raise ValueError(f"slab_size must be positive, got {slab_size}")
    spare = free_bytes - headroom
    n = spare // slab_size if spare > 0 else 0
    if limit is not None:
        n = min(n, max(0, _count("limit", limit) - _count("allocated", allocated)))
    return int(n)
