"""The agent's cached assignment from pMaster (``Table``: tensor -> keys, key -> aggregator,
aggregator -> endpoint, keys moving and from which iteration) and ``SharedTable``, the one
current table that the user threads read and the I/O thread replaces."""
from __future__ import annotations

import collections
import threading
from contextlib import contextmanager
from typing import Iterator

from ..wire import protocol as wire
from ..wire.partition import KeySpec


class Table:
    """The cached assignment: tensor -> keys, key -> aggregator, aggregator -> endpoint."""

    def __init__(self) -> None:
        self.keys: dict[str, KeySpec] = {}
        self.owner: dict[str, str] = {}
        self.by_tensor: dict[str, list[KeySpec]] = {}
        self.aggs: dict[str, dict] = {}
        self.tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        self.moves: dict[str, tuple[str, int]] = {}   # key -> (new owner, first iteration there)
        self.home: str | None = None                  # the job's aggregator for broadcasts
        self.epoch = 0                                # failovers pMaster made (``failover``)
        self.lost: set[str] = set()                   # aggregators of the job that were lost

    def load(self, reply: wire.Message) -> None:
        keys, owner, by_tensor, moves = {}, {}, collections.defaultdict(list), {}
        for item in reply["keys"]:
            entry = wire.TableEntry.from_wire(item, reply.op)
            spec = entry.spec
            keys[spec.key] = spec
            owner[spec.key] = entry.owner
            if entry.move is not None:
                moves[spec.key] = entry.move
            by_tensor[spec.tensor].append(spec)
        self.keys, self.owner, self.by_tensor, self.moves = keys, owner, dict(by_tensor), moves
        self.aggs = dict(reply["aggregators"])
        self.tensors = {n: (tuple(s), d) for n, s, d in reply["tensors"]}
        self.home = reply.get("home")
        self.epoch = int(reply.get("epoch") or 0)
        self.lost = set(reply.get("lost") or ())

    def route(self, key: str, iteration: int) -> str:
        """The aggregator serving ``iteration`` of ``key``."""
        move = self.moves.get(key)
        if move is not None and iteration >= move[1]:
            return move[0]
        return self.owner[key]

    def learn(self, key: str, agg: str, first: int, info: dict) -> None:
        """A migration of ``key`` to ``agg`` from iteration ``first`` on (idempotent)."""
        if key not in self.owner:
            return
        self.aggs[agg] = info
        old = self.moves.get(key)
        if old is not None and old[1] < first and old[0] != agg:
            self.owner[key] = old[0]        # a later move: the earlier one is complete by now
        self.moves[key] = (agg, first)

    def final_owner(self, key: str) -> str:
        move = self.moves.get(key)
        return move[0] if move is not None else self.owner[key]


class SharedTable:
    """The agent's current table: the user threads read it (``current``, or ``locked`` to
    read it while no other thread replaces it); a declaration (user thread) and a redirect
    or failover (I/O thread) ``replace`` it whole."""

    def __init__(self, table: Table) -> None:
        self._table = table
        self._lock = threading.Lock()

    @property
    def current(self) -> Table:
        return self._table

    @contextmanager
    def locked(self) -> Iterator[Table]:
        """The current table, not replaced until the block ends."""
        with self._lock:
            yield self._table

    def replace(self, table: Table) -> None:
        with self._lock:
            self._table = table
