"""A Ray actor that is one long-running process on its Ray node (``ProcessActor``).

The runtime's services run on a Ray cluster as detached actors of this class: pMaster's
aggregators (``autops.master.rayapi``), and what ``dlrt cluster up`` starts (pMaster, the
Tiresias master, one Infiniswap daemon per node). On creation the actor starts its command
on the node it landed on, with the node's environment (the ``DLRT_HOST_ID`` and ``DLRT_KEYS``
its ``ray start`` had), after replacing in every argument

* ``{node_ip}`` -- the node's IP as Ray knows it (services bind and advertise it), and
* ``{host_id}`` -- the node's host id (``dlrt.hostid``: what "same machine" means to the
  transports and the reports).

The actor watches its process and exits when the process exits; the process dies with the
actor (``PR_SET_PDEATHSIG`` SIGTERM, asked from the actor's main thread, which lives as long
as the actor's worker process), so killing the actor or losing its node ends the process.
``signal`` asks for a clean stop (SIGTERM: the process exits, then the actor).
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
from typing import Any, Sequence

from .hostid import host_id
from .keys import fingerprint
from .procs import die_with_parent

log = logging.getLogger("dlrt.rayprocess")

NODE_IP = "{node_ip}"
HOST_ID = "{host_id}"


def fill(argv: Sequence[str], node_ip: str, host: str) -> list[str]:
    """``argv`` with ``{node_ip}`` and ``{host_id}`` replaced (nothing else is touched)."""
    return [str(arg).replace(NODE_IP, node_ip).replace(HOST_ID, host) for arg in argv]


class ProcessActor:
    """One process on this Ray node, for as long as the actor lives."""

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None,
                 log_path: str | None = None, info: dict[str, str] | None = None) -> None:
        """``env``: added to the node's environment; ``log_path``: the process's stdout and
        stderr (appended; None: the actor's own, in Ray's logs); ``info``: more entries that
        ``where()`` returns, such as the service's endpoint, with the same placeholders filled
        in as in ``argv``."""
        import ray
        ctx = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        host = host_id()
        self.argv = fill(argv, ip, host)
        out = None
        if log_path:
            os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
            out = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT if out else None,
                                         env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)
        finally:
            if out is not None:
                out.close()
        filled = dict(zip(info or {}, fill((info or {}).values(), ip, host)))
        self.placed = {**filled, "name": name, "node_id": ctx.get_node_id(), "ip": ip, "host_id": host,
                       "pid": self.proc.pid, "actor_pid": os.getpid(), "keys": fingerprint(),
                       "argv": self.argv, "log": log_path}
        threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True).start()

    def where(self) -> dict[str, Any]:
        """The Ray node (id, IP, host id), the process's pid, the actor's, the node's key
        fingerprint (``dlrt.keys.fingerprint``), the command line, its log and ``info``."""
        return self.placed

    def signal(self, sig: int) -> None:
        """Signal the process (SIGTERM: a clean stop, after which the actor exits too)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def _watch(self) -> None:
        code = self.proc.wait()
        log.info("%s (pid %d) exited with %s: its actor exits", self.placed["name"], self.proc.pid, code)
        import ray
        ray.actor.exit_actor()
