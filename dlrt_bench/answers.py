"""The worker processes of a benchmark: their answers (one JSON line per worker per request, on
their stdout) and their end (``stop`` on stdin, then whatever still runs is stopped)."""
from __future__ import annotations

import json
import selectors
import subprocess
import time

from dlrt.procs import stop_processes


def read_answers(procs: list[subprocess.Popen], timeout: float, label: str) -> list[dict]:
    """One JSON line from every worker, by rank; ``RuntimeError`` on an error, an exit or no
    answer within ``timeout`` seconds (``label`` names the group in the message)."""
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for rank, proc in enumerate(procs):
            sel.register(proc.stdout, selectors.EVENT_READ, rank)
        while len(got) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{label} workers did not answer within {timeout:.0f}s")
            for key, _ in sel.select(left):
                rank = key.data
                line = procs[rank].stdout.readline()
                if not line:
                    raise RuntimeError(f"{label} worker {rank} exited with {procs[rank].wait()}")
                answer = json.loads(line)
                if "error" in answer:
                    raise RuntimeError(answer["error"])
                got[rank] = answer
                sel.unregister(procs[rank].stdout)
    return [got[r] for r in range(len(procs))]


def stop_workers(procs: list[subprocess.Popen], timeout: float) -> None:
    """Ask every worker to leave (``stop``), wait up to ``timeout`` s, then stop the rest."""
    for proc in procs:
        try:
            proc.stdin.write(b"stop\n")
            proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    stop_processes(procs)
