"""What a restarted pMaster learns back from its aggregators beyond the keys they hold: the
pool's elastic state -- which aggregators are temporaries, active or draining, the clusters,
and each job's packing state and profile.

pMaster keeps these records in memory only, and its aggregators outlive it. So with every
answer to an aggregator's heartbeat pMaster sends that aggregator a *note* (``note_for``): the
aggregator's own record (state, cluster, the job it serves alone or is reserved for) and the
elastic record of every job it holds something of (state, cluster, aggregators asked for,
standalone iteration time ``D_j``, reverts, temporaries, home). The aggregator keeps the latest
note and gives it back when it registers with a restarted pMaster, next to what it holds
(``Master._adopt`` rebuilds the jobs' keys and tables from that); ``Restorer.restore`` then puts
the records back, each job's from the newest note that names it (notes carry the wall-clock
time pMaster wrote them: aggregators register again in any order, and one that was slow to
hear from pMaster may hold a record from before the job was packed). The per-key CPU times come back by themselves with the heartbeats' profiles.
Notes are plain data checked field by field: a malformed one is ignored, never fatal.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

from .pool import AggInfo, JobInfo, PoolState

log = logging.getLogger("autops.master.rebuild")

AGG_STATES = ("idle", "temporary", "active", "draining")
JOB_STATES = ("profiling", "packed", "dedicated", "best-effort")


def note_for(state: PoolState, agg_id: str) -> dict:
    """pMaster's record of aggregator ``agg_id`` and of the jobs it holds something of."""
    info = state.aggs[agg_id]
    jobs = {}
    for job in state.jobs.values():
        if agg_id in job.touched or agg_id in job.temps or agg_id in job.aggregators:
            jobs[job.job] = {"state": job.state, "cluster": job.cluster, "requested": job.requested,
                             "standalone": job.standalone, "reverts": job.reverts, "temps": list(job.temps),
                             "best_effort": job.best_effort, "home": job.home}
    return {"state": info.state, "cluster": info.cluster, "exclusive": info.exclusive,
            "reserved_for": info.reserved_for, "busy": info.busy, "jobs": jobs, "at": time.time()}


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


class Restorer:
    """Puts the records of a restarted pMaster's pool back from its aggregators' notes. A job's
    record is taken from the newest note that names it, and only for jobs rebuilt from what
    aggregators hold (``JobInfo.adopted``): a job registered anew is this pMaster's own."""

    def __init__(self, state: PoolState) -> None:
        self.state = state
        self.restored: dict[str, float] = {}     # job -> the time of the note its record came from

    def restore(self, info: AggInfo, note: Any) -> None:
        """Aggregator ``info`` registered again with ``note`` (None: it never got one)."""
        if not isinstance(note, dict):
            return
        if note.get("state") in AGG_STATES:
            info.state = note["state"]
        info.exclusive = _name(note.get("exclusive"))
        info.reserved_for = _name(note.get("reserved_for"))
        info.busy = _number(note.get("busy"))
        cluster = _name(note.get("cluster"))
        if cluster is not None:
            info.cluster = cluster
            self.state.cluster_named(cluster).aggs.add(info.agg_id)
        written = _number(note.get("at")) or 0.0
        jobs = note.get("jobs")
        if isinstance(jobs, dict):
            for job_id, record in jobs.items():
                job = self.state.jobs.get(job_id)
                if job is None or not job.adopted or not isinstance(record, dict):
                    continue
                if job_id in self.restored and self.restored[job_id] >= written:
                    continue                     # a newer note gave this job's record already
                self.restored[job_id] = written
                self._restore_job(job, record)
        log.info("aggregator %s restored as %s%s", info.agg_id, info.state,
                 f" in cluster {info.cluster}" if info.cluster else "")

    def _restore_job(self, job: JobInfo, record: dict) -> None:
        if record.get("state") in JOB_STATES:
            job.state = record["state"]
        requested = _number(record.get("requested"))
        if requested is not None:
            job.requested = job.num_aggregators = int(requested)
        job.standalone = _number(record.get("standalone"))
        reverts = _number(record.get("reverts"))
        job.reverts = int(reverts) if reverts is not None else 0
        job.best_effort = record.get("best_effort") is True
        temps = record.get("temps")
        if isinstance(temps, list):
            job.temps = [a for a in temps if isinstance(a, str)]
        home = _name(record.get("home"))
        if home is not None:
            job.home = home
        if job.cluster is not None and job.cluster in self.state.clusters:     # from an older note
            self.state.clusters[job.cluster].jobs.discard(job.job)
        cluster = _name(record.get("cluster"))
        job.cluster = cluster
        if cluster is not None:
            self.state.cluster_named(cluster).jobs.add(job.job)
        log.info("job %s restored as %s%s (D=%s)", job.job, job.state,
                 f" in cluster {job.cluster}" if job.cluster else "", job.standalone)
