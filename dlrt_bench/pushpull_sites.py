"""Where ``autops bench pushpull`` runs its processes: this machine, or emulated hosts.

A site starts the AutoPS pool, starts worker processes (``pushpull_workers``) with pipes to
their stdin and stdout, and says where gloo's rank 0 listens. Both pools run a static pMaster
(no packing or migration while the data path is measured, ``MASTER_ARGS``).

* ``LocalSite``: pMaster and ``A`` aggregators on loopback (``autops.local.LocalPool``), the
  workers as local processes.
* ``EmulatedSite``: a ``dlrt_bench.testbed.Testbed`` of ``A + W`` hosts with shaped links:
  aggregator ``i`` on host ``i`` with pMaster beside aggregator 0 (``autops_hosts.HostPool``),
  worker ``r`` on host ``A + r``, gloo's rank 0 on worker host 0, so gloo runs among the same
  worker hosts over the same links. ``traffic()`` reads the links' byte counters per role.
"""
from __future__ import annotations

import subprocess
from typing import Sequence

from autops.local import LocalPool, free_port
from dlrt.procs import die_with_parent

from .autops_hosts import HostPool
from .testbed import DEFAULT_CONGESTION, HOST_IFNAME, Testbed, available, cleanup

__all__ = ["LocalSite", "EmulatedSite", "GLOO_PORT", "MASTER_ARGS", "emulation_unavailable"]

GLOO_PORT = 29500
# a static pMaster that gives aggregators busy allocating a large model's keys on a loaded
# machine time to heartbeat (failure detection is not what is measured)
MASTER_ARGS = ["--static", "--heartbeat-timeout", "30"]
PIPES = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}


class LocalSite:
    """Everything on this machine, over loopback, ipc or shared memory."""

    kind = "local"
    link = None
    delay = None
    congestion = None
    rps = None

    def __init__(self, aggregators: int, log_level: str = "WARNING",
                 aggregator_args: Sequence[str] | None = None) -> None:
        self.pool = LocalPool(aggregators, log_level=log_level, master_args=MASTER_ARGS,
                              aggregator_args=list(aggregator_args or []))

    def __enter__(self) -> "LocalSite":
        self.pool.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.stop()

    @property
    def master(self) -> str:
        return self.pool.master

    def gloo_init(self) -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    def service_pids(self) -> list[int]:
        """The aggregators' processes."""
        return [proc.pid for proc in self.pool.aggregators.values()]

    def start_worker(self, rank: int, argv: Sequence[str], env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(list(argv), env={**self.pool.env, **(env or {})}, preexec_fn=die_with_parent, **PIPES)

    def traffic(self) -> None:
        return None


class EmulatedSite:
    """Aggregators and workers each on an emulated host of their own, links shaped to ``link``."""

    kind = "emulated"

    def __init__(self, workers: int, aggregators: int, link: str | None, delay: str | None = None,
                 prefix: str = "apsb", log_level: str = "WARNING", congestion: str = DEFAULT_CONGESTION,
                 rps: bool = True) -> None:
        self.link, self.delay, self.congestion, self.rps = link, delay, congestion, rps
        self.tb = Testbed(aggregators + workers, link=link, delay=delay, prefix=prefix, congestion=congestion,
                          rps=rps)
        self.aggregator_hosts = self.tb.hosts[:aggregators]
        self.worker_hosts = self.tb.hosts[aggregators:]
        self.pool = HostPool(self.tb, self.aggregator_hosts, log_level=log_level, master_args=MASTER_ARGS)

    def __enter__(self) -> "EmulatedSite":
        cleanup(self.tb.prefix)               # what a killed earlier run left behind
        self.tb.up()
        try:
            self.pool.start()
        except BaseException:
            self.tb.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.pool.stop()
        finally:
            self.tb.down()

    @property
    def master(self) -> str:
        return self.pool.master

    def gloo_init(self) -> str:
        return f"tcp://{self.worker_hosts[0].addr}:{GLOO_PORT}"

    def service_pids(self) -> list[int]:
        return [proc.pid for proc in self.pool.aggregators.values()]

    def start_worker(self, rank: int, argv: Sequence[str], env: dict | None = None) -> subprocess.Popen:
        host = self.worker_hosts[rank]
        # gloo would take the address the hostname resolves to (loopback): use the host's link
        return host.popen(list(argv), env=host.env({"GLOO_SOCKET_IFNAME": HOST_IFNAME, **(env or {})}),
                          preexec_fn=die_with_parent, **PIPES)

    def traffic(self) -> dict[str, int]:
        """Bytes sent and received so far over the links of the worker and aggregator hosts."""
        out: dict[str, int] = {}
        for role, hosts in (("workers", self.worker_hosts), ("aggregators", self.aggregator_hosts)):
            counters = [self.tb.counters(host) for host in hosts]
            out[f"{role}_sent"] = sum(c.sent for c in counters)
            out[f"{role}_received"] = sum(c.received for c in counters)
        return out


def emulation_unavailable() -> str | None:
    """Why emulated hosts cannot be built here (``None``: they can)."""
    return available()
