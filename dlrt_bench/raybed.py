"""A real Ray cluster whose nodes are a testbed's emulated hosts (docs/testbed.md, *A Ray cluster*).

``RayBed(testbed, {0: NodeSpec(num_cpus=1), 1: NodeSpec(num_cpus=2)}, head=0)``: ``up()`` runs
``ray start --head --block`` in the head's host, bound to that host's address, and ``ray start
--block --address HEAD:PORT`` in every other host, each with its ``NodeSpec`` (CPUs, GPUs, custom
resources, labels), a small object store, no dashboard, no usage stats and the host's environment
(its ``DLRT_HOST_ID``, the test's ``DLRT_KEYS``), which the raylet and so every Ray worker on that
host inherit. Each node keeps its Ray state in a directory of its own under one temporary
directory, never in the machine's ``/tmp/ray`` that clusters on 127.0.0.1 use. ``up`` waits until
the GCS reports every node alive and returns ``HEAD:PORT``.

The GCS health-checks the raylets every 500 ms (the first 1 s after a node registers) and marks a
node dead after 3 failed checks, so after ``kill_node`` (SIGKILL to every Ray process of a host: a
machine lost) the GCS reports the node dead within about 1.5 s, not the 13-16 s of Ray's
defaults; SIGTERM shuts a node down at once (no drain, which waits up to 30 s when the GCS ends
first). ``nodes()`` asks a small
driver (``dlrt_bench.raynodes``) run in the head's host, since the bridge's addresses cannot be
reached from the machine's own namespace. ``down()`` ends every Ray process started (each node's
``ray start`` leads a session that every Ray process of that node stays in, the workers included)
and removes the temporary directory.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import psutil

from dlrt.procs import signal_group
from dlrt_bench.testbed import Host, Testbed

__all__ = ["NodeSpec", "RayBed", "RayBedError", "running", "RAY_ENV", "OBJECT_STORE_BYTES", "DEFAULT_PORT"]

DEFAULT_PORT = 6379
OBJECT_STORE_BYTES = 80 << 20
# what every node's Ray processes (and the drivers run in the head's host) get in their environment
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # SIGTERM makes `ray start --block` mark its node draining and wait for the GCS to drain
    # it, up to 30 s: when the head's GCS ends in the same shutdown, that is 30 s lost
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    # the GCS's health checks of the raylets (read from the environment by the GCS, at the
    # head). Ray's defaults: a first check 5 s after a node registers, then every 3 s, dead
    # after 5 failures: a killed node was seen dead 13-16 s later; with these, 0.4-1.5 s. The
    # price: a raylet that misses 3 checks in a row (about 4 s without an answer) is declared
    # dead and ends, so on a machine loaded enough to stall a raylet that long, raise them (env=)
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
DRIVER_START_S = 15.0        # a driver's start (importing Ray, joining) beyond the wait it is given
GONE_S = 5.0                 # for SIGKILLed processes to disappear
LOG_TAIL = 1500


class RayBedError(RuntimeError):
    """A Ray node failed to start or a wait on the cluster ran out (names the node, the log tail)."""


@dataclass
class NodeSpec:
    """What one node offers Ray: ``ray start``'s ``--num-cpus/--num-gpus/--resources/--labels``
    (GPUs are only counted: Ray sets ``CUDA_VISIBLE_DEVICES`` for the tasks it gives them)."""
    num_cpus: int = 1
    num_gpus: int = 0
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def start_args(self) -> list[str]:
        """The node's options of ``ray start``."""
        args = ["--num-cpus", str(self.num_cpus), "--num-gpus", str(self.num_gpus)]
        if self.resources:
            args += ["--resources", json.dumps(self.resources)]
        if self.labels:
            bad = [f"{k}={v}" for k, v in self.labels.items() if any(c in f"{k}{v}" for c in ",= ")]
            if bad:
                raise ValueError(f"node labels may not hold ',', '=' or spaces: {bad}")
            args += ["--labels", ",".join(f"{k}={v}" for k, v in self.labels.items())]
        return args


