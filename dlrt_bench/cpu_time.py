"""The machine's CPU time by kind over a benchmark run (``/proc/stat``'s first line: every
CPU together), sampled on a thread and attributed to time windows afterwards: how much of a
window the VM's host took from this machine (``steal``), how much stayed idle, how much the
machine's own processes and kernel used. On a shared VM a slow iteration with steal in it
was made, at least in part, by the host."""
from __future__ import annotations

import os
from typing import Callable

from .autops_elastic import proc_counters, stat_counters
from .sampler import PeriodicSampler, read_text

# /proc/stat's columns after "cpu", in order (proc(5))
COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def read_cpu(path: str = "/proc/stat", read: Callable[[str], str] = read_text) -> dict[str, int]:
    """The clock ticks every CPU together spent in each of ``COLUMNS`` so far (``read``: how
    the file's text is read, a sampler's ``ProcFiles.read``)."""
    for line in read(path).splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return {k: int(v) for k, v in zip(COLUMNS, fields[1:])}
    raise ValueError(f"{path}: no 'cpu' line")


def thread_cpu(pid: int, tick_ms: float = TICK_MS, read: Callable[[str], str] = read_text) -> dict[str, float]:
    """CPU ms of process ``pid``'s threads so far, by thread name (``/proc/PID/task/TID/stat``;
    threads of one name summed, the main thread as ``main``, threads gone since left out);
    empty when the process is gone."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            text = read(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        name = "main" if tid == str(pid) else text[text.index("(") + 1:text.rindex(")")]
        out[name] = out.get(name, 0.0) + stat_counters(text)[0] * tick_ms
    return out


def cpu_delta(a: dict[str, int], b: dict[str, int], tick_ms: float = TICK_MS) -> dict[str, float]:
    """Milliseconds of CPU between readings ``a`` and ``b``: taken by the host (``steal_ms``),
    idle (``idle_ms``: idle and waiting for I/O) and used here (``busy_ms``: the rest)."""
    d = {k: b.get(k, 0) - a.get(k, 0) for k in COLUMNS}
    idle = d["idle"] + d["iowait"]
    busy = sum(d.values()) - idle - d["steal"]
    return {"steal_ms": round(d["steal"] * tick_ms, 1), "idle_ms": round(idle * tick_ms, 1),
            "busy_ms": round(busy * tick_ms, 1)}


class CpuSampler(PeriodicSampler):
    """``read_cpu`` (and the CPU seconds of ``pids``: name -> pid) every ``interval`` seconds;
    ``window(t0, t1)`` is ``cpu_delta`` with ``by_process``: name -> CPU ms in the window, for
    the processes alive at both ends, and with ``threads`` also ``by_thread``: name -> thread
    name -> CPU ms (``thread_cpu``; threads that used none left out)."""

    name = "cpu-time"

    def __init__(self, interval: float = 0.02, path: str = "/proc/stat", pids: dict[str, int] | None = None,
                 threads: bool = False) -> None:
        super().__init__(interval)
        self.path = path
        self.pids = dict(pids or {})
        self.threads = threads

    def read(self) -> dict:
        got = {"machine": read_cpu(self.path, self.files.read),
               "processes": {name: cpu for name, (cpu, _) in proc_counters(self.pids, self.files.read).items()}}
        if self.threads:
            got["threads"] = {name: thread_cpu(pid, read=self.files.read) for name, pid in self.pids.items()}
        return got

    def delta(self, a: dict, b: dict) -> dict:
        procs_a, procs_b = a.get("processes", {}), b.get("processes", {})
        out = {**cpu_delta(a.get("machine", {}), b.get("machine", {})),
               "by_process": {n: round(1e3 * (procs_b[n] - procs_a[n]), 1) for n in procs_b if n in procs_a}}
        if self.threads:
            threads_a, threads_b = a.get("threads", {}), b.get("threads", {})
            out["by_thread"] = {
                n: {t: round(ms - threads_a[n].get(t, 0.0), 1) for t, ms in threads_b[n].items()
                    if ms > threads_a[n].get(t, 0.0)}
                for n in threads_b if n in threads_a}
        return out
