"""The per-run supervisor of the local executor: ``python -m tiresias.service.supervisor RUN_DIR``.

Started by the master in a session of its own, so a run outlives a master crash. It reads
``RUN_DIR/spec.json`` (a ``LaunchSpec``), starts every node's command in a process group of
its own (``CUDA_VISIBLE_DEVICES`` from the placement, a rendezvous port on 127.0.0.1 for a
job spanning nodes, output into a pipe the supervisor copies to the job's log through
``joblog.CappedLog``, rotated at the spec's ``max_log_bytes``, a memory cgroup when the job declared
its memory, as the OS user ``run_as`` when the spec names one: the supervisor stays root, the
node commands drop to that user before they enter the job's workdir and exec, and a workdir
that user cannot enter fails the run with one message whether or not it exists), records the process groups in ``RUN_DIR/groups.json``, waits, and records how
the run ended in ``RUN_DIR/exit.json`` — which is how a restarted master learns it. A full
disk never loses that record: the supervisor retries writing it (``EXIT_RETRY_S`` apart) until
space returns, and stays alive (so the run is not taken for lost) meanwhile; output written
while the disk is full is dropped and counted in the log once space returns.

When one node's command fails, the others are stopped (SIGTERM, then SIGKILL). SIGTERM or
SIGINT to the supervisor is passed on to every node's process group.

Launchers such as torchrun start their workers in sessions of their own, so a process group
does not hold a whole run. The supervisor therefore makes itself the child subreaper
(``PR_SET_CHILD_SUBREAPER``): workers orphaned by a killed launcher come to it, not to init,
and ``kill_tree`` (also what the executor's SIGKILL uses) reaches every descendant. When the
run is over, whatever is left of it is killed.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import psutil

from dlrt.procs import kill_tree, signal_group

from . import cgroup, runas
from .executor import LaunchSpec, node_command, node_env
from .joblog import NO_SPACE, CappedLog, start_pump

KILL_AFTER_S = 10.0
PUMP_DRAIN_S = 5.0               # after the run: how long the log pump may take to reach EOF
EXIT_RETRY_S = 1.0               # between tries to record the run's end on a full disk
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass                                     # not Linux: orphans go to init as usual


def write_json(path: str, data: Any, retry: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename), mode 0600 (a run's spec
    holds the job's secret). ``retry``: on a full disk, try again every ``EXIT_RETRY_S`` until
    it is written (a run's end is never dropped)."""
    tmp = f"{path}.tmp{os.getpid()}"
    while True:
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not retry or exc.errno not in NO_SPACE:
                raise
            try:
                print(f"supervisor: cannot write {path} ({exc.strerror}); retrying in {EXIT_RETRY_S:g} s",
                      file=sys.stderr, flush=True)
            except OSError:
                pass                                 # supervisor.err is on the same full disk
            time.sleep(EXIT_RETRY_S)


