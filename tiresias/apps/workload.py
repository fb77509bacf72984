"""Pollux workload files (``workloads/workload-N.csv``) as a list of submitted jobs.

Columns ``name,time,application,num_replicas,batch_size``: one job per row, submitted at
``time`` seconds, asking for ``num_replicas`` GPUs at global batch ``batch_size``. Job ids are
the row order from 0.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WorkloadJob", "load_workload", "COLUMNS"]

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


@dataclass(frozen=True)
class WorkloadJob:
    job_id: int
    name: str
    submit_time: float
    application: str
    num_replicas: int
    batch_size: int


def _job(job_id: int, row: dict[str, str]) -> WorkloadJob:
    job = WorkloadJob(job_id, row["name"], float(row["time"]), row["application"],
                      int(row["num_replicas"]), int(row["batch_size"]))
    if job.submit_time < 0 or job.num_replicas < 1 or job.batch_size < 1 or not job.application:
        raise ValueError("time must be >= 0, num_replicas and batch_size >= 1, application named")
    return job


def load_workload(path: str | Path) -> list[WorkloadJob]:
    """Read a workload CSV; a bad row raises ValueError naming the file and line."""
    path = Path(path)
    try:
        f = open(path, newline="")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the workload: {exc.strerror or exc}") from None
    with f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}:1: missing columns {','.join(missing)}")
        jobs = []
        for row in reader:
            line = reader.line_num
            try:
                jobs.append(_job(len(jobs), row))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: bad row {dict(row)}: {exc}") from None
    return jobs
