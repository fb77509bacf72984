"""The local executor (the embedded default): ``--nodes NxG`` emulated nodes on this machine.

Each run gets a supervisor process (``tiresias.service.supervisor``) in a session of its own
that starts the node commands, each in its own process group, and writes how the run ended
to ``RUN_DIR/exit.json``; the executor reaps every supervisor it started (``poll``), so a
master that has run many jobs holds no zombie. Nothing of a run lives in the master's memory
that a restarted master cannot find again: ``reconcile`` reads the run dirs, checks that the
supervisor is still alive (by pid and command line, so a recycled pid is not mistaken for it)
and adopts it. No GPU is needed: ``CUDA_VISIBLE_DEVICES`` is set from the placement all the same.

A run whose supervisor died without recording how it ended is lost, but its node commands
may still run: before reporting it lost (the master then starts it again), the executor stops
the process groups the run recorded in ``groups.json`` (SIGTERM, SIGKILL after
``LOST_GRACE_S``; over later polls, so the master never blocks) and removes its memory cgroups.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil

from dlrt.procs import kill_tree, signal_group

from .cgroup import CgroupError, MemoryLimit, run_cgroup_name
from .executor import LaunchSpec, NodeInfo, RunEnd
from .supervisor import read_json, write_json

SUPERVISOR = "tiresias.service.supervisor"
LOST_GRACE_S = 5.0          # SIGTERM to SIGKILL for what a lost run left running


class LocalExecutor:
    name = "local"

    def __init__(self, nodes: int, gpus_per_node: int) -> None:
        self._nodes = [NodeInfo(f"node{i}", gpus_per_node) for i in range(nodes)]
        self._runs: dict[tuple[int, int], dict[str, Any]] = {}      # tracked: (job, run) -> handle
        self._children: dict[int, subprocess.Popen] = {}            # supervisors we started (to reap)
        self._exiting: list[subprocess.Popen] = []                  # ended runs' supervisors, not yet reaped
        self._stopping: dict[tuple[int, int], float] = {}           # lost runs being stopped: SIGKILL deadline

    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def launch(self, spec: LaunchSpec) -> dict[str, Any]:
        os.makedirs(spec.run_dir, mode=0o700, exist_ok=True)
        for stale in ("exit.json", "groups.json"):
            try:
                os.unlink(os.path.join(spec.run_dir, stale))
            except FileNotFoundError:
                pass
        write_json(os.path.join(spec.run_dir, "spec.json"), spec.to_dict())
        proc = subprocess.Popen([sys.executable, "-m", SUPERVISOR, spec.run_dir], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=open(os.path.join(spec.run_dir, "supervisor.err"), "ab"),
                                start_new_session=True, close_fds=True)
        self._children[proc.pid] = proc
        with open(os.path.join(spec.run_dir, "supervisor.pid"), "w") as f:
            f.write(str(proc.pid))
        handle = {"supervisor": proc.pid, "run_dir": spec.run_dir}
        self._runs[(spec.job_id, spec.run)] = handle
        return handle

    def terminate(self, job_id: int, run: int, handle: dict[str, Any], force: bool = False) -> None:
        sig = signal.SIGKILL if force else signal.SIGTERM
        groups = read_json(os.path.join(handle["run_dir"], "groups.json")) or {}
        if force and _alive(handle["supervisor"]):
            kill_tree(handle["supervisor"])           # workers in sessions of their own too
        for pgid in groups.get("groups", []):
            signal_group(pgid, sig)

    def poll(self) -> list[RunEnd]:
        ended = []
        for (job_id, run), handle in list(self._runs.items()):
            end = self._ended(job_id, run, handle)
            if end is not None:
                del self._runs[(job_id, run)]
                ended.append(end)
                self._retire(handle["supervisor"])
        self._exiting = [proc for proc in self._exiting if proc.poll() is None]     # reaps the exited
        return ended

    def _retire(self, pid: int) -> None:
        """An ended run's supervisor (ours): reaped now, or by a later ``poll`` once it has
        exited (it writes ``exit.json`` just before), so none is left a zombie."""
        child = self._children.pop(pid, None)
        if child is not None and child.poll() is None:
            self._exiting.append(child)

    def reconcile(self, runs: dict[tuple[int, int], dict[str, Any]]) -> list[RunEnd]:
        ended = []
        for (job_id, run), handle in runs.items():
            end = self._ended(job_id, run, handle)
            if end is None:
                self._runs[(job_id, run)] = handle
            else:
                ended.append(end)
        return ended

    def close(self) -> None:
        self._runs.clear()

    def _ended(self, job_id: int, run: int, handle: dict[str, Any]) -> RunEnd | None:
        record = read_json(os.path.join(handle["run_dir"], "exit.json"))
        if record is not None:
            return RunEnd(job_id, run, record.get("exit_code"), bool(record.get("stopped")),
                          detail=record.get("detail", ""))
        pid = handle["supervisor"]
        child = self._children.get(pid)
        if child is not None:                # ours: Popen knows, also before it has exec'd
            if child.poll() is None:
                return None
            del self._children[pid]
        elif _alive(pid):
            return None
        record = read_json(os.path.join(handle["run_dir"], "exit.json"))   # written as it exited
        if record is not None:
            return RunEnd(job_id, run, record.get("exit_code"), bool(record.get("stopped")))
        if not self._orphans_stopped((job_id, run), handle["run_dir"]):
            return None
        detail = "its supervisor died without recording an exit status"
        problem = remove_run_cgroups(handle["run_dir"])
        return RunEnd(job_id, run, None, lost=True, detail=f"{detail}; {problem}" if problem else detail)

    def _orphans_stopped(self, key: tuple[int, int], run_dir: str) -> bool:
        """Stop the process groups a lost run recorded: SIGTERM now, SIGKILL once the grace
        is over; True when none is left (or SIGKILL has been sent)."""
        groups = _recorded_groups(run_dir)
        deadline = self._stopping.get(key)
        if deadline is None:
            self._stopping[key] = time.monotonic() + LOST_GRACE_S
            sig = signal.SIGTERM
        else:
            sig = signal.SIGKILL if time.monotonic() >= deadline else 0
        if sig == signal.SIGKILL:
            for pgid in groups:
                kill_tree(pgid)                  # workers in sessions of their own too
        alive = [pgid for pgid in groups if signal_group(pgid, sig)]
        if alive and sig != signal.SIGKILL:
            return False
        self._stopping.pop(key, None)
        return True


def _recorded_groups(run_dir: str) -> list[int]:
    """The process groups a run recorded in ``groups.json``, less any whose leader's pid now
    belongs to another process (a pid is not reused while its process group exists)."""
    record = read_json(os.path.join(run_dir, "groups.json")) or {}
    groups = record.get("groups", [])
    started = record.get("started") or [None] * len(groups)
    ours = []
    for pgid, at in zip(groups, started):
        try:
            if at is not None and abs(psutil.Process(pgid).create_time() - at) > 0.01:
                continue                         # recycled: the leader and its group are gone
        except psutil.Error:
            pass                                 # leader gone; the group (if any) is still the run's
        ours.append(pgid)
    return ours


def remove_run_cgroups(run_dir: str) -> str:
    """Remove the memory cgroups of a run (killing what is left in them); '' or what failed."""
    spec = read_json(os.path.join(run_dir, "spec.json"))
    if not spec or not spec.get("memory_bytes"):
        return ""
    problems = []
    for rank in range(len(spec.get("placement", []))):
        limit = MemoryLimit.existing(run_cgroup_name(run_dir, spec["job_id"], spec["run"], rank))
        try:
            if limit is not None:
                limit.remove()
        except CgroupError as exc:
            problems.append(str(exc))
    return "; ".join(problems)


def _alive(pid: int) -> bool:
    """Is ``pid`` a live supervisor (not a zombie, not a recycled pid)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and SUPERVISOR.encode() in cmdline
