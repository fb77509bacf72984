"""The services ``dlrt cluster up`` starts and their command lines, wired together (pure).

One ``Service`` per process: pMaster (``autops``), one Infiniswap daemon per machine that
lends memory (``infiniswap``, several with Ray), the Tiresias master (``tiresias``). Their
wiring: the Tiresias master reads pMaster's reports and every daemon's, knows pMaster's
address (jobs get it as ``AUTOPS_MASTER``) and which Infiniswap host each of its nodes is
(``--node-host``); each daemon reports under its host id. Every state directory lives under
the cluster's (``[cluster] state``), so the setup owns its state and does not take the
locks of services a user runs by hand.

``host`` is the address a service binds and others reach it at: the embedded setup's
``[cluster] host``; on Ray, the node's IP, or ``dlrt.rayprocess.NODE_IP`` for a command
built before its node is known (the actor fills it in).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

from dlrt.rayprocess import HOST_ID

from .config import ClusterConfig

AUTOPS, INFINISWAP, TIRESIAS = "autops", "infiniswap", "tiresias"
ORDER = (AUTOPS, INFINISWAP, TIRESIAS)     # started in this order, stopped in the reverse


@dataclass(frozen=True)
class Service:
    """One process of the setup: its name (unique), kind, command line and the address it
    answers at (``probe``: ``tcp://`` ZeroMQ control for AutoPS and Infiniswap, ``http://``
    for Tiresias)."""
    name: str
    kind: str
    argv: list[str]
    endpoint: str
    log: str
    extra: dict = field(default_factory=dict, compare=False)


def _python(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def state_path(config: ClusterConfig, *parts: str) -> str:
    return os.path.join(config.cluster.state_dir, *parts)


def pmaster(config: ClusterConfig, host: str, ray_address: str | None = None, log_level: str = "INFO") -> Service:
    """pMaster at ``host``: the local provider (aggregators on this machine), or with
    ``ray_address`` the Ray provider (aggregators as actors where CPUs are free)."""
    c = config.autops
    argv = _python("autops.cli") + ["--log-level", log_level, "master", "--bind", f"tcp://{host}:{c.port}",
                                    "--report-bind", f"tcp://{host}:{c.report_port}",
                                    "--state-dir", state_path(config, "autops"),
                                    "--aggregator-orphan-timeout", str(c.orphan_timeout)]
    if ray_address is None:
        argv += ["--provider", "local"]
    else:
        argv += ["--provider", "ray", "--ray-address", ray_address]
        if c.ray_resource:
            argv += ["--ray-resource", c.ray_resource]
    if c.max_aggregators:
        argv += ["--max-aggregators", str(c.max_aggregators)]
    return Service("autops-master", AUTOPS, argv + list(c.args), f"tcp://{host}:{c.port}",
                   state_path(config, "logs", "autops-master.log"),
                   {"reports": f"tcp://{host}:{c.report_port}"})


def daemon(config: ClusterConfig, host: str, name: str = "infiniswap-daemon", report_host: str = HOST_ID,
           log_level: str = "INFO") -> Service:
    """An Infiniswap daemon lending ``host``'s memory, reporting as ``report_host``."""
    c = config.infiniswap
    argv = _python("infiniswap.cli") + ["daemon", "--log-level", log_level, "--bind", f"{host}:{c.port}",
                                        "--data-host", host, "--reports", f"{host}:{c.report_port}",
                                        "--report-host", report_host, "--headroom", c.headroom]
    if c.capacity:
        argv += ["--capacity", c.capacity]
    return Service(name, INFINISWAP, argv + list(c.args), f"tcp://{host}:{c.port}",
                   state_path(config, "logs", f"{name}.log"), {"reports": f"tcp://{host}:{c.report_port}"})


def tiresias(config: ClusterConfig, host: str, autops: Service, daemons: Sequence[Service],
             node_hosts: dict[str, str], ray_address: str | None = None, log_level: str = "INFO") -> Service:
    """The Tiresias master at ``host``, fed by ``autops``'s and ``daemons``' reports, its
    nodes mapped to Infiniswap hosts by ``node_hosts``; the local executor, or with
    ``ray_address`` the Ray executor."""
    c = config.tiresias
    argv = _python("tiresias.cli") + ["master", "--log-level", log_level, "--bind", f"{host}:{c.port}",
                                      "--state", state_path(config, "tiresias"), "--policy", c.policy,
                                      "--autops-master", autops.endpoint,
                                      "--autops-reports", autops.extra["reports"]]
    if daemons:
        argv += ["--infiniswap-reports", *(d.extra["reports"] for d in daemons)]
    for node, report_host in sorted(node_hosts.items()):
        argv += ["--node-host", f"{node}={report_host}"]
    if ray_address is None:
        argv += ["--executor", "local", "--nodes", c.nodes]
    else:
        argv += ["--executor", "ray", "--ray-address", ray_address]
    if c.checkpoint_root:
        argv += ["--checkpoint-root", os.path.expanduser(c.checkpoint_root)]
    return Service("tiresias-master", TIRESIAS, argv + list(c.args), f"http://{host}:{c.port}",
                   state_path(config, "logs", "tiresias-master.log"))


def local_nodes(nodes: str) -> list[str]:
    """The node names of the local executor's ``NODESxGPUS`` (``node0``, ``node1``, ...)."""
    count, _, _ = nodes.lower().partition("x")
    return [f"node{i}" for i in range(int(count))] if count.isdigit() else []
