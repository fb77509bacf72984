"""The embedded setup: ``dlrt cluster up`` without ``--ray``, every service a process here.

pMaster with the local provider, one Infiniswap daemon and the Tiresias master with the
local executor (``[tiresias] nodes`` emulated here), all bound to ``[cluster] host``
(127.0.0.1 by default) and wired as ``plan`` says. Each is started in a session of its own,
its output appended to ``STATE/logs/NAME.log``, and recorded (pid and start time) in
``STATE/cluster.json`` as soon as it runs, so that ``down`` finds everything ``up`` started,
also after a Ctrl-C half-way. ``up`` starts one service at a time and waits until it
answers before the next (the next one reads its reports); a service that exits or stays
silent ends ``up`` with one line naming it and its log, and stops the ones already started.
``down`` stops them in the reverse order (SIGTERM, SIGKILL after a grace period), then any
process one of them left behind (e.g. aggregators it started). A recorded pid is only
signalled while its start time matches, so a pid the kernel gave to another program since
is never touched. ``up`` and ``down`` hold ``STATE/owner.lock`` (``dlrt.statelock``) while
they run: two at once on one state directory is refused.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from typing import Any, Callable

import psutil

from dlrt import statelock
from dlrt.hostid import host_id
from dlrt.procs import stop_found

from . import plan
from .config import ClusterConfig
from .probe import probe, wait_until_answers

log = logging.getLogger("dlrt_cluster.local")

RECORD = "cluster.json"
STOP_GRACE_S = 15.0


def record_path(state_dir: str) -> str:
    return os.path.join(state_dir, RECORD)


def read_record(state_dir: str) -> dict[str, Any] | None:
    """What ``up`` recorded in ``state_dir`` (None: nothing, or not the embedded setup's)."""
    try:
        with open(record_path(state_dir), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("mode") == "local" else None


def _write_record(state_dir: str, record: dict[str, Any]) -> None:
    path = record_path(state_dir)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)


def process_of(entry: dict[str, Any]) -> psutil.Process | None:
    """The recorded service's process while it runs (same pid and start time), else None."""
    try:
        proc = psutil.Process(int(entry["pid"]))
        if abs(proc.create_time() - float(entry["created"])) > 0.05 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None


def _log_tail(path: str, lines: int = 1) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            tail = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(tail[-lines:])


def _stop(proc: psutil.Process, grace: float) -> None:
    """Stop ``proc`` (SIGTERM, SIGKILL after ``grace`` s), then what it left behind."""
    try:
        left = proc.children(recursive=True)
    except psutil.Error:
        left = []
    stop_found([proc], grace)
    stop_found([p for p in left if p.is_running()], grace)


class LocalCluster:
    """The embedded setup in ``config``'s state directory."""

    def __init__(self, config: ClusterConfig, log_level: str = "INFO", grace: float = STOP_GRACE_S,
                 say: Callable[[str], None] = lambda line: None) -> None:
        """``say``: where progress lines go (the CLI prints them)."""
        self.config = config
        self.state_dir = config.cluster.state_dir
        self.log_level = log_level
        self.grace = grace
        self.say = say

    def services(self) -> list[plan.Service]:
        """What the embedded setup runs, wired."""
        host = self.config.cluster.host
        me = host_id()
        autops = plan.pmaster(self.config, host, log_level=self.log_level)
        daemon = plan.daemon(self.config, host, report_host=me, log_level=self.log_level)
        nodes = {node: me for node in plan.local_nodes(self.config.tiresias.nodes)}
        tiresias = plan.tiresias(self.config, host, autops, [daemon], nodes, log_level=self.log_level)
        return [autops, daemon, tiresias]

    def up(self) -> list[dict[str, Any]]:
        """Start every service, each answering before the next starts; the status rows."""
        with statelock.acquire(self.state_dir, "dlrt cluster up",
                               hint="another `dlrt cluster up` or `down` runs on it"):
            record = read_record(self.state_dir)
            running = [e["name"] for e in (record or {}).get("services", []) if process_of(e)]
            if running:
                raise RuntimeError(f"already up in {self.state_dir} ({', '.join(running)}): see `dlrt cluster "
                                   "status`, or `dlrt cluster down` first")
            record = {"mode": "local", "state": self.state_dir, "started": time.time(), "services": []}
            try:
                for service in self.services():
                    self._start(service, record)
            except BaseException:
                self._stop_all(record)
                raise
        return self.status()

    def _start(self, service: plan.Service, record: dict[str, Any]) -> None:
        os.makedirs(os.path.dirname(service.log), exist_ok=True)
        started = time.monotonic()
        with open(service.log, "ab") as out:
            proc = subprocess.Popen(service.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        entry = {"name": service.name, "kind": service.kind, "pid": proc.pid,
                 "created": psutil.Process(proc.pid).create_time(), "endpoint": service.endpoint,
                 "log": service.log, "argv": service.argv}
        record["services"].append(entry)
        _write_record(self.state_dir, record)

        def gone() -> str | None:
            code = proc.poll()
            if code is None:
                return None
            tail = _log_tail(service.log)
            return f"{service.name} exited with code {code} before answering" + (f": {tail}" if tail else "") \
                + f" (log: {service.log})"
        try:
            said = wait_until_answers(service.kind, service.endpoint, gone, self.config.cluster.start_timeout)
        except RuntimeError as exc:
            msg = str(exc)
            raise RuntimeError(msg if msg.startswith(service.name) else f"{service.name}: {msg} (log: {service.log})") \
                from None
        self.say(f"{service.name}: pid {proc.pid}, {service.endpoint}, answers in "
                 f"{time.monotonic() - started:.1f} s ({said})")

    def _stop_all(self, record: dict[str, Any]) -> list[str]:
        stopped = []
        for entry in reversed(record.get("services", [])):
            proc = process_of(entry)
            if proc is not None:
                _stop(proc, self.grace)
                stopped.append(entry["name"])
                self.say(f"{entry['name']}: stopped (pid {entry['pid']})")
        try:
            os.unlink(record_path(self.state_dir))
        except FileNotFoundError:
            pass
        return stopped

    def down(self) -> list[str]:
        """Stop what ``up`` started (the reverse order); the names of those that ran."""
        with statelock.acquire(self.state_dir, "dlrt cluster down",
                               hint="another `dlrt cluster up` or `down` runs on it"):
            record = read_record(self.state_dir)
            return self._stop_all(record) if record else []

    def status(self) -> list[dict[str, Any]]:
        """One row per recorded service: where it runs, whether it runs and answers."""
        rows = []
        for entry in (read_record(self.state_dir) or {}).get("services", []):
            running = process_of(entry) is not None
            answers, said = probe(entry["kind"], entry["endpoint"]) if running else (False, "not running")
            rows.append({"name": entry["name"], "kind": entry["kind"], "where": f"pid {entry['pid']}",
                         "endpoint": entry["endpoint"], "running": running, "answers": answers,
                         "detail": said, "log": entry["log"]})
        return rows
