"""The running jobs of a policy whose keys stay put while a job runs, in priority order, with
the prefix sums of their GPU counts.

A scheduling pass walks the running jobs in priority order and keeps each one while its GPUs
fit in what is left. With the prefix sums, the pass keeps a whole stretch of running jobs at
once (``bisect`` on the sums finds where the GPUs run out) instead of visiting each job, so it
costs the jobs it admits or preempts, not the jobs that keep running.

The keys and GPU counts are plain lists kept sorted (insertion and removal move memory, in C);
the sums are recomputed lazily, from the first position that changed, by
``itertools.accumulate``.
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Iterable


class RunningOrder:
    """Keys (tuples ending with the job id) of running jobs, sorted, with GPU prefix sums."""

    __slots__ = ("keys", "gpus", "total", "_key_of", "sums", "valid")

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.gpus: list[int] = []
        self._key_of: dict[int, tuple] = {}
        self.sums: list[int] = [0]          # sums[i]: GPUs of keys[:i], right for i <= valid
        self.valid = 0
        self.total = 0                       # GPUs of all of them

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._key_of

    def add(self, key: tuple, gpus: int) -> None:
        """File a running job under ``key`` (its last element is the job id)."""
        job_id = key[-1]
        if job_id in self._key_of:
            self.discard(job_id)
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.gpus.insert(i, gpus)
        self.total += gpus
        self._key_of[job_id] = key
        if i < self.valid:
            self.valid = i

    def discard(self, job_id: int) -> None:
        key = self._key_of.pop(job_id, None)
        if key is None:
            return
        i = bisect_left(self.keys, key)
        del self.keys[i]
        self.total -= self.gpus.pop(i)
        if i < self.valid:
            self.valid = i

    def position(self, job_id: int) -> int:
        """Where the running job ``job_id`` is in the order."""
        return bisect_left(self.keys, self._key_of[job_id])

    def positions(self, job_ids: Iterable[int]) -> tuple[list[int], int]:
        """Where the running jobs ``job_ids`` are in the order (ascending), and their GPUs."""
        keys, key_of, gpus = self.keys, self._key_of, self.gpus
        at = sorted([bisect_left(keys, key_of[job_id]) for job_id in job_ids])
        return at, sum([gpus[i] for i in at])

    def prefix(self, upto: int | None = None) -> list[int]:
        """``p`` with ``p[i]`` = GPUs of the first ``i`` running jobs, right for ``i <= upto``
        (default: all of them; do not modify it). Only the sums up to ``upto`` are brought up
        to date: a pass often needs the first stretch of the order only."""
        n = len(self.keys)
        upto = n if upto is None else upto
        v = self.valid
        if v < upto:
            sums = accumulate(self.gpus[v:upto], initial=self.sums[v])
            if upto == n:
                self.sums[v:] = sums        # and the sums of jobs gone since are dropped
            else:
                self.sums[v:upto + 1] = sums
            self.valid = upto
        elif upto == n and len(self.sums) > n + 1:
            del self.sums[n + 1:]            # sums of jobs gone since
        return self.sums
