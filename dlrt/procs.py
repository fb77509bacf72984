"""Stopping the processes a program started: politely first, then for sure.

``stop_processes`` asks a set of ``subprocess.Popen`` children to stop (SIGTERM), waits
for all of them against one deadline and kills what is left; ``join_or_kill`` does the
same for ``multiprocessing`` children; ``signal_group`` and ``kill_tree`` reach a
process group or every descendant of a process, ignoring processes already gone. Only
processes this program started are ever signalled (callers pass their own children).
``die_with_parent`` ties a child to its parent's life; ``name_this_thread`` gives a helper
thread a name the kernel and its tools see.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, Iterable

import psutil

__all__ = ["stop_processes", "stop_found", "join_or_kill", "signal_group", "kill_tree", "die_with_parent", "exit_on_sigterm"]


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 5.0,
                   sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to every child still running, wait up to ``timeout`` seconds for all of
    them together, then SIGKILL and reap the ones that did not exit."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_found(procs: Iterable[psutil.Process], timeout: float = 5.0) -> None:
    """``stop_processes`` for processes found rather than started (``psutil.Process``, e.g. from
    a pid file): SIGTERM each, wait up to ``timeout`` for all together, SIGKILL the rest and
    wait for them (reaping those that are this process's children)."""
    procs = list(procs)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def join_or_kill(procs: Iterable[Any], timeout: float = 10.0) -> None:
    """Join ``multiprocessing.Process`` children against one deadline; kill the stragglers."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; ``False`` when it is gone (or not ours to signal)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_tree(root: int, sig: int = signal.SIGKILL, include_root: bool = False) -> int:
    """Signal every descendant of ``root`` (all collected first, then signalled); returns
    how many were signalled."""
    try:
        proc = psutil.Process(root)
        procs = proc.children(recursive=True) + ([proc] if include_root else [])
    except psutil.Error:
        return 0
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
    return len(procs)


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
THREAD_NAME_MAX = 15        # bytes of a thread's name the kernel keeps (comm, without the NUL)


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (``PR_SET_PDEATHSIG``),
    so no service outlives the pool, test or benchmark that started it. Usable as a
    ``preexec_fn``. If the parent already died before the request took effect, the signal
    is sent now. ``False`` when the kernel refused."""
    import ctypes
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def name_this_thread(name: str | None = None) -> bool:
    """Give the calling thread ``name`` (default: its Python name) as the kernel knows it
    (``/proc/PID/task/TID/comm``, what ``top -H``, ``ps -L`` and profilers show; its first
    ``THREAD_NAME_MAX`` bytes), so a helper thread's CPU can be told from its process's main
    loop. Python's thread names stay inside Python. ``False`` when the kernel refused."""
    import ctypes
    import threading
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:THREAD_NAME_MAX]
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread, so that a command stopped
    that way unwinds like one stopped with Ctrl-C: its ``finally`` blocks and context
    managers stop the processes, namespaces and files it made."""
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
