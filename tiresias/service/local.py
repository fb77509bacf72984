"""The local executor (the embedded default): ``--nodes NxG`` emulated nodes on this machine.

Each run gets a supervisor process (``tiresias.service.supervisor``) in a session of its own
that starts the node commands, each in its own process group, and writes how the run ended
to ``RUN_DIR/exit.json``. Nothing of a run lives in the master's memory that a restarted
master cannot find again: ``reconcile`` reads the run dirs, checks that the supervisor is
still alive (by pid and command line, so a recycled pid is not mistaken for it) and adopts
it. No GPU is needed: ``CUDA_VISIBLE_DEVICES`` is set from the placement all the same.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from .executor import LaunchSpec, NodeInfo, RunEnd
from dlrt.procs import kill_tree, signal_group

from .supervisor import read_json, write_json

SUPERVISOR = "tiresias.service.supervisor"


class LocalExecutor:
    name = "local"

    def __init__(self, nodes: int, gpus_per_node: int) -> None:
        self._nodes = [NodeInfo(f"node{i}", gpus_per_node) for i in range(nodes)]
        self._runs: dict[tuple[int, int], dict[str, Any]] = {}      # tracked: (job, run) -> handle
        self._children: dict[int, subprocess.Popen] = {}            # supervisors we started (to reap)

    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def launch(self, spec: LaunchSpec) -> dict[str, Any]:
        os.makedirs(spec.run_dir, exist_ok=True)
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
        return ended

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
        return RunEnd(job_id, run, None, lost=True, detail="its supervisor died without recording an exit status")


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
