"""Optimus's parameter assignment algorithm (PAA, EuroSys'18 §5.3), MXNet's default split, and
the Table 3 load-balance measures (pure functions over plain lists).

A *block* is ``(name, size)`` (size in parameters or bytes: any additive unit). An assignment
is a list of ``(block name, partition index, size, server)``: one row per request a worker
sends to a server each step (partition index 0 for a block kept whole).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Block = tuple[str, int]
Placement = tuple[str, int, int, int]

SMALL_FRACTION = 0.01            # §5.3: "very small" is under 1% of avg_size
MXNET_BIGARRAY_BOUND = 10 ** 6   # MXNet's MXNET_KVSTORE_BIGARRAY_BOUND default


def _check(blocks: Sequence[Block], servers: int) -> None:
    if servers < 1:
        raise ValueError(f"servers must be at least 1, got {servers}")
    for name, size in blocks:
        if int(size) < 0:
            raise ValueError(f"block {name!r}: negative size {size}")


def _argmin(values: Sequence[float]) -> int:
    """Index of the smallest value; ties go to the lowest index."""
    return min(range(len(values)), key=lambda i: (values[i], i))


def _slices(size: int, part: int) -> list[int]:
    """``size`` cut into pieces of ``part`` (the last one smaller)."""
    full, rest = divmod(size, part)
    return [part] * full + ([rest] if rest else [])


def assign_paa(blocks: Sequence[Block], servers: int,
               small_fraction: float = SMALL_FRACTION) -> list[Placement]:
    """PAA: blocks in decreasing size (ties keep input order), ``avg`` = total / servers.

    * size < ``small_fraction`` x avg: to the server with the fewest requests;
    * up to avg: best fit, the server with the least remaining capacity (avg - assigned)
      that still holds it, else the least-loaded server;
    * over avg: sliced into partitions of floor(avg) (the last one smaller), each to the
      least-loaded server.

    Every block or partition is one request on its server. Ties go to the lowest server index.
    """
    _check(blocks, servers)
    total = sum(int(size) for _, size in blocks)
    avg = total / servers
    part = max(1, math.floor(avg))
    assigned = [0] * servers
    requests = [0] * servers
    out: list[Placement] = []

    def place(name: str, index: int, size: int, server: int) -> None:
        assigned[server] += size
        requests[server] += 1
        out.append((name, index, size, server))

    order = sorted(range(len(blocks)), key=lambda i: (-int(blocks[i][1]), i))
    for i in order:
        name, size = blocks[i][0], int(blocks[i][1])
        if size < small_fraction * avg:
            place(name, 0, size, _argmin(requests))
        elif size <= avg:
            fits = [s for s in range(servers) if avg - assigned[s] >= size]
            if fits:
                server = min(fits, key=lambda s: (avg - assigned[s], s))
            else:
                server = _argmin(assigned)
            place(name, 0, size, server)
        else:
            for index, piece in enumerate(_slices(size, part)):
                place(name, index, piece, _argmin(assigned))
    return out


def assign_mxnet(blocks: Sequence[Block], servers: int, threshold: int = MXNET_BIGARRAY_BOUND,
                 seed: int = 0) -> list[Placement]:
    """MXNet's default: a block under ``threshold`` to one random server (seeded), a larger one
    sliced evenly over all servers (partition i, sizes differing by at most one, on server i).

    (MXNet itself picks ``key * 9973 % servers`` for the small ones: pseudo-random too.)
    """
    _check(blocks, servers)
    rng = np.random.default_rng(seed)
    out: list[Placement] = []
    for name, size in blocks:
        size = int(size)
        if size < threshold:
            out.append((name, 0, size, int(rng.integers(servers))))
            continue
        base, extra = divmod(size, servers)
        for server in range(servers):
            out.append((name, server, base + (1 if server < extra else 0), server))
    return out


def measures(assignment: Sequence[Placement], servers: int) -> dict[str, int]:
    """Table 3's measures of ``assignment`` over ``servers`` (a server with nothing counts as 0):
    ``size_imbalance`` (max - min assigned size), ``request_imbalance`` (max - min requests),
    ``total_requests``."""
    if servers < 1:
        raise ValueError(f"servers must be at least 1, got {servers}")
    sizes = [0] * servers
    requests = [0] * servers
    for _, _, size, server in assignment:
        if not 0 <= server < servers:
            raise ValueError(f"server {server} is outside 0..{servers - 1}")
        sizes[server] += int(size)
        requests[server] += 1
    return {"size_imbalance": max(sizes) - min(sizes),
            "request_imbalance": max(requests) - min(requests),
            "total_requests": len(assignment)}
