"""Whether an aggregator may commit more bytes to a job: the per-job cap and the per-tenant
quota (docs/autops.md, "Limits on what a peer can make an aggregator hold").

Policy only, over plain data: the bytes committed here per job, which tenant each job
belongs to where that is known, and the limits. A job's tenant is the name its CURVE client
key is authorized under (``dlrt keys tenant NAME``); the cluster's own ``member`` key is not a
tenant, and a job whose tenant is not known (CURVE off, or not yet seen) has only the per-job
cap. ``admit`` answers with a ``Decision`` whose ``reason`` names the limit and the option
that sets it; ``commitments.Commitments`` reads the machine's room and applies it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dlrt.keys import MEMBER       # the services' own key, not a tenant

__all__ = ["MEMBER", "Limits", "Decision", "admit", "tenant_bytes", "is_tenant", "default_tenant_bytes"]


@dataclass(frozen=True)
class Limits:
    """``max_job_bytes``: the most one job may hold committed here; ``max_tenant_bytes``: the
    most all jobs of one tenant may hold together (None: no per-tenant quota)."""
    max_job_bytes: int
    max_tenant_bytes: int | None = None


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.admitted


def is_tenant(name: str | None) -> bool:
    """Whether ``name`` (a job's key name, None when unknown) is a tenant with a quota."""
    return bool(name) and name != MEMBER


def tenant_bytes(tenant: str, committed: Mapping[str, int], tenants: Mapping[str, str]) -> int:
    """The bytes committed here to the jobs of ``tenant``."""
    return sum(n for job, n in committed.items() if tenants.get(job) == tenant)


def admit(job: str, need: int, committed: Mapping[str, int], tenants: Mapping[str, str],
          limits: Limits) -> Decision:
    """May ``need`` more bytes be committed to ``job``, which holds ``committed[job]`` here
    already? ``tenants`` maps jobs to their tenant's name (jobs not in it: unknown). Refused
    past ``limits.max_job_bytes`` for the job, or, for a tenant's job, past
    ``limits.max_tenant_bytes`` for all of the tenant's jobs together (``need`` 0 asks whether
    what ``job`` holds fits its tenant's quota, e.g. once its tenant becomes known)."""
    held = committed.get(job, 0)
    if held + need > limits.max_job_bytes:
        return Decision(False, f"job {job!r}: its keys need {need} bytes ({held} more held here), over this "
                               f"aggregator's limit of {limits.max_job_bytes} bytes per job (--max-job-bytes)")
    tenant = tenants.get(job)
    if limits.max_tenant_bytes is not None and is_tenant(tenant):
        total = tenant_bytes(tenant, committed, tenants)
        if total + need > limits.max_tenant_bytes:
            asked = f"its keys need {need} bytes and the tenant's jobs hold {total}" if need else \
                f"the tenant's jobs hold {total} bytes with it"
            return Decision(False, f"job {job!r} of tenant {tenant!r}: {asked} here, over this aggregator's limit "
                                   f"of {limits.max_tenant_bytes} bytes per tenant (--max-tenant-bytes)")
    return Decision(True)


def default_tenant_bytes(max_job_bytes: int, machine_share: int) -> int:
    """The per-tenant quota when none is given: ``machine_share`` -- the per-job default, half
    of what the machine can give when the aggregator starts, so one tenant leaves at least
    the other half to the others -- but never below ``max_job_bytes``: a tenant may always
    hold one job as large as the per-job cap allows."""
    return max(int(max_job_bytes), int(machine_share))
