"""GPU slots of the driver's node state when GPUs are shared (mechanism, not policy).

A GPU holds up to two jobs. ``GpuSlots`` keeps the round's physical plan (``plan[node][gpu]``:
the jobs on that GPU), each job's GPUs and its partner, and answers what the driver needs
between rounds: which GPUs are busy, and whose speed changes when a job leaves (its partner
then runs alone). ``ProfileSharing`` turns a job into its profile key and looks pairs up in a
``ProfileStore``: the driver sees only ``kind`` and ``pair``.
"""
from __future__ import annotations

from typing import Hashable, Protocol

from ..policies.base import JobState
from . import migration


class Sharing(Protocol):
    """What the driver asks about sharing: a job's profile key, a pair's normalised speeds."""

    def kind(self, job: JobState) -> Hashable | None: ...

    def pair(self, a: Hashable | None, b: Hashable | None) -> tuple[float, float] | None: ...

    def observe(self, a: Hashable | None, b: Hashable | None, speed_a: float, speed_b: float) -> None: ...


class ProfileSharing:
    """``Sharing`` from a ``tiresias.packing.profiles.ProfileStore``: a job's key is its
    (model, batch size, GPU count); a job without a model, or a type the store does not know,
    shares with nobody."""

    def __init__(self, store) -> None:
        from .profiles import JobType
        self.store = store
        self._type = JobType

    def kind(self, job: JobState) -> Hashable | None:
        if job.model is None:
            return None
        t = self._type(job.model, job.batch_size or "", job.num_gpus)
        return t if self.store.knows(t) else None

    def pair(self, a: Hashable | None, b: Hashable | None) -> tuple[float, float] | None:
        if a is None or b is None:
            return None
        return self.store.pair(a, b)

    def observe(self, a: Hashable | None, b: Hashable | None, speed_a: float, speed_b: float) -> None:
        """Packed jobs of types ``a`` and ``b`` ran at these normalised speeds: fold them in."""
        if a is not None and b is not None:
            self.store.observe(a, b, speed_a, speed_b)


class GpuSlots:
    """The physical GPU plan of the current round, kept up to date as jobs leave."""

    def __init__(self, nodes: int, per_node: int) -> None:
        self.nodes = nodes
        self.per_node = per_node
        self.plan: list[list[frozenset[int]]] = [[frozenset()] * per_node for _ in range(nodes)]
        self.gpus: dict[int, frozenset[tuple[int, int]]] = {}
        self.partner: dict[int, int] = {}

    def set(self, plan: list[list[frozenset[int]]], partners: dict[int, int]) -> None:
        """A round's plan (physical) and its pairs (both directions)."""
        self.plan = [list(node) for node in plan]
        self.gpus = migration.gpu_sets(plan)
        self.partner = dict(partners)

    def add(self, job_id: int, gpus: frozenset[tuple[int, int]]) -> None:
        """A job found on ``gpus`` (a restarted master): its partner is the job on the same ones."""
        for node, k in gpus:
            self.plan[node][k] = self.plan[node][k] | {job_id}
        for other, theirs in self.gpus.items():
            if theirs == gpus and other not in self.partner:
                self.partner[job_id], self.partner[other] = other, job_id
                break
        self.gpus[job_id] = gpus

    def release(self, job_id: int) -> int | None:
        """``job_id`` left its GPUs; its partner (which now runs alone), if any."""
        for node, k in self.gpus.pop(job_id, ()):
            self.plan[node][k] = self.plan[node][k] - {job_id}
        other = self.partner.pop(job_id, None)
        if other is not None:
            self.partner.pop(other, None)
        return other

    def busy(self) -> int:
        """GPUs holding at least one job."""
        return sum(1 for node in self.plan for gpu in node if gpu)

    def allocation(self, job_id: int) -> list[tuple[int, int]]:
        """The job's GPUs as the driver's allocations: ``[(node, GPUs there), ...]``."""
        count: dict[int, int] = {}
        for node, _ in self.gpus.get(job_id, ()):
            count[node] = count.get(node, 0) + 1
        return sorted(count.items())

    def previous(self) -> list[list[frozenset[int]]] | None:
        """The plan for the next round's renaming (None when no job holds a GPU)."""
        return self.plan if self.gpus else None