def running(pids: Iterable[int]) -> set[int]:
    """Those of ``pids`` that still run (a zombie has ended)."""
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Poll until none of ``pids`` runs or ``timeout`` passes; those still running."""
    deadline = time.monotonic() + timeout
    while (left := running(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _kill(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class RayBed:
    """A Ray cluster on ``testbed``'s hosts: ``nodes`` maps a host index to what its node offers,
    ``head`` is the host of the head node, whose GCS listens on ``port``. A context manager:
    ``up()`` on entry, ``down()`` on exit."""

    __test__ = False  # not a pytest test class

    def __init__(self, testbed: Testbed, nodes: Mapping[int, NodeSpec], head: int = 0, port: int = DEFAULT_PORT,
                 *, object_store_bytes: int = OBJECT_STORE_BYTES, env: Mapping[str, str] | None = None,
                 python: str = sys.executable) -> None:
        if head not in nodes:
            raise ValueError(f"the head (host {head}) needs a NodeSpec too; nodes are for hosts {sorted(nodes)}")
        unknown = [i for i in nodes if not 0 <= i < len(testbed.hosts)]
        if unknown:
            raise ValueError(f"hosts {unknown} are not in the testbed (hosts 0..{len(testbed.hosts) - 1})")
        self.testbed = testbed
        self.specs = dict(nodes)
        self.head = head
        self.port = port
        self.object_store_bytes = object_store_bytes
        self.env = {**RAY_ENV, **(env or {})}
        self.python = python
        self.address = f"{testbed.hosts[head].addr}:{port}"
        self.temp_dir: str | None = None
        self.bring_up_s: float | None = None        # up()'s duration, once up
        self._starts: dict[int, subprocess.Popen] = {}   # host index -> its `ray start --block`

    def __repr__(self) -> str:
        return f"RayBed({self.address}, nodes={sorted(self.specs)}, up={sorted(self._starts)})"

    def __enter__(self) -> "RayBed":
        self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def host(self, index: int) -> Host:
        """The testbed's host ``index``."""
        return self.testbed.hosts[index]

    # --- bring-up -----------------------------------------------------------------------------

    def up(self, timeout: float = 60.0) -> str:
        """Start every node (the head first, the others at once: each waits for the GCS) and
        wait until the GCS reports all of them alive; ``HEAD:PORT``. Records ``bring_up_s``.
        Removes what it started when a node fails (``RayBedError`` with the tail of its log)
        or ``timeout`` passes (``RayBedError`` with the driver's message)."""
        if self.temp_dir is not None:
            raise RayBedError(f"{self!r} is up already")
        started = time.monotonic()
        self.temp_dir = tempfile.mkdtemp(prefix="raybed-")
        try:
            for index in [self.head] + sorted(set(self.specs) - {self.head}):
                self._start(index, gcs_wait_s=math.ceil(timeout))
            self._wait_alive(sorted(self.specs), started + timeout)
        except BaseException:
            self.down()
            raise
        self.bring_up_s = time.monotonic() - started
        return self.address

    def _node_dir(self, index: int) -> str:
        return os.path.join(self.temp_dir, f"h{index}")

    def log_path(self, index: int) -> str:
        """Where node ``index``'s ``ray start`` writes its output (in the temporary directory)."""
        return os.path.join(self.temp_dir, f"h{index}.log")

    def _start(self, index: int, gcs_wait_s: int) -> None:
        host, spec = self.host(index), self.specs[index]
        common = ["--node-ip-address", host.addr, "--temp-dir", self._node_dir(index),
                  "--object-store-memory", str(self.object_store_bytes), "--disable-usage-stats", "--block"]
        env = dict(self.env)
        if index == self.head:
            role = ["--head", "--port", str(self.port), "--include-dashboard", "false"]
        else:
            role = ["--address", self.address]
            # a node started with the head waits for its GCS this long (Ray's default: ~20 s)
            env.setdefault("RAY_gcs_server_port_wait_time_s", str(gcs_wait_s))
        argv = [self.python, "-m", "ray.scripts.scripts", "start", *role, *common, *spec.start_args()]
        with open(self.log_path(index), "wb") as log:
            self._starts[index] = host.popen(argv, env=host.env(env), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT)

    def _log_tail(self, index: int) -> str:
        try:
            with open(self.log_path(index), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - LOG_TAIL))
                return fh.read().decode(errors="replace").strip()
        except OSError:
            return "(no log)"

    def _check_nodes(self) -> None:
        """``RayBedError`` when a node's ``ray start`` has ended (it ends when one of its Ray
        processes dies, or when it could not start)."""
        for index, start in self._starts.items():
            if start.poll() is not None:
                raise RayBedError(f"`ray start` of the node on {self.host(index).name} exited with "
                                  f"{start.returncode}; its log ends:\n{self._log_tail(index)}")

    # --- the GCS's view -----------------------------------------------------------------------

    def _driver(self, expect: list[str] | None, deadline: float) -> dict[str, Any]:
        """Run ``dlrt_bench.raynodes`` in the head's host until it answers: ``{"alive": [NODE,
        ...], "seen_at": UNIX_TIME}``."""
        head = self.host(self.head)
        root = str(pathlib.Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        argv = [self.python, "-m", "dlrt_bench.raynodes", "--address", self.address,
                "--timeout", f"{max(0.0, deadline - time.monotonic()):.1f}"]
        if expect is not None:
            argv += ["--expect", *expect]
        proc = head.popen(argv, env=head.env({**self.env, "PYTHONPATH": path}), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while True:
                try:
                    out, err = proc.communicate(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    self._check_nodes()
                    if time.monotonic() > deadline + DRIVER_START_S:
                        raise RayBedError(f"the driver in {head.name} did not answer in time "
                                          f"(waiting for alive nodes {expect})") from None
        finally:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0:
            raise RayBedError(f"the driver in {head.name} failed (exit {proc.returncode}): "
                              f"{err.strip()[-LOG_TAIL:] or 'no message'}")
        lines = out.strip().splitlines()     # Ray may print the GCS's notices before the answer
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            raise RayBedError(f"the driver in {head.name} gave no node list: {out.strip()[-LOG_TAIL:]!r}") from None

    def _wait_alive(self, indices: list[int], deadline: float) -> float:
        """Wait until the nodes of hosts ``indices`` are the alive ones; when (Unix time) the
        driver first saw that."""
        return self._driver([self.host(i).addr for i in indices], deadline)["seen_at"]

    def nodes(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The nodes the GCS reports alive, each ``{"id", "ip", "resources", "labels"}``."""
        return self._driver(None, time.monotonic() + timeout)["alive"]

    # --- processes ----------------------------------------------------------------------------

    def processes(self, index: int | None = None) -> set[int]:
        """The pids of node ``index``'s Ray processes (every node's when ``None``): the members
        of its ``ray start``'s session in its host (raylet, GCS, agents, workers, which lead
        process groups of their own) and their descendants."""
        found: set[int] = set()
        for i, start in self._starts.items():
            if index is not None and i != index:
                continue
            members = set()
            for pid in self.testbed.pids(self.host(i)):
                try:
                    if os.getsid(pid) == start.pid:
                        members.add(pid)
                except ProcessLookupError:
                    pass
            for pid in list(members):
                try:
                    members.update(child.pid for child in psutil.Process(pid).children(recursive=True))
                except psutil.Error:
                    pass
            found |= members
        return found

    def kill_node(self, index: int, timeout: float = 30.0) -> float:
        """SIGKILL every Ray process of host ``index`` (a machine lost), then wait until the GCS
        reports only the other nodes alive; the seconds from the kill until a driver saw that
        (it polls every 0.1 s once started, 0.4-1 s after the kill: a quicker death reads as
        that)."""
        if index == self.head:
            raise ValueError("kill_node cannot kill the head: the GCS reports the others' deaths")
        if index not in self._starts:
            raise ValueError(f"no Ray node of this RayBed runs on host {index}")
        pids = self.processes(index)
        killed, killed_at = time.monotonic(), time.time()
        _kill(pids, signal.SIGKILL)
        self._starts.pop(index).wait()
        left = _wait_gone(pids, GONE_S)
        if left:
            raise RayBedError(f"Ray processes {sorted(left)} on {self.host(index).name} outlived SIGKILL")
        return self._wait_alive(sorted(self._starts), killed + timeout) - killed_at

    def down(self, timeout: float = 10.0) -> None:
        """SIGTERM every node's processes (their ``ray start``'s process group; the raylets end
        their workers), SIGKILL what is left after ``timeout`` and wait until it is gone, then
        remove the temporary directory. Safe to call more than once."""
        starts, pids = self._starts, self.processes()
        for start in starts.values():
            signal_group(start.pid, signal.SIGTERM)
        left = _wait_gone(pids, timeout)
        left |= self.processes() - pids                 # started while shutting down
        _kill(left, signal.SIGKILL)
        for start in starts.values():
            signal_group(start.pid, signal.SIGKILL)
            start.wait()
        left = _wait_gone(left, GONE_S)
        self._starts = {}
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
        if left:
            raise RayBedError(f"Ray processes {sorted(left)} outlived SIGKILL")
