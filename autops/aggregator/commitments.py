"""What an aggregator commits to its jobs: the room and quota checks every byte a job may hold
here passes (docs/autops.md, "Limits on what a peer can make an aggregator hold").

``Commitments`` owns the bookkeeping: the bytes committed per job (``committed``: what the
store holds for it, its spare buffers, and ``pending`` bytes a helper thread is still
allocating), each job's tenant where known (named by pMaster, or by the CURVE key of the
job's first request), the limits (``--max-job-bytes``, ``--max-tenant-bytes``, the
headroom) and the jobs dropped past their tenant's quota, whose later requests are told why.
The machine's room is ``memroom``'s and the policy ``quota``'s; this class applies them.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import psutil

from dlrt.curve import peer_name

from ..transport import Memory
from ..transport.prefault import heap_free
from ..wire import protocol as wire
from . import memroom, quota
from .spare import SpareBuffers
from .store import Store, StoreError

__all__ = ["Commitments", "NoRoom", "REFUSED_JOBS_KEPT"]

REFUSED_JOBS_KEPT = 1024    # jobs dropped past their tenant's quota whose requests are answered why

# the aggregator's log: these lines read as they did when the service logged them itself
log = logging.getLogger("autops.aggregator.service")


class NoRoom(StoreError):
    """Bytes this aggregator will not commit: no room, or past a per-job or per-tenant limit.
    Answered with ``no_room`` set (an owner then stops replicating to the refusing replica)."""


class Commitments:
    """The bytes one aggregator committed to its jobs, and the checks more bytes pass.

    ``store``: what the jobs hold (``Store.footprint``); ``spare``: the buffers kept for their
    keys that moved away; ``memory``: the transport's memory (its reserve is held ready for
    jobs); ``stats``: the aggregator's figures (refusals count in ``memory_refusals``);
    ``limits``: as ``resolve`` made them; ``headroom``: bytes never committed; ``rss_base``:
    this process's resident bytes when it started (its growth since counts as written);
    ``drop_job(job)``: free everything ``job`` holds here (a job past its tenant's quota)."""

    def __init__(self, store: Store, spare: SpareBuffers, memory: Memory, stats: dict, limits: quota.Limits,
                 headroom: int, rss_base: int, drop_job: Callable[[str], None]) -> None:
        self.store = store
        self.spare = spare
        self.memory = memory
        self.stats = stats
        self.max_job_bytes = limits.max_job_bytes
        self.max_tenant_bytes = limits.max_tenant_bytes
        self.headroom = int(headroom)
        self.drop_job = drop_job
        self.proc = psutil.Process()
        self._rss_base = rss_base
        # ``pending``: bytes being allocated for a job that the store does not hold yet.
        # Allocation is lazy, so the host's figures show them only once written (``memroom``)
        self.pending: dict[str, int] = {}
        self.tenants: dict[str, str] = {}       # job -> its tenant (CURVE key name), where known
        self.refused_jobs: dict[str, str] = {}  # job -> why it was dropped past its tenant's quota
        self._prechecked: str | None = None     # the job whose allocation now was checked already

    @staticmethod
    def resolve(headroom: int, max_job_bytes: int | None, max_tenant_bytes: int | None) -> quota.Limits:
        """The limits an aggregator started with these settings applies: ``max_job_bytes``
        by default half of what this machine can give now (``memroom``), ``max_tenant_bytes``
        by default ``quota.default_tenant_bytes``. ``ValueError`` for settings that make no sense."""
        if headroom < 0 or (max_job_bytes is not None and max_job_bytes <= 0) or \
                (max_tenant_bytes is not None and max_tenant_bytes <= 0):
            raise ValueError(f"headroom must be 0 or more, max_job_bytes and max_tenant_bytes above 0 "
                             f"(not {headroom}, {max_job_bytes}, {max_tenant_bytes})")
        share = None
        if max_job_bytes is None or max_tenant_bytes is None:
            share = max(1, memroom.room(memroom.mem_available(), memroom.cgroup_room(), headroom=int(headroom)) // 2)
        job_bytes = int(max_job_bytes) if max_job_bytes is not None else share
        tenant_bytes = int(max_tenant_bytes) if max_tenant_bytes is not None else \
            quota.default_tenant_bytes(job_bytes, share)
        return quota.Limits(job_bytes, tenant_bytes)

    # --- what is committed --------------------------------------------------------------
    def room(self) -> int:
        """Bytes a new declaration may still take here (``memroom.room``): the least of the
        host's ``MemAvailable`` and the cgroups' limit less usage (v1 and v2), plus what this
        process holds ready -- its heap's free bytes (the reserve's warmed heap, freed buffers)
        and the reserve's shared segments, memory the reserve took from ``available`` to give
        to jobs like this one -- less the headroom and the bytes committed to jobs and not
        yet written (this process's growth since it started counts as written)."""
        ready = heap_free() + (self.memory.reserve.held if self.memory.reserve is not None else 0)
        touched = self.proc.memory_info().rss - self._rss_base
        return memroom.room(memroom.mem_available(), memroom.cgroup_room(), ready=ready, headroom=self.headroom,
                            committed=sum(self.committed.values()), touched=touched)

    @property
    def committed(self) -> dict[str, int]:
        """Bytes committed here per job: what its keys, replicas and memory made ready take in
        the store (``Store.footprint``: declared, allocated or not yet), its spare buffers, and
        what is being allocated for it (``pending``). Keys that move away stop counting but
        for their published buffers, kept for the job (``spare``) until it ends."""
        jobs = set(self.store.jobs) | set(self.pending)     # (a job's spares go with its record)
        out = {job: self.store.footprint(job) + self.spare.held(job) + self.pending.get(job, 0) for job in jobs}
        return {job: n for job, n in out.items() if n > 0}

    def limits(self) -> quota.Limits:
        return quota.Limits(self.max_job_bytes, self.max_tenant_bytes)

    def figures(self) -> dict:
        """For the heartbeat: the bytes committed to all jobs, to each tenant's, and the limits."""
        committed = self.committed
        by_tenant: dict[str, int] = {}
        for job, nbytes in committed.items():
            if quota.is_tenant(self.tenants.get(job)):
                by_tenant[self.tenants[job]] = by_tenant.get(self.tenants[job], 0) + nbytes
        return {"committed_bytes": sum(committed.values()), "tenant_committed_bytes": by_tenant,
                "max_job_bytes": self.max_job_bytes, "max_tenant_bytes": self.max_tenant_bytes}

    # --- the checks -----------------------------------------------------------------------
    def check_room(self, job: str, need: int) -> None:
        """``StoreError`` (``NoRoom``, counted) when ``need`` more bytes for ``job`` are more
        than this aggregator can give (``room``), or take the job past ``max_job_bytes`` or its
        tenant past ``max_tenant_bytes`` (``quota.admit``)."""
        committed = self.committed
        room = self.room()
        if need > room:
            self.stats["memory_refusals"] += 1
            raise NoRoom(f"job {job!r}: its keys need {need} bytes, this machine has {room} available for "
                         f"them (host MemAvailable and cgroup limit, less {sum(committed.values())} "
                         f"bytes committed to jobs and {self.headroom} kept)")
        decision = quota.admit(job, need, committed, self.tenants, self.limits())
        if not decision:
            self.stats["memory_refusals"] += 1
            raise NoRoom(decision.reason)

    def check_allocation(self, job: str, need: int) -> None:
        """The store allocates ``need`` bytes for ``job``: ``check_room``, unless the caller
        checked it already (``prechecked``)."""
        if self._prechecked != job:         # (an assignment, a failover, a replica checked it first)
            self.check_room(job, need)

    @contextlib.contextmanager
    def prechecked(self, job: str) -> Iterator[None]:
        """The store allocates for ``job`` in the block without checking the room again: the
        caller checked it (``check_room``) and committed the bytes."""
        self._prechecked = job
        try:
            yield
        finally:
            self._prechecked = None

    def pend(self, job: str, nbytes: int) -> None:
        """``nbytes`` are being allocated for ``job`` (checked): committed until the store holds them."""
        if nbytes > 0:
            self.pending[job] = self.pending.get(job, 0) + nbytes

    def unpend(self, job: str, nbytes: int) -> None:
        left = self.pending.get(job, 0) - nbytes
        if left > 0:
            self.pending[job] = left
        else:
            self.pending.pop(job, None)

    # --- tenants ------------------------------------------------------------------------
    def learn_tenant(self, job: str, tenant: object) -> None:
        """pMaster named the tenant of ``job`` (the key it registered with) in a sealed command."""
        if isinstance(tenant, str) and tenant:
            self.tenants[job] = tenant

    def bind_tenant(self, job: str, name: str | None) -> None:
        """A request of ``job`` (its secret right) came over a CURVE connection whose key is
        authorized as ``name``: the first such key names the job's tenant, unless pMaster did.
        Where that takes the tenant past ``max_tenant_bytes`` the job's keys here are dropped
        (``drop_job``: its memory freed) and the request refused, naming the limit (``NoRoom``)."""
        if name is None or job in self.tenants:
            return
        tenants = {**self.tenants, job: name}
        decision = quota.admit(job, 0, self.committed, tenants, self.limits())
        if not decision:
            self.stats["memory_refusals"] += 1
            self.drop_job(job)
            self._refuse_job(job, decision.reason)
            log.warning("dropped job %s: %s", job, decision.reason)
            raise NoRoom(decision.reason)
        self.tenants[job] = name

    def check_request(self, msg: wire.Message, header: object, keyed: bool) -> None:
        """Before serving a job's request: a job dropped past its tenant's quota is told why
        again (``NoRoom``); over a CURVE connection (``keyed``: ``header`` names the client's
        key) the job's tenant is learnt (``bind_tenant``) once its secret proved right."""
        job = msg.get("job")
        if not isinstance(job, str):
            return                                      # (serving it answers what is wrong)
        if job in self.refused_jobs and job not in self.store.jobs:
            raise NoRoom(self.refused_jobs[job])
        if keyed and job not in self.tenants and job in self.store.jobs:
            self.store.job(job, msg.get("secret"))     # SecretMismatch: nobody else names its tenant
            self.bind_tenant(job, peer_name(header))

    def _refuse_job(self, job: str, reason: str) -> None:
        self.refused_jobs[job] = reason
        while len(self.refused_jobs) > REFUSED_JOBS_KEPT:
            self.refused_jobs.pop(next(iter(self.refused_jobs)))

    def release(self, job: str) -> None:
        """The job ends here: nothing is pending for it, its tenant and refusal are forgotten."""
        self.pending.pop(job, None)
        self.tenants.pop(job, None)
        self.refused_jobs.pop(job, None)
