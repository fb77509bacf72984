"""Changing a running job's AutoPS aggregator count without a restart.

An allocation policy's round may give a running job another number of aggregators; the master
then asks pMaster to spread (or pack) the job's keys over that many, which pMaster's live
migration does while the job trains. The ask goes through the ``autops migrate --count N``
command, a process of its own as the jobs are (Tiresias imports no AutoPS code; the command
presents the operator token of the key directory, ``DLRT_KEYS``). Asks run in the background
so that a slow pMaster never holds a scheduling pass; ``poll`` hands back those that ended.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

DEFAULT_TIMEOUT_S = 20.0


@dataclass
class Resized:
    """One ask that ended: ``got`` aggregators (None when it failed, with ``error``)."""
    key: Hashable
    job: str
    asked: int
    got: int | None
    error: str = ""


class AggregatorResizer:
    """Asks pMaster at ``master`` to resize jobs' aggregator sets, one process per ask."""

    def __init__(self, master: str, timeout: float = DEFAULT_TIMEOUT_S,
                 command: Sequence[str] = (sys.executable, "-m", "autops.cli")) -> None:
        self.master = master
        self.timeout = timeout
        self.command = list(command)
        self._running: dict[Hashable, tuple[subprocess.Popen, str, int, float]] = {}

    def ask(self, key: Hashable, job: str, count: int) -> None:
        """Spread ``job``'s keys over ``count`` aggregators; a newer ask under ``key`` replaces
        one still running."""
        self._end(key)
        proc = subprocess.Popen([*self.command, "migrate", "--master", self.master, "--job", job,
                                 "--count", str(int(count)), "--json", "-"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True)
        self._running[key] = (proc, job, int(count), time.monotonic())

    def poll(self) -> list[Resized]:
        """The asks that ended (or overran ``timeout`` and were stopped) since the last call."""
        out = []
        for key, (proc, job, count, began) in list(self._running.items()):
            if proc.poll() is None and time.monotonic() - began < self.timeout:
                continue
            overran = proc.poll() is None
            self._end(key)
            stdout, stderr = proc.communicate()
            if overran:
                out.append(Resized(key, job, count, None, f"no answer within {self.timeout:g} s"))
            elif proc.returncode != 0:
                lines = (stderr or stdout or "").strip().splitlines()
                out.append(Resized(key, job, count, None, lines[-1] if lines else f"exit {proc.returncode}"))
            else:
                try:
                    got = int(json.loads(stdout)["aggregators"])
                except (ValueError, KeyError, TypeError):
                    out.append(Resized(key, job, count, None, f"unreadable answer {stdout[:200]!r}"))
                    continue
                out.append(Resized(key, job, count, got))
        return out

    def pending(self) -> int:
        return len(self._running)

    def _end(self, key: Hashable) -> None:
        entry = self._running.pop(key, None)
        if entry is not None and entry[0].poll() is None:
            entry[0].kill()
            entry[0].wait()

    def close(self) -> None:
        for key in list(self._running):
            self._end(key)
