"""An aggregator's reports to pMaster on a migration batch, one message per batch, not per key.

The new owner reports its keys' first complete iteration (WORKER_DONE) and the old owner its
finished hand-overs (TENSOR_COPY_DONE). Keys come due one by one, as the workers' pushes
arrive: sent as they came due, a 168-key job's switch made about 2 x 168 reports to pMaster
and as many MIGRATE_DROPs back, all on the two iterations around the switch, whose CPU the
workers feel on a busy host. Neither report is on the workers' path (pMaster only updates its
table and lets the old owner drop the key), so they wait until the batch's every key came
due here, and at most ``max_delay`` after the first one did.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

MAX_DELAY = 0.1         # seconds a key's report waits for the rest of its batch


class Report(NamedTuple):
    mid: int
    job: str
    keys: list
    wait_ms: float      # the largest any of the keys gave (WORKER_DONE: the hand-over wait)


@dataclass
class _Pending:
    expected: int = 0               # keys of the batch this aggregator reports on (0: unknown)
    reported: int = 0               # sent, or given up
    keys: list = field(default_factory=list)
    wait_ms: float = 0.0
    since: float | None = None      # when the first key still unsent came due


class BatchReports:
    """Keys due per batch ``(mid, job)``; ``due`` says which reports to send now."""

    def __init__(self, max_delay: float = MAX_DELAY, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_delay = max_delay
        self.clock = clock
        self._batches: dict[tuple[int, str], _Pending] = {}

    def expect(self, mid: int, job: str, keys: int) -> None:
        """``keys`` more keys of the batch will come due here."""
        self._batches.setdefault((mid, job), _Pending()).expected += keys

    def add(self, mid: int, job: str, keys: list, wait_ms: float = 0.0) -> None:
        """``keys`` came due."""
        if not keys:
            return
        pending = self._batches.setdefault((mid, job), _Pending())
        if pending.since is None:
            pending.since = self.clock()
        pending.keys.extend(keys)
        pending.wait_ms = max(pending.wait_ms, wait_ms)

    def give_up(self, mid: int, job: str, keys: int) -> None:
        """``keys`` of the batch will not come due (reported otherwise, or the batch ended)."""
        pending = self._batches.get((mid, job))
        if pending is not None:
            pending.reported += keys

    def forget(self, job: str) -> None:
        """The job left this aggregator: nothing of it is reported any more."""
        for batch in [b for b in self._batches if b[1] == job]:
            del self._batches[batch]

    def due(self) -> list[Report]:
        """Reports to send now: batches whose every expected key came due, and keys that
        waited ``max_delay``."""
        now = self.clock()
        out = []
        for (mid, job), pending in list(self._batches.items()):
            if not pending.keys:
                continue
            complete = pending.expected and pending.reported + len(pending.keys) >= pending.expected
            if complete or now - pending.since >= self.max_delay:
                out.append(Report(mid, job, pending.keys, pending.wait_ms))
                pending.reported += len(pending.keys)
                pending.keys, pending.wait_ms, pending.since = [], 0.0, None
            if pending.expected and pending.reported >= pending.expected:
                del self._batches[(mid, job)]
        return out

    def deadline(self) -> float | None:
        """When the oldest unsent key's wait ends (None: nothing waits)."""
        starts = [p.since for p in self._batches.values() if p.since is not None]
        return min(starts) + self.max_delay if starts else None
