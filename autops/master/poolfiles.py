"""pMaster's small records on disk: the aggregator processes a local provider started (one
small JSON file per process in ``STATE_DIR/aggregators/`` with its name, pid, start time and
pMaster's address), and the tenant each live job belongs to (``JobTenants``).

Aggregators outlive a pMaster that dies (``orphan``), so whoever must stop them later finds
them here: a pMaster restarted on the same state directory adopts them (``LocalProvider``), and
``autops local`` stops them when its command ends (``stop_recorded``). A record names a process
only while a process with that pid, that start time and an aggregator's command line runs (pids
are reused); records of processes that are gone are removed as they are read.

A job's tenant (the CURVE key name its first registration came with, ``pool.tenant_of``) is
kept in ``STATE_DIR/job_tenants.json`` next to the jobs' secret hashes (``jobauth``), for as
long as those: a restarted pMaster that adopts a job from its aggregators still knows whose
it is, refuses its registration from another tenant and names the tenant to aggregators again.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from dlrt.procs import stop_found

log = logging.getLogger("autops.master.poolfiles")

DIRNAME = "aggregators"
TENANTS_FILE = "job_tenants.json"
START_SLACK_S = 0.05          # start times read by two processes agree to this much


@dataclass(frozen=True)
class Record:
    name: str
    pid: int
    started: float              # the process's start time (psutil ``create_time``)
    master: str                 # the pMaster it was started for


def records_dir(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / DIRNAME


def record(state_dir: str | os.PathLike, name: str, pid: int, master: str) -> Record:
    """Write the record of aggregator process ``pid`` (started for ``master``) as ``name``."""
    rec = Record(name, pid, psutil.Process(pid).create_time(), master)
    folder = records_dir(state_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = folder / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec.__dict__, f)
    os.replace(tmp, folder / f"{name}.json")
    return rec


def forget(state_dir: str | os.PathLike, name: str) -> None:
    """Remove the record of ``name`` (no error when there is none)."""
    try:
        (records_dir(state_dir) / f"{name}.json").unlink()
    except FileNotFoundError:
        pass


def process_of(rec: Record) -> psutil.Process | None:
    """The running process ``rec`` names, or None when it is gone (or the pid is another's now)."""
    try:
        proc = psutil.Process(rec.pid)
        if abs(proc.create_time() - rec.started) > START_SLACK_S or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if "aggregator" not in proc.cmdline():
            return None
        return proc
    except psutil.Error:
        return None


def running(state_dir: str | os.PathLike) -> dict[str, tuple[Record, psutil.Process]]:
    """The recorded aggregators still running, by name; the other records are removed."""
    out: dict[str, tuple[Record, psutil.Process]] = {}
    folder = records_dir(state_dir)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            rec = Record(str(data["name"]), int(data["pid"]), float(data["started"]), str(data["master"]))
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("unreadable aggregator record %s removed", path)
            path.unlink(missing_ok=True)
            continue
        proc = process_of(rec)
        if proc is None:
            path.unlink(missing_ok=True)
        else:
            out[rec.name] = (rec, proc)
    return out


def stop_recorded(state_dir: str | os.PathLike, timeout: float = 5.0) -> list[int]:
    """Stop every recorded aggregator still running and remove the records; their pids."""
    found = running(state_dir)
    stop_found([proc for _, proc in found.values()], timeout)
    for name in found:
        forget(state_dir, name)
    if found:
        log.info("stopped aggregator(s) %s left behind by a pMaster", sorted(found))
    return [rec.pid for rec, _ in found.values()]


class JobTenants:
    """The tenant of each live job (None: no tenant), by job id: in memory, and in
    ``STATE_DIR/job_tenants.json`` (0600, replaced whole at each change: at a job's first
    registration and at its release) when ``state_dir`` is given. A file that cannot be read
    is logged and ignored: the jobs then take their tenant from their next registration."""

    def __init__(self, state_dir: str | os.PathLike | None = None) -> None:
        self.path = Path(state_dir) / TENANTS_FILE if state_dir is not None else None
        self._tenants: dict[str, str | None] = self._load()

    def _load(self) -> dict[str, str | None]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a map")
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable job tenants %s: %s", self.path, exc)
            return {}
        return {job: tenant for job, tenant in data.items() if tenant is None or isinstance(tenant, str)}

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(f".{TENANTS_FILE}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self._tenants, f)
            os.replace(tmp, self.path)
        except OSError as exc:     # kept in memory: only a restart would forget it
            log.warning("cannot record job tenants in %s: %s", self.path, exc)

    def jobs(self) -> list[str]:
        """The job ids with a recorded tenant (or a recorded absence of one)."""
        return sorted(self._tenants)

    def known(self, job: str) -> bool:
        return job in self._tenants

    def get(self, job: str) -> str | None:
        return self._tenants.get(job)

    def record(self, job: str, tenant: str | None) -> None:
        """``job`` belongs to ``tenant`` (None: no tenant)."""
        if job not in self._tenants or self._tenants[job] != tenant:
            self._tenants[job] = tenant
            self._save()

    def forget(self, job: str) -> None:
        """``job`` was released: its id is free again."""
        if job in self._tenants:
            del self._tenants[job]
            self._save()
