"""Where pMaster's aggregators come from: one small interface, two providers.

* ``standby`` -- operators start ``autops aggregator --master ADDR`` on CPU machines; each
  registers and waits idle until pMaster gives it work. Capacity is the number registered
  and alive; releasing one only marks it idle again.
* ``local`` -- pMaster starts aggregator processes on this machine when it needs them (the
  embedded default of ``autops local`` and ``make demo``) up to ``max_aggregators``, and stops
  the ones it releases by pid (SIGTERM, then SIGKILL), and all of them when it stops. They are
  not tied to pMaster's life: killed, pMaster leaves them serving its jobs, each exiting by
  itself after ``--orphan-timeout`` without a pMaster. Each is recorded in the state directory
  (``poolfiles``), so a pMaster restarted there adopts them (it counts, stops and reaps them as
  its own) and ``autops local`` stops them at its end. ``reap`` collects the ones that exited, so
  none stays a zombie. Aggregators that registered on their own are used as well and are never
  stopped by it.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import subprocess
import sys

import psutil

from dlrt.procs import stop_found, stop_processes

from . import poolfiles
from ..config import DEFAULT_ORPHAN_TIMEOUT

log = logging.getLogger("autops.master.providers")


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

    def reap(self) -> None:
        """Collect the aggregators it started that exited (called from pMaster's loop)."""

    def close(self) -> None:
        pass


StandbyProvider = Provider


def aggregator_command(master: str, name: str, bind_host: str, log_level: str = "WARNING",
                       transport: str = "auto", orphan_timeout: float | None = None) -> list[str]:
    """The command line of an aggregator a provider starts (this Python, ``autops.cli``):
    registered with ``master`` as ``name``, listening on ``bind_host``; ``orphan_timeout``
    None: ``DEFAULT_ORPHAN_TIMEOUT``."""
    cmd = [sys.executable, "-m", "autops.cli", "--log-level", log_level, "aggregator",
           "--master", master, "--name", name, "--bind-host", bind_host]
    if transport != "auto":
        cmd += ["--transport", transport]
    return cmd + ["--orphan-timeout", str(DEFAULT_ORPHAN_TIMEOUT if orphan_timeout is None else orphan_timeout)]


class LocalProvider(Provider):
    """Aggregator processes on this machine, started on demand and stopped by pid."""

    kind = "local"

    def __init__(self, master: str, max_aggregators: int, log_level: str = "WARNING",
                 bind_host: str = "127.0.0.1", prefix: str = "local", transport: str = "auto",
                 state_dir: str | os.PathLike | None = None, orphan_timeout: float | None = None) -> None:
        """``state_dir``: where the aggregators it starts are recorded, and those a previous
        pMaster for the same address started are found and adopted (None: nowhere);
        ``orphan_timeout``: their ``--orphan-timeout`` (None: ``DEFAULT_ORPHAN_TIMEOUT``)."""
        if max_aggregators < 1:
            raise ValueError("the local provider needs --max-aggregators >= 1")
        self.master = master
        self.transport = transport          # the aggregators' --transport (cma: they also listen on it)
        self.max_aggregators = max_aggregators
        self.log_level = log_level
        self.bind_host = bind_host
        self.prefix = prefix
        self.state_dir = state_dir
        self.orphan_timeout = orphan_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping: dict[str, subprocess.Popen] = {}      # SIGTERMed, not reaped yet
        # started by an earlier pMaster for this address (not our children: init reaps them)
        self.adopted: dict[str, psutil.Process] = {}
        self.stopping_adopted: list[psutil.Process] = []
        first = 0
        if state_dir is not None:
            for name, (rec, proc) in poolfiles.running(state_dir).items():
                index = re.fullmatch(rf"{re.escape(prefix)}-(\d+)", name)
                if index:
                    first = max(first, int(index.group(1)) + 1)       # names stay unique
                if rec.master == master:
                    self.adopted[name] = proc
                    log.info("adopted aggregator %s (pid %d) started by an earlier pMaster", name, proc.pid)
        self._ids = itertools.count(first)

    def _started(self) -> int:
        return len(self.procs) + len(self.adopted)

    def capacity(self, registered: int) -> int | None:
        foreign = max(0, registered - self._started())
        return self.max_aggregators + foreign

    def reap(self) -> None:
        """Wait for (reap) the children that exited, stopped or not; forget the adopted ones
        that are gone."""
        for name, proc in list(self.stopping.items()):
            if proc.poll() is not None:
                del self.stopping[name]
                self._forget(name)
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                log.warning("aggregator %s (pid %d) exited with %s", name, proc.pid, proc.returncode)
                del self.procs[name]
                self._forget(name)
        for name, adopted in list(self.adopted.items()):
            if not _running(adopted):
                log.warning("aggregator %s (pid %d, adopted) exited", name, adopted.pid)
                del self.adopted[name]
                self._forget(name)
        self.stopping_adopted = [p for p in self.stopping_adopted if _running(p)]

    def _forget(self, name: str) -> None:
        """Remove the record of aggregator ``name``: it is gone, or stopping for good."""
        if self.state_dir is not None:
            poolfiles.forget(self.state_dir, name)

    def can_start(self, running: int) -> int:
        self.reap()
        return max(0, self.max_aggregators - self._started())

    def start(self, n: int) -> list[str]:
        names = []
        for _ in range(min(n, self.can_start(0))):
            name = f"{self.prefix}-{next(self._ids)}"
            cmd = aggregator_command(self.master, name, self.bind_host, log_level=self.log_level,
                                     transport=self.transport, orphan_timeout=self.orphan_timeout)
            # not tied to pMaster's life (no PR_SET_PDEATHSIG): it serves on when pMaster dies
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=dict(os.environ))
            self.procs[name] = proc
            if self.state_dir is not None:
                try:
                    poolfiles.record(self.state_dir, name, proc.pid, self.master)
                except (OSError, psutil.Error) as exc:
                    log.warning("aggregator %s (pid %d) could not be recorded in %s: %s", name, proc.pid,
                                self.state_dir, exc)
            log.info("started aggregator %s (pid %d)", name, proc.pid)
            names.append(name)
        return names

    def owns(self, name: str) -> bool:
        return name in self.procs or name in self.adopted

    def stop(self, name: str) -> bool:
        """SIGTERM (without waiting: the process is reaped later, SIGKILLed at close)."""
        adopted = self.adopted.pop(name, None)
        if adopted is not None:
            try:
                adopted.send_signal(signal.SIGTERM)
                self.stopping_adopted.append(adopted)
            except psutil.Error:
                pass
            self._forget(name)
            log.info("stopping aggregator %s (pid %d, adopted)", name, adopted.pid)
            return True
        proc = self.procs.pop(name, None)
        if proc is None:
            return False
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            self.stopping[name] = proc
        else:
            self._forget(name)
        log.info("stopping aggregator %s (pid %d)", name, proc.pid)
        return True

    def close(self) -> None:
        """Stop every aggregator it started or adopted, and remove their records."""
        children = {**self.procs, **self.stopping}
        stop_processes(children.values(), timeout=5.0)
        stop_found([*self.adopted.values(), *self.stopping_adopted], timeout=5.0)
        for name in [*children, *self.adopted]:
            self._forget(name)
        self.procs.clear()
        self.stopping.clear()
        self.adopted.clear()
        self.stopping_adopted.clear()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def make_provider(kind: str, master: str, max_aggregators: int | None = None,
                  log_level: str = "WARNING", transport: str = "auto",
                  state_dir: str | os.PathLike | None = None, orphan_timeout: float | None = None) -> Provider:
    if kind == "standby":
        return StandbyProvider()
    if kind == "local":
        return LocalProvider(master, max_aggregators or os.cpu_count() or 2, log_level=log_level,
                             transport=transport, state_dir=state_dir, orphan_timeout=orphan_timeout)
    raise ValueError(f"unknown aggregator provider {kind!r} (local or standby)")
