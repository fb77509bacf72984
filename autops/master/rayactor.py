"""The Ray actor that is one aggregator on a Ray node (``rayprovider`` creates it, Ray runs it).

On creation it starts the same program as everywhere else, ``python -m autops.cli aggregator
--master ADDR --name NAME --bind-host <this node's IP>`` (``providers.aggregator_command``),
with the node's own environment: the aggregator's endpoints are the node's address and its
host id is the node's (``dlrt.hostid``: the node's hostname and boot id, or the
``DLRT_HOST_ID`` its ``ray start`` was given), so workers on the node reach it through shared
memory and others over TCP. It registers with pMaster like any other aggregator.

The actor watches its process and exits when the process exits; the process dies with the
actor (``PR_SET_PDEATHSIG`` SIGTERM, asked from the actor's main thread, which lives as long
as the actor's worker process), so killing the actor or losing its node ends the aggregator.
``signal`` asks for a clean stop (SIGTERM: the aggregator exits, then the actor).
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
from typing import Any

from dlrt.procs import die_with_parent

from .providers import aggregator_command

log = logging.getLogger("autops.master.rayactor")


class AggregatorActor:
    """One aggregator process on this Ray node, for as long as the actor lives."""

    def __init__(self, master: str, name: str, options: dict[str, Any]) -> None:
        """``options``: the rest of ``aggregator_command``'s arguments (log level, transport,
        orphan timeout)."""
        import ray
        ctx = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        self.proc = subprocess.Popen(aggregator_command(master, name, ip, **options), stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        self.placed = {"node_id": ctx.get_node_id(), "ip": ip, "pid": self.proc.pid, "actor_pid": os.getpid()}
        threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True).start()

    def where(self) -> dict[str, Any]:
        """The Ray node, its IP, the aggregator's pid and this actor's."""
        return self.placed

    def signal(self, sig: int) -> None:
        """Signal the aggregator (SIGTERM: a clean stop, after which the actor exits too)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def _watch(self) -> None:
        code = self.proc.wait()
        log.info("aggregator (pid %d) exited with %s: its actor exits", self.proc.pid, code)
        import ray
        ray.actor.exit_actor()
