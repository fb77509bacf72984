"""Buffers of keys that migrated away from an aggregator, kept for keys of the same job that
migrate to it later (live migration, back and forth).

A key's published buffers stay in the job's shared memory after the key moved on (they are
freed with the job). Giving them to a later incoming key of the job costs nothing: they are
populated, and the job's workers have them mapped already, so neither side pays page
faults again. A buffer is reused only by its own job: the workers that read it are the ones
that will write it next, two iterations or more after they last read it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable


class SpareBuffers:
    """Per job, spare buffers (``transport.Shared``) by ``(numel, dtype)``."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[tuple[int, str], list[Any]]] = {}

    def keep(self, job: str, buffers: Iterable[Any]) -> None:
        """Buffers no key of ``job`` uses any more (``array`` and ``ref`` as allocated)."""
        spare = self._jobs.setdefault(job, defaultdict(list))
        for buf in buffers:
            if buf is not None:
                spare[(buf.array.size, str(buf.array.dtype))].append(buf)

    def take(self, job: str, sizes: list[tuple[int, str]]) -> list[Any] | None:
        """Buffers for all of ``sizes`` (``(numel, dtype)``, in order), or None -- and nothing
        taken -- when the spares of ``job`` cannot cover every one."""
        spare = self._jobs.get(job)
        if spare is None:
            return None
        want: dict[tuple[int, str], int] = defaultdict(int)
        for numel, dtype in sizes:
            want[(int(numel), str(dtype))] += 1
        if any(len(spare.get(size, ())) < count for size, count in want.items()):
            return None
        return [spare[(int(numel), str(dtype))].pop() for numel, dtype in sizes]

    def held(self, job: str) -> int:
        """Bytes kept for ``job``."""
        return sum(b.array.nbytes for bufs in self._jobs.get(job, {}).values() for b in bufs)

    def release(self, job: str) -> None:
        """The job's memory is freed: forget its buffers."""
        self._jobs.pop(job, None)
