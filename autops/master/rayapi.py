"""The few Ray calls pMaster's Ray provider makes, over the real ``ray`` module.

``connect(address)`` checks the address (one line when nothing answers there, instead of
``ray.init`` retrying for minutes: ``dlrt.rayconn``), joins the cluster as a driver in the
``autops`` namespace and returns a ``RayAPI``. ``RayAPI`` only carries out: alive nodes and
their CPUs, the free CPUs, the live named actors, creating an aggregator actor (detached,
one CPU, SPREAD or soft affinity to a node), where an actor landed, signalling and killing
one. What to start, stop and forget is ``rayprovider``'s; unit tests give it a fake of this.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dlrt.rayconn import join

from dlrt.rayprocess import NODE_IP, ProcessActor

from .providers import aggregator_command

log = logging.getLogger("autops.master.rayapi")

NAMESPACE = "autops"


@dataclass(frozen=True)
class RayNode:
    """An alive Ray node: its id, IP and CPUs (or units of the provider's resource)."""
    node_id: str
    ip: str
    cpus: float


class RayAPI:
    """Ray as the provider sees it (this process is a driver connected to the cluster)."""

    def __init__(self, ray: Any, namespace: str = NAMESPACE, resource: str | None = None) -> None:
        """``resource``: a custom resource that marks the nodes lending aggregators: each takes
        one unit of it as well as one CPU, and only it is counted (None: CPUs)."""
        self.ray = ray
        self.namespace = namespace
        self.resource = resource or "CPU"
        self._actor = ray.remote(ProcessActor)
        self._handles: dict[str, Any] = {}
        self._where: dict[str, Any] = {}           # name -> the pending ``where`` call
        self._placed: dict[str, dict[str, Any]] = {}

    def nodes(self) -> list[RayNode]:
        return [RayNode(n["NodeID"], n["NodeManagerAddress"], float((n.get("Resources") or {}).get(self.resource, 0)))
                for n in self.ray.nodes() if n.get("Alive")]

    def node_ip(self) -> str:
        """The address Ray knows this machine by."""
        return self.ray.util.get_node_ip_address()

    def free_cpus(self) -> float:
        free = self.ray.available_resources()
        return float(min(free.get("CPU", 0), free.get(self.resource, 0)))

    def live_actors(self, prefix: str) -> set[str]:
        """The names starting with ``prefix`` of the actors alive (or starting) in the namespace."""
        return {name for name in self.ray.util.list_named_actors() if name.startswith(prefix)}

    def start_actor(self, name: str, master: str, options: dict[str, Any], node_id: str | None = None) -> None:
        """A detached actor ``name`` running one aggregator (``aggregator_command`` bound to its
        node's IP): SPREAD, or near ``node_id`` (soft)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        strategy = "SPREAD" if node_id is None else NodeAffinitySchedulingStrategy(node_id, soft=True)
        handle = self._actor.options(name=name, namespace=self.namespace, lifetime="detached", num_cpus=1,
                                     resources={} if self.resource == "CPU" else {self.resource: 1},
                                     max_restarts=0, scheduling_strategy=strategy).remote(
            aggregator_command(master, name, NODE_IP, **options), name)
        self._handles[name] = handle
        self._where[name] = handle.where.remote()

    def placed(self, name: str) -> dict[str, Any] | None:
        """``{"node_id", "ip", "pid", "actor_pid"}`` once actor ``name`` runs, else None (never blocks)."""
        if name in self._placed:
            return self._placed[name]
        ref = self._where.get(name)
        if ref is None:
            handle = self._handle(name)
            if handle is None:
                return None
            ref = self._where[name] = handle.where.remote()
        ready, _ = self.ray.wait([ref], timeout=0)
        if not ready:
            return None
        del self._where[name]
        try:
            self._placed[name] = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:          # died first: the provider sees it gone
            log.debug("actor %s: %s", name, exc)
            return None
        return self._placed[name]

    def signal(self, name: str, sig: int) -> None:
        """Signal actor ``name``'s aggregator (not waiting for it)."""
        handle = self._handle(name)
        if handle is not None:
            handle.signal.remote(int(sig))

    def kill(self, name: str) -> None:
        handle = self._handle(name)
        if handle is not None:
            try:
                self.ray.kill(handle, no_restart=True)
            except Exception as exc:                 # already gone
                log.debug("ray.kill %s: %s", name, exc)

    def forget(self, name: str) -> None:
        """Drop what is kept about actor ``name`` (it is gone)."""
        for kept in (self._handles, self._where, self._placed):
            kept.pop(name, None)

    def _handle(self, name: str) -> Any | None:
        if name not in self._handles:
            try:
                self._handles[name] = self.ray.get_actor(name, namespace=self.namespace)
            except ValueError:                       # gone
                return None
        return self._handles[name]

    def close(self) -> None:
        """Disconnect this driver (detached actors live on)."""
        for kept in (self._handles, self._where, self._placed):
            kept.clear()
        self.ray.shutdown()


def connect(address: str | None, namespace: str = NAMESPACE, timeout: float = 5.0,
            resource: str | None = None) -> RayAPI:
    """Join the Ray cluster at ``address`` (``dlrt.rayconn.join``; its errors are one line)."""
    return RayAPI(join(address, namespace, "the ray provider", timeout), namespace, resource)