def read_json(path: str) -> Any | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _create_time(pid: int) -> float | None:
    """When ``pid`` started (so a recycled pid is never taken for a group leader of the run)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Supervisor:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        spec = read_json(os.path.join(run_dir, "spec.json"))
        if spec is None:
            raise SystemExit(f"supervisor: no readable spec.json in {run_dir}")
        self.spec = LaunchSpec.from_dict(spec)
        self.procs: list[subprocess.Popen] = []
        self.cgroups: list[cgroup.MemoryLimit] = []
        self.signalled = False
        self.log = CappedLog(self.spec.log_path, self.spec.max_log_bytes)
        self.pump = None

    def _log(self, text: str) -> None:
        self.log.write((text + "\n").encode())

    def start(self) -> None:
        spec = self.spec
        port = free_port()
        nodes = ", ".join(f"{n}[{','.join(map(str, g))}]" for n, g in spec.placement)
        self._log(f"=== tiresias: run {spec.run} of job {spec.job_id} on {nodes} at "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===")
        read_end, write_end = os.pipe()
        os.set_inheritable(write_end, False)       # Popen dups it onto the children's stdout/stderr
        self.pump = start_pump(self.log, read_end)
        acct = runas.account(spec.run_as) if spec.run_as else None
        try:
            if acct is not None and not runas.can_enter(acct, spec.workdir):
                raise RuntimeError(runas.cannot_enter(acct, spec.workdir))    # checked as the user, never as root
            self._spawn(spec, acct, port, write_end)
        finally:
            os.close(write_end)                    # the children hold it; EOF once they are all gone
        write_json(os.path.join(self.run_dir, "groups.json"),
                   {"supervisor": os.getpid(), "groups": [p.pid for p in self.procs],
                    "started": [_create_time(p.pid) for p in self.procs]}, retry=True)

    def _spawn(self, spec: LaunchSpec, acct, port: int, out: int) -> None:
        for rank in range(len(spec.placement)):
            limit = None
            if spec.memory_bytes:
                limit = cgroup.MemoryLimit.create(cgroup.run_cgroup_name(self.run_dir, spec.job_id, spec.run, rank),
                                                  spec.memory_bytes)
                self.cgroups.append(limit)
            first = limit.join_self if limit is not None else None
            proc = subprocess.Popen(node_command(spec, rank, "127.0.0.1", port),
                                    env=node_env(spec, rank, "127.0.0.1", port),
                                    cwd=spec.workdir if acct is None else None,     # as the user: dropper
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    preexec_fn=runas.dropper(acct, first, spec.workdir) if acct is not None else first)
            self.procs.append(proc)

    def finish_log(self) -> None:
        """Wait (bounded) for the pump to copy what the run's processes wrote last."""
        if self.pump is not None:
            self.pump.join(PUMP_DRAIN_S)

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                signal_group(p.pid, sig)

    def _reap_orphans(self) -> None:
        """Reap exited orphans that came to us (never the node commands: Popen reaps those)."""
        roots = {p.pid for p in self.procs}
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for child in children:
            if child.pid in roots:
                continue
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                pass

    def wait(self) -> dict[str, Any]:
        codes: list[int | None] = [None] * len(self.procs)
        failed_at = None
        while any(c is None for c in codes):
            for i, p in enumerate(self.procs):
                if codes[i] is None and p.poll() is not None:
                    codes[i] = p.returncode
                    if p.returncode != 0 and failed_at is None:
                        failed_at = time.monotonic()
                        self.signal_all(signal.SIGTERM)       # one node failed: stop the others
            if failed_at is not None and time.monotonic() - failed_at > KILL_AFTER_S:
                self.signal_all(signal.SIGKILL)
                kill_tree(os.getpid())
            self._reap_orphans()
            time.sleep(0.05)
        while kill_tree(os.getpid()):                 # what the run left behind
            time.sleep(0.05)
            self._reap_orphans()
        for limit in self.cgroups:
            limit.remove()
        stopped_file = self.spec.env.get("TIRESIAS_STOPPED_FILE")
        nonzero = [c for c in codes if c != 0]
        return {"exit_code": nonzero[0] if nonzero else 0, "codes": codes, "ended": time.time(),
                "stopped": bool(stopped_file) and os.path.exists(stopped_file)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tiresias.service.supervisor RUN_DIR", file=sys.stderr)
        return 2
    sup = Supervisor(argv[0])

    def forward(signum, frame) -> None:
        sup.signal_all(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    become_subreaper()
    try:
        sup.start()
    except Exception as exc:                     # a command that cannot start is a failed run
        sup.signal_all(signal.SIGKILL)
        sup.finish_log()
        sup._log(f"=== tiresias: run {sup.spec.run} could not start: {exc} ===")
        write_json(os.path.join(argv[0], "exit.json"), {"exit_code": 127, "codes": [], "ended": time.time(),
                                                         "stopped": False, "detail": str(exc)}, retry=True)
        return 1
    result = sup.wait()
    sup.finish_log()
    sup._log(f"=== tiresias: run {sup.spec.run} ended with exit code {result['exit_code']}"
             f"{' (stopped on request)' if result['stopped'] else ''} ===")
    write_json(os.path.join(argv[0], "exit.json"), result, retry=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
