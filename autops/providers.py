"""Where pMaster's aggregators come from: one small interface, two providers.

* ``standby`` -- operators start ``autops aggregator --master ADDR`` on CPU machines; each
  registers and waits idle until pMaster gives it work. Capacity is the number registered
  and alive; releasing one only marks it idle again.
* ``local`` -- pMaster starts aggregator processes on this machine when it needs them (the
  embedded default of ``autops local`` and ``make demo``) up to ``max_aggregators``, and stops
  the ones it releases by pid (SIGTERM, then SIGKILL). Aggregators that registered on their
  own are used as well and are never stopped by it.
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys

from dlrt.procs import die_with_parent, stop_processes

log = logging.getLogger("autops.providers")


class Provider:
    """Base: a provider that cannot start aggregators (standby)."""

    kind = "standby"

    def capacity(self, registered: int) -> int | None:
        """Most aggregators the pool can hold; ``registered`` is how many are alive now."""
        return registered

    def can_start(self, running: int) -> int:
        """How many more aggregators ``start`` could create now."""
        return 0

    def start(self, n: int) -> list[str]:
        """Start ``n`` aggregators; returns their names (they register by themselves)."""
        return []

    def owns(self, name: str) -> bool:
        return False

    def stop(self, name: str) -> bool:
        """Stop an aggregator this provider started; False when it is not one of them."""
        return False

    def close(self) -> None:
        pass


StandbyProvider = Provider


class LocalProvider(Provider):
    """Aggregator processes on this machine, started on demand and stopped by pid."""

    kind = "local"

    def __init__(self, master: str, max_aggregators: int, log_level: str = "WARNING",
                 bind_host: str = "127.0.0.1", prefix: str = "local", transport: str = "auto") -> None:
        if max_aggregators < 1:
            raise ValueError("the local provider needs --max-aggregators >= 1")
        self.master = master
        self.transport = transport          # the aggregators' --transport (cma: they also listen on it)
        self.max_aggregators = max_aggregators
        self.log_level = log_level
        self.bind_host = bind_host
        self.prefix = prefix
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping: list[subprocess.Popen] = []
        self._ids = itertools.count()

    def capacity(self, registered: int) -> int | None:
        foreign = max(0, registered - len(self.procs))
        return self.max_aggregators + foreign

    def _reap(self) -> None:
        self.stopping = [p for p in self.stopping if p.poll() is None]
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                log.warning("aggregator %s (pid %d) exited with %s", name, proc.pid, proc.returncode)
                del self.procs[name]

    def can_start(self, running: int) -> int:
        self._reap()
        return max(0, self.max_aggregators - len(self.procs))

    def start(self, n: int) -> list[str]:
        names = []
        for _ in range(min(n, self.can_start(0))):
            name = f"{self.prefix}-{next(self._ids)}"
            cmd = [sys.executable, "-m", "autops.cli", "--log-level", self.log_level, "aggregator",
                   "--master", self.master, "--name", name, "--bind-host", self.bind_host]
            if self.transport != "auto":
                cmd += ["--transport", self.transport]
            self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=dict(os.environ),
                                                preexec_fn=die_with_parent)
            log.info("started aggregator %s (pid %d)", name, self.procs[name].pid)
            names.append(name)
        return names

    def owns(self, name: str) -> bool:
        return name in self.procs

    def stop(self, name: str) -> bool:
        """SIGTERM (without waiting: the process is reaped later, SIGKILLed at close)."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return False
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            self.stopping.append(proc)
        log.info("stopping aggregator %s (pid %d)", name, proc.pid)
        return True

    def close(self) -> None:
        stop_processes([*self.procs.values(), *self.stopping], timeout=5.0)
        self.procs.clear()
        self.stopping.clear()


def make_provider(kind: str, master: str, max_aggregators: int | None = None,
                  log_level: str = "WARNING", transport: str = "auto") -> Provider:
    if kind == "standby":
        return StandbyProvider()
    if kind == "local":
        return LocalProvider(master, max_aggregators or os.cpu_count() or 2, log_level=log_level,
                             transport=transport)
    raise ValueError(f"unknown aggregator provider {kind!r} (local or standby)")
