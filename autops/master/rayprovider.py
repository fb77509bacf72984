"""pMaster's Ray provider: aggregators as detached Ray actors, one CPU each, where CPUs are free.

``RayProvider`` decides; ``rayapi.RayAPI`` (given to it, a fake in unit tests) carries out.
Each aggregator is a detached actor (``dlrt.rayprocess.ProcessActor``) asking one CPU, named
``{prefix}-{8 hex digits of pMaster's address hash}-{n}`` in the ``autops`` namespace -- the
aggregator registers under the same name -- placed SPREAD over the nodes, or with a soft
affinity to a node when ``start(n, near=...)`` names one (a Ray node id or IP: near a job's
workers). The actor runs ``autops aggregator`` on its node, bound to the node's IP and with
the node's host id, and lives as long as that process, which dies with it. Actors are not
tied to pMaster's life: a pMaster killed leaves them serving its jobs, each aggregator
exiting after ``--orphan-timeout`` without a pMaster (and its actor with it), and a pMaster
restarted at the same address finds its predecessor's actors by name and adopts them (it
counts, stops and reaps them as its own), as the local provider adopts through poolfiles.

With ``--ray-resource NAME`` only nodes with that custom resource count, each aggregator
taking one unit of it besides its CPU ("CPUs" below then means units of NAME).

* ``capacity`` -- the CPUs of the alive nodes (each node's whole CPUs), at most
  ``max_aggregators``, plus the aggregators registered on their own;
* ``can_start`` -- the free CPUs Ray reports, less the actors it asked for that Ray has not
  placed yet, within ``max_aggregators``;
* ``stop`` -- SIGTERM to the aggregator (a clean exit, then its actor's); the actor is killed
  if it is still there ``kill_after`` seconds later;
* ``reap`` -- forgets the actors that are gone: exited, or lost with their node (logged;
  pMaster's failover sees the aggregator's heartbeats stop). An actor Ray has not placed
  within ``start_timeout`` (no free CPU after all) is killed and forgotten;
* ``close`` -- stops all of its aggregators (SIGTERM, then kills after ``kill_after``) and
  disconnects from Ray.
Ray is asked at most once per ``reap_period`` in ``reap`` (pMaster calls it every 0.2 s).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import math
import re
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from dlrt.rayconn import error_line

from .providers import Provider
from .rayapi import RayAPI, connect

log = logging.getLogger("autops.master.rayprovider")

REAP_PERIOD_S = 1.0
KILL_AFTER_S = 5.0
START_TIMEOUT_S = 60.0


def actor_prefix(prefix: str, master: str) -> str:
    """The start of the names of the actors a pMaster at ``master`` starts."""
    return f"{prefix}-{hashlib.sha256(master.encode()).hexdigest()[:8]}-"


@dataclass
class _Actor:
    started: float | None                    # None: adopted
    placed: dict[str, Any] | None = None     # where Ray runs it, once known


class RayProvider(Provider):
    """Aggregators as detached Ray actors, started on demand and stopped by name."""

    kind = "ray"

    def __init__(self, master: str, ray: RayAPI, max_aggregators: int | None = None, log_level: str = "WARNING",
                 transport: str = "auto", orphan_timeout: float | None = None, prefix: str = "ray",
                 start_timeout: float = START_TIMEOUT_S, kill_after: float = KILL_AFTER_S,
                 reap_period: float = REAP_PERIOD_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """``max_aggregators``: the most it runs (None: as many as the cluster has CPUs);
        ``orphan_timeout``: the aggregators' ``--orphan-timeout`` (None: the default)."""
        if max_aggregators is not None and max_aggregators < 1:
            raise ValueError("the ray provider needs --max-aggregators >= 1")
        self.master = master
        self.ray = ray
        self.max_aggregators = max_aggregators
        self.options = {"log_level": log_level, "transport": transport, "orphan_timeout": orphan_timeout}
        self.names = actor_prefix(prefix, master)
        self.start_timeout = start_timeout
        self.kill_after = kill_after
        self.reap_period = reap_period
        self.clock = clock
        self.sleep = sleep
        self.actors: dict[str, _Actor] = {}
        self.stopping: dict[str, float] = {}     # name -> when to kill it (inf: killed)
        first = 0
        for name in sorted(ray.live_actors(self.names)):
            index = re.fullmatch(re.escape(self.names) + r"(\d+)", name)
            if index is None:
                continue
            first = max(first, int(index.group(1)) + 1)       # names stay unique
            self.actors[name] = _Actor(None)
            log.info("adopted aggregator %s (a Ray actor an earlier pMaster started)", name)
        self._ids = itertools.count(first)
        self._next_reap = clock()

    def where(self, name: str) -> dict[str, Any] | None:
        """Where aggregator ``name`` runs (Ray node id and IP, its pid and its actor's), once known."""
        actor = self.actors.get(name)
        if actor is not None and actor.placed is None:
            actor.placed = self.ray.placed(name)
        return actor.placed if actor is not None else None

    def capacity(self, registered: int) -> int | None:
        cpus = sum(math.floor(node.cpus) for node in self.ray.nodes())
        foreign = max(0, registered - len(self.actors))
        return (cpus if self.max_aggregators is None else min(cpus, self.max_aggregators)) + foreign

    def can_start(self, running: int) -> int:
        self.reap()
        pending = sum(1 for name, a in self.actors.items() if a.started is not None and self.where(name) is None)
        room = math.floor(self.ray.free_cpus()) - pending
        if self.max_aggregators is not None:
            room = min(room, self.max_aggregators - len(self.actors))
        return max(0, room)

    def start(self, n: int, near: str | None = None) -> list[str]:
        """Start ``n`` aggregators (as many as there is room for); ``near``: a Ray node id or
        IP to place them on when it has free CPUs (else anywhere), None: spread."""
        node = self._node(near) if near is not None else None
        names = []
        for _ in range(min(n, self.can_start(0))):
            name = f"{self.names}{next(self._ids)}"
            try:
                self.ray.start_actor(name, self.master, self.options, node)
            except Exception as exc:              # Ray unreachable, the name taken: none started now
                log.warning("aggregator %s could not be started through Ray: %s", name, error_line(exc))
                break
            self.actors[name] = _Actor(self.clock())
            log.info("started aggregator %s (Ray actor%s)", name, f" near node {node}" if node else "")
            names.append(name)
        return names

    def _node(self, near: str) -> str | None:
        """The id of the alive Ray node ``near`` names (its id or IP), None when none does."""
        nodes = self.ray.nodes()
        found = next((n.node_id for n in nodes if n.node_id == near), None) \
            or next((n.node_id for n in nodes if n.ip == near), None)
        if found is None:
            log.info("no alive Ray node %s: aggregators spread instead", near)
        return found

    def owns(self, name: str) -> bool:
        return name in self.actors

    def stop(self, name: str) -> bool:
        """SIGTERM to its aggregator (without waiting: the actor is killed at ``reap`` or
        ``close`` if still there ``kill_after`` seconds later)."""
        if self.actors.pop(name, None) is None:
            return False
        self.ray.signal(name, signal.SIGTERM)
        self.stopping[name] = self.clock() + self.kill_after
        log.info("stopping aggregator %s (Ray actor)", name)
        return True

    def reap(self) -> None:
        """Forget the actors that are gone, kill those stopped too long ago or never placed."""
        now = self.clock()
        if now < self._next_reap:
            return
        self._next_reap = now + self.reap_period
        try:
            live = self.ray.live_actors(self.names)
        except Exception as exc:                  # Ray's control store unreachable for now
            log.warning("Ray did not answer: %s", error_line(exc))
            return
        for name, deadline in list(self.stopping.items()):
            if name not in live:
                del self.stopping[name]
                self.ray.forget(name)
            elif now >= deadline:
                self._kill(name)
        for name, actor in list(self.actors.items()):
            if name not in live:
                del self.actors[name]
                self._gone(name, actor.placed)
                self.ray.forget(name)
            elif actor.started is not None and now - actor.started > self.start_timeout and self.where(name) is None:
                log.warning("aggregator %s: Ray placed its actor nowhere within %.0f s (no free CPU): given up",
                            name, self.start_timeout)
                del self.actors[name]
                self._kill(name)

    def _kill(self, name: str) -> None:
        self.ray.kill(name)
        self.stopping[name] = math.inf

    def _gone(self, name: str, placed: dict[str, Any] | None) -> None:
        node = (placed or {}).get("node_id")
        if node is not None and node not in {n.node_id for n in self.ray.nodes()}:
            log.warning("aggregator %s is gone with its Ray node %s (%s), which left the cluster",
                        name, node, placed.get("ip"))
        else:
            log.warning("aggregator %s (Ray actor) exited", name)

    def close(self) -> None:
        """Stop every aggregator it started or adopted (SIGTERM, then kill after
        ``kill_after`` seconds) and disconnect from Ray."""
        try:
            for name in self.actors:
                self.ray.signal(name, signal.SIGTERM)
            waiting = {*self.actors, *self.stopping}
            deadline = self.clock() + self.kill_after
            while waiting:
                waiting &= self.ray.live_actors(self.names)
                if not waiting or self.clock() >= deadline:
                    break
                self.sleep(0.1)
            for name in waiting:
                self.ray.kill(name)
        except Exception as exc:                  # Ray gone: the aggregators end by --orphan-timeout
            log.warning("could not stop the aggregators through Ray: %s", error_line(exc))
        finally:
            self.actors.clear()
            self.stopping.clear()
            self.ray.close()


def ray_provider(master: str, address: str | None, every_interface: bool = False, resource: str | None = None,
                 **options: Any) -> RayProvider:
    """A ``RayProvider`` for a pMaster at ``master`` on the Ray cluster at ``address``
    (``rayapi.connect``; its errors are one line); ``every_interface``: pMaster listens on
    every interface (``master`` names loopback), so its aggregators are told the address Ray
    knows this machine by; ``resource``: the custom resource that marks the nodes lending
    aggregators (``RayAPI``); ``options``: ``RayProvider``'s."""
    ray = connect(address, resource=resource)
    if every_interface:
        master = master.replace("127.0.0.1", ray.node_ip(), 1)
    return RayProvider(master, ray, **options)

