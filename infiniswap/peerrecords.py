"""Which control peers a daemon remembers, and for how long: the expiry and rate policy
over per-identity records (``infiniswap.limits.ControlLimits``), with no I/O.

A peer is a ZeroMQ routing id.  Its record holds what the daemon keeps about it (the
challenge it was given, whether it proved the cluster key, its name, its shared-memory
counts) and a token bucket.  The table is bounded three ways:

* ``max_peers``: a new identity past the cap drops the least recently seen record that is
  not *pinned*; with every record pinned the new identity gets no record (``seen`` returns
  None: the daemon drops its message);
* ``peer_ttl``: ``expire()`` drops records not seen for that long that are not pinned;
* ``rate`` / ``burst``: ``allow()`` spends one token per message of an identity that has not
  proved the key (proven ones are not limited).

*Pinned* is a proven peer for which the caller's predicate says so (the daemon: it holds
leases); only proven records are asked, so a flood of unproven identities costs no lookups.
Dropped records go to ``on_drop`` (the daemon folds their counts into its totals).  The clock
is injected (fake clocks in tests); one thread uses a table.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

__all__ = ["PeerRecord", "PeerRecords"]


@dataclass
class PeerRecord:
    """What a daemon keeps about one control peer."""
    last_seen: float
    tokens: float                           # of its rate bucket
    refilled: float                         # when the bucket was last refilled
    proven: bool = False
    challenge: bytes | None = None          # its nonce, until it proved the key
    name: str | None = None                 # the device_id it gave
    shm: tuple[int, int] = (0, 0)           # shared-memory (read, written) it reported


class PeerRecords:
    """A bounded table of ``PeerRecord`` by routing id (see the module docstring)."""

    def __init__(self, max_peers: int, ttl: float, rate: float, burst: float, *,
                 pinned: Callable[[bytes], bool] = lambda peer: False,
                 clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[bytes, PeerRecord], None] | None = None) -> None:
        if max_peers < 1 or not ttl > 0 or not rate > 0 or not burst >= 1:
            raise ValueError("max_peers >= 1, ttl > 0, rate > 0 and burst >= 1 are needed")
        self.max_peers, self.ttl, self.rate, self.burst = max_peers, ttl, rate, burst
        self._pinned, self._clock, self._on_drop = pinned, clock, on_drop
        self._records: OrderedDict[bytes, PeerRecord] = OrderedDict()   # least recent first
        self.dropped = 0            # to make room for a new identity
        self.expired = 0            # not seen for ttl
        self.refused = 0            # no room: every record pinned
        self.limited = 0            # messages refused by the rate limit

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, peer: object) -> bool:
        return peer in self._records

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._records)

    def records(self) -> Iterator[PeerRecord]:
        return iter(self._records.values())

    def get(self, peer: bytes) -> PeerRecord | None:
        return self._records.get(peer)

    def _is_pinned(self, peer: bytes, rec: PeerRecord) -> bool:
        return rec.proven and self._pinned(peer)

    def seen(self, peer: bytes) -> PeerRecord | None:
        """``peer``'s record, made (room made) if new, marked seen now; None when there is no
        room (every record pinned)."""
        now = self._clock()
        rec = self._records.get(peer)
        if rec is not None:
            rec.last_seen = now
            self._records.move_to_end(peer)
            return rec
        if len(self._records) >= self.max_peers:
            victim = next((q for q, r in self._records.items() if not self._is_pinned(q, r)),
                          None)
            if victim is None:
                self.refused += 1
                return None
            self.dropped += 1
            self._drop(victim)
        rec = self._records[peer] = PeerRecord(last_seen=now, tokens=self.burst,
                                                refilled=now)
        return rec

    def allow(self, peer: bytes) -> bool:
        """Whether a message of ``peer`` (which has a record) is within its rate: always for a
        proven peer, else one token of its bucket (refills at ``rate``/s up to ``burst``)."""
        rec = self._records.get(peer)
        if rec is None:
            return False
        if rec.proven:
            return True
        now = self._clock()
        rec.tokens = min(self.burst, rec.tokens + max(0.0, now - rec.refilled) * self.rate)
        rec.refilled = now
        if rec.tokens >= 1.0:
            rec.tokens -= 1.0
            return True
        self.limited += 1
        return False

    def expire(self) -> list[bytes]:
        """Drop every record not seen for ``ttl`` that is not pinned; their ids."""
        now = self._clock()
        gone = []
        for peer, rec in self._records.items():         # least recently seen first
            if now - rec.last_seen <= self.ttl:
                break
            if not self._is_pinned(peer, rec):
                gone.append(peer)
        for peer in gone:
            self._drop(peer)
        self.expired += len(gone)
        return gone

    def forget(self, peer: bytes) -> None:
        """Drop ``peer``'s record now (it is gone), through ``on_drop``."""
        if peer in self._records:
            self._drop(peer)

    def _drop(self, peer: bytes) -> None:
        rec = self._records.pop(peer)
        if self._on_drop is not None:
            self._on_drop(peer, rec)
