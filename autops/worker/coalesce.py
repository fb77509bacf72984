"""Which large keys' pushes travel together: the agent's I/O thread takes its callers'
operations in bursts, and the pushes of one burst to one aggregator with one operation go
as one message of at most a partition's bytes (each message costs both ends CPU; one
partition per message keeps the pipeline as fine-grained as the partition size made it).
A key already waiting in a group closes the group first, so each key's iterations leave
in order. Plain bookkeeping with no I/O; the agent sends what it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable


@dataclass
class _Group:
    items: list[Any] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    nbytes: int = 0


class Coalescer:
    """Groups of ``(key, nbytes, item)`` per destination, each at most ``limit`` bytes (a
    single item over it goes alone, at once)."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, _Group] = {}

    def add(self, dest: Hashable, key: str, nbytes: int, item: Any, limit: int) -> list[list[Any]]:
        """Add ``item`` for ``dest``; returns the groups for ``dest`` to send now, in order."""
        if nbytes >= limit:
            return [*self._close(dest), [item]]
        ready = []
        group = self._groups.get(dest)
        if group is not None and (key in group.keys or group.nbytes + nbytes > limit):
            ready = self._close(dest)
            group = None
        if group is None:
            group = self._groups[dest] = _Group()
        group.items.append(item)
        group.keys.add(key)
        group.nbytes += nbytes
        return ready

    def _close(self, dest: Hashable) -> list[list[Any]]:
        group = self._groups.pop(dest, None)
        return [group.items] if group is not None else []

    def drain(self) -> list[tuple[Hashable, list[Any]]]:
        """Every open group (the burst ended), in the order they were opened."""
        groups, self._groups = self._groups, {}
        return [(dest, group.items) for dest, group in groups.items()]

    def __bool__(self) -> bool:
        return bool(self._groups)
