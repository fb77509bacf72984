"""``dlrt cluster up --ray ADDR``: the services as detached Ray actors on an existing Ray cluster.

This process joins the cluster as a driver (``dlrt.rayconn.join``, namespace ``dlrt``) and
starts, each as a detached ``dlrt.rayprocess.ProcessActor`` asking no CPU (the CPUs are for
aggregators and jobs), in this order and each answering before the next:

1. ``dlrt-autops-master`` on this node: pMaster with the Ray provider (its aggregators are
   Ray actors where CPUs are free, or on nodes with ``[autops] ray_resource``);
2. ``dlrt-infiniswap-<node id>`` on every alive node (or only on those with ``[infiniswap]
   ray_resource``): a daemon lending that node's memory, bound to its IP, reporting under
   its host id;
3. ``dlrt-tiresias-master`` on this node: the Ray executor, pMaster's and every daemon's
   reports, and ``--node-host`` mapping each GPU node's Tiresias name to the host id of the
   daemon on it.

Keys: every service node must hold the same cluster key directory (docs/security.md); each
actor tells its node's key fingerprint (``dlrt.keys.fingerprint``) and ``up`` refuses, naming
the node, when one differs from this machine's or this machine has none. Nothing secret
crosses Ray. A service that fails to start or answer ends ``up`` with one line, and what it
started is stopped. ``status`` asks each actor where it runs and probes its endpoint;
``down`` asks each to stop (SIGTERM: pMaster stops its aggregators) in the reverse order,
kills what is left after the grace period, then any aggregator actor of that pMaster still
there. Tiresias' job actors are left running: the next master adopts them.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable

from dlrt.keys import fingerprint, key_dir
from dlrt.rayconn import error_line, join
from dlrt.rayprocess import NODE_IP, ProcessActor

from . import plan
from .config import ClusterConfig
from .probe import probe, wait_until_answers

log = logging.getLogger("dlrt_cluster.onray")

NAMESPACE = "dlrt"
PREFIX = "dlrt-"
AUTOPS_NAMESPACE = "autops"
STOP_GRACE_S = 15.0
PLACE_TIMEOUT_S = 60.0


class RayCluster:
    """The setup on the Ray cluster at ``address`` (this process becomes its driver)."""

    def __init__(self, config: ClusterConfig, address: str, log_level: str = "INFO", grace: float = STOP_GRACE_S,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.config = config
        self.address = address
        self.log_level = log_level
        self.grace = grace
        self.say = say
        self.ray = join(address, NAMESPACE, "dlrt cluster --ray")
        self.actor = self.ray.remote(ProcessActor)

    def close(self) -> None:
        self.ray.shutdown()

    # ---- what runs ----

    def names(self) -> list[str]:
        """The setup's actors alive (or starting) in the ``dlrt`` namespace, in start order."""
        names = [n for n in self.ray.util.list_named_actors() if n.startswith(PREFIX)]
        return sorted(names, key=lambda n: (next((i for i, k in enumerate(plan.ORDER) if n[len(PREFIX):]
                                                  .startswith(k)), 9), n))

    def where(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        """What actor ``name`` tells of itself (``ProcessActor.where``); ``RuntimeError`` if it
        cannot (gone, or not answering within ``timeout``)."""
        try:
            handle = self.ray.get_actor(name, namespace=NAMESPACE)
            return self.ray.get(handle.where.remote(), timeout=timeout)
        except ValueError:
            raise RuntimeError(f"{name} is gone") from None
        except Exception as exc:                 # RayActorError, GetTimeoutError
            raise RuntimeError(f"{name} did not start: {error_line(exc)}") from None

    # ---- up ----

    def up(self) -> list[dict[str, Any]]:
        running = self.names()
        if running:
            raise RuntimeError(f"already up on the Ray cluster at {self.address} ({', '.join(running)}): see "
                               "`dlrt cluster status --ray ADDR`, or `dlrt cluster down --ray ADDR` first")
        keys = fingerprint()
        if keys is None:
            raise RuntimeError(f"no cluster keys in {key_dir()}: run `dlrt keys init` and copy that directory to "
                               "every node of the Ray cluster (docs/security.md) before `dlrt cluster up --ray`")
        here = self.ray.get_runtime_context().get_node_id()
        ip = self.ray.util.get_node_ip_address()
        started: list[str] = []
        try:
            autops = plan.pmaster(self.config, ip, ray_address=self.address, log_level=self.log_level)
            self._start(autops, "dlrt-autops-master", here, keys, started)
            daemons, node_hosts = [], {}
            lenders = [n for n in self._alive() if not self.config.infiniswap.ray_resource
                       or (n.get("Resources") or {}).get(self.config.infiniswap.ray_resource)]
            for node in lenders:
                name = f"{PREFIX}infiniswap-{node['NodeID'][:8]}"
                placed = self._start(plan.daemon(self.config, NODE_IP, name=name[len(PREFIX):],
                                                 log_level=self.log_level), name, node["NodeID"], keys, started,
                                     wait=False)
                daemons.append((name, placed))
            filled = []
            for name, placed in daemons:
                self._wait(name, plan.INFINISWAP, placed)
                filled.append(plan.Service(name, plan.INFINISWAP, placed["argv"], placed["endpoint"], placed["log"],
                                           {"reports": placed["reports"]}))
            from tiresias.service.ray_executor import node_name
            hosts = {p["node_id"]: p["host_id"] for _, p in daemons}
            for node in self._alive():
                if (node.get("Resources") or {}).get("GPU") and node["NodeID"] in hosts:
                    node_hosts[node_name(node)] = hosts[node["NodeID"]]
            tiresias = plan.tiresias(self.config, ip, autops, filled, node_hosts, ray_address=self.address,
                                     log_level=self.log_level)
            self._start(tiresias, "dlrt-tiresias-master", here, keys, started)
        except BaseException:
            self._stop(list(reversed(started)))
            raise
        return self.status()

    def _alive(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def _start(self, service: plan.Service, name: str, node_id: str, keys: str, started: list[str],
               wait: bool = True) -> dict[str, Any]:
        """Start ``service`` as actor ``name`` on node ``node_id``; its ``where`` once placed
        (and, with ``wait``, once it answers)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        info = {"kind": service.kind, "endpoint": service.endpoint, **service.extra}
        self.actor.options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=0,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                           ).remote(service.argv, name, None, service.log, info)
        started.append(name)
        placed = self.where(name, timeout=PLACE_TIMEOUT_S)
        if placed.get("keys") != keys:
            raise RuntimeError(f"node {placed['ip']} ({placed['host_id']}) holds "
                               + ("no cluster keys" if placed.get("keys") is None else "other cluster keys")
                               + f" than this machine ({key_dir()}): copy this directory to every node "
                               "(docs/security.md)")
        if wait:
            self._wait(name, service.kind, placed)
        return placed

    def _wait(self, name: str, kind: str, placed: dict[str, Any]) -> None:
        began = time.monotonic()

        def gone() -> str | None:
            return None if name in self.names() else f"{name} exited before answering (log on {placed['ip']}: " \
                                                     f"{placed.get('log')})"
        try:
            said = wait_until_answers(kind, placed["endpoint"], gone, self.config.cluster.start_timeout)
        except RuntimeError as exc:
            msg = str(exc)
            raise RuntimeError(msg if msg.startswith(name) else f"{name}: {msg}") from None
        self.say(f"{name}: on {placed['ip']} ({placed['host_id']}), {placed['endpoint']}, answers in "
                 f"{time.monotonic() - began:.1f} s ({said})")

    # ---- down, status ----

    def _stop(self, names: list[str]) -> list[str]:
        stopped, pmaster = [], None
        for name in names:
            try:
                handle = self.ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue
            if name == f"{PREFIX}autops-master":
                try:
                    pmaster = self.ray.get(handle.where.remote(), timeout=5)["endpoint"]
                except Exception:                # gone meanwhile; its aggregators end by --orphan-timeout
                    pass
            handle.signal.remote(int(signal.SIGTERM))
            deadline = time.monotonic() + self.grace
            while name in self.names() and time.monotonic() < deadline:
                time.sleep(0.2)
            if name in self.names():
                log.warning("%s did not stop within %.0f s: killed", name, self.grace)
                self.ray.kill(handle, no_restart=True)
            stopped.append(name)
            self.say(f"{name}: stopped")
        if pmaster is not None:
            self._kill_aggregators(pmaster)
        return stopped

    def _kill_aggregators(self, pmaster: str) -> None:
        """Kill the aggregator actors pMaster at ``pmaster`` left (it stops them on SIGTERM)."""
        from autops.master.rayprovider import actor_prefix
        prefix = actor_prefix("ray", pmaster)
        for entry in self.ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == AUTOPS_NAMESPACE and entry.get("name", "").startswith(prefix):
                try:
                    self.ray.kill(self.ray.get_actor(entry["name"], namespace=AUTOPS_NAMESPACE), no_restart=True)
                    self.say(f"aggregator {entry['name']}: killed")
                except ValueError:
                    pass

    def down(self) -> list[str]:
        return self._stop(list(reversed(self.names())))

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for name in self.names():
            try:
                placed = self.where(name, timeout=5.0)
            except RuntimeError as exc:
                rows.append({"name": name, "kind": "", "where": "", "endpoint": "", "running": False,
                             "answers": False, "detail": str(exc)})
                continue
            answers, said = probe(placed["kind"], placed["endpoint"])
            rows.append({"name": name, "kind": placed["kind"], "where": f"{placed['ip']} ({placed['host_id']}), "
                         f"pid {placed['pid']}", "endpoint": placed["endpoint"], "running": True,
                         "answers": answers, "detail": said, "log": placed.get("log")})
        return rows
