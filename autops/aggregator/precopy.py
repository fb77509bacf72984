"""The old owner's side of copying server-mode state ahead of a switch (live migration).

During a migration a ``server``-mode key has *followers*: aggregators that must hold its
state before the switch -- the new owner, and the new owner's replica when that is a new
one. The old owner sends each follower the whole state once (a snapshot, as to a replica,
``replication``) and from then on every step's averaged gradient; unlike a replica, a
follower holds up no pull. A key's switch is decided once all its followers hold the state,
so each key is followed only for the iterations its own copy and the switch's lead take.
``Precopies`` decides when each state goes out -- a bounded number of bytes in flight, so
that copying gigabytes does not take the data path's CPU and sockets all at once -- and
tells when a key's followers all hold it. Bookkeeping only: ``moves_out.MovesOut`` sends
and receives.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

WINDOW_BYTES = 64 << 20      # state bytes sent to followers and not yet acknowledged


@dataclass
class Follower:
    """A peer following one key. ``info``: how to reach it (``agg``, endpoints, host);
    ``incoming``: it is the key's new owner (the state goes into its incoming key, not among
    its replicas); ``sent``: the last iteration sent to it (-1: the state is still to send)."""
    info: dict
    incoming: bool
    sent: int = -1

    @property
    def agg(self) -> str:
        return str(self.info.get("agg", ""))


class Precopies:
    """State sends waiting for their turn, the bytes in flight, and the followers each key
    still waits for."""

    def __init__(self, window_bytes: int = WINDOW_BYTES) -> None:
        self.window = window_bytes
        self.queue: deque = deque()                       # (owner key, Follower, bytes)
        self.in_flight: dict[tuple, int] = {}             # (job, key, agg) -> bytes
        self.waiting: dict[tuple[str, str], set] = {}     # (job, key) -> aggs without the state

    def start(self, ks: Any, followers: list[Follower], nbytes: int) -> None:
        """Send ``ks``'s state (``nbytes``) to ``followers``, after the sends already queued."""
        self.waiting[(ks.job, ks.spec.key)] = {f.agg for f in followers}
        for follower in followers:
            self.queue.append((ks, follower, nbytes))

    def due(self) -> list[tuple[Any, Follower]]:
        """The sends to make now: queued ones while the bytes in flight stay within the
        window (at least one when nothing is in flight, however large)."""
        out = []
        used = sum(self.in_flight.values())
        while self.queue and (not self.in_flight or used + self.queue[0][2] <= self.window):
            ks, follower, nbytes = self.queue.popleft()
            self.in_flight[(ks.job, ks.spec.key, follower.agg)] = nbytes
            used += nbytes
            out.append((ks, follower))
        return out

    def requeue(self, ks: Any, follower: Follower, nbytes: int) -> None:
        """Send the state to ``follower`` again (the key's state changed outside a step)."""
        self.in_flight.pop((ks.job, ks.spec.key, follower.agg), None)
        self.queue.append((ks, follower, nbytes))

    def holds(self, job: str, key: str, agg: str) -> bool:
        """``agg`` acknowledged the state of ``key`` -- or no longer follows it: True when
        that was the last follower the key waited for (it can switch now)."""
        self.in_flight.pop((job, key, agg), None)
        waiting = self.waiting.get((job, key))
        if waiting is None:
            return False
        waiting.discard(agg)
        if waiting:
            return False
        del self.waiting[(job, key)]
        return True

    def forget(self, job: str, keys: set[str] | None = None) -> None:
        """Drop what is queued, in flight or waited for, for ``keys`` of ``job`` (all with None)."""
        def mine(j: str, k: str) -> bool:
            return j == job and (keys is None or k in keys)

        self.queue = deque(q for q in self.queue if not mine(q[0].job, q[0].spec.key))
        for entry in [e for e in self.in_flight if mine(e[0], e[1])]:
            del self.in_flight[entry]
        for entry in [e for e in self.waiting if mine(*e)]:
            del self.waiting[entry]
