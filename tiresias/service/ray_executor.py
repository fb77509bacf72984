"""The Ray executor: runs on a Ray cluster, one placement group per run, a launcher actor per node.

Tiresias decides placement; Ray only carries it out. ``launch`` reserves one bundle per node
of the run (``{"GPU": g, "CPU": 0.01}``), each pinned to the Ray node Tiresias chose by a
bundle label selector on Ray's built-in ``ray.io/node-id`` label, in a detached placement
group ``tiresias-job{J}-run{R}``. Into bundle i goes a detached launcher actor
``tiresias-job{J}-run{R}-node{i}`` (``num_gpus`` = that node's GPUs) that starts
``node_command`` with ``node_env`` in a process group of its own, output piped to the job's
log through ``joblog.CappedLog`` (the same cap and rotation as the local executor's), and
keeps the exit code. Both are named in the executor's namespace, so a
restarted master (a new driver) finds them again: ``reconcile`` adopts the runs SQLite says
are live, reports those that ended meanwhile, and removes every other ``tiresias-*`` actor
and placement group. Ray's own state is in memory; the master's SQLite stays the truth.

GPU ids: Ray assigns the GPUs of each actor and sets its ``CUDA_VISIBLE_DEVICES``; the job
gets *those* ids (which may differ from the indices in ``spec.placement``: Tiresias decides
how many GPUs on which node, Ray which ones). ``TIRESIAS_RAY_NODE_ID`` carries the Ray node.

Node names, stable across master restarts and unique when nodes share an IP: the node label
``tiresias.io/node`` (``ray start --labels='{"tiresias.io/node": "gpu3"}'``), else a custom
resource ``tiresias_node:<name>`` (``--resources='{"tiresias_node:gpu3": 1}'``), else
``ray-<first 8 hex digits of the Ray node id>``. Set a label for a name that also survives
a restart of the Ray node itself (a restarted node gets a new id). Only nodes with GPUs count.

A launcher's process group holds the node command and what it starts; launchers such as
torchrun that put workers in sessions of their own are reached by the process tree on
SIGKILL (``kill_tree``) while the launcher lives. The node command dies with its launcher
(``PR_SET_PDEATHSIG``), so a lost node's raylet taking its actors down takes the job too. Every node needs this package installed
(the actor class is imported there) and ``spec.log_path`` must be a path every node sees.
Ray 2.60 resolves a loopback driver address to the machine's IP, which a cluster bound to
127.0.0.1 (as in tests) does not listen on; ``dlrt.rayconn.loopback_kept`` keeps loopback
addresses as given.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from dlrt.procs import die_with_parent, kill_tree, signal_group
from dlrt.rayconn import check_address, error_line, loopback_kept

from . import cgroup
from .executor import LaunchSpec, NodeInfo, RunEnd, node_command, node_env
from .joblog import CappedLog, start_pump
from .supervisor import KILL_AFTER_S, PUMP_DRAIN_S, free_port

try:
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:                                  # the executor says so when constructed
    ray = None

log = logging.getLogger(__name__)

NODE_LABEL = "tiresias.io/node"
NODE_RESOURCE = "tiresias_node:"
RAY_NODE_ID_LABEL = "ray.io/node-id"
BUNDLE_CPU = 0.01
NAME_RE = re.compile(r"^tiresias-job(\d+)-run(\d+)(?:-node(\d+))?$")


def run_name(job_id: int, run: int) -> str:
    """The placement group's name of a run; its actors add ``-node{i}``."""
    return f"tiresias-job{job_id}-run{run}"


def node_name(node: dict[str, Any]) -> str:
    """The Tiresias name of a Ray node (an entry of ``ray.nodes()``): label, resource or id."""
    label = (node.get("Labels") or {}).get(NODE_LABEL)
    if label:
        return label
    for key in node.get("Resources") or {}:
        if key.startswith(NODE_RESOURCE) and len(key) > len(NODE_RESOURCE):
            return key[len(NODE_RESOURCE):]
    return "ray-" + node["NodeID"][:8]


class NodeLauncher:
    """The launcher actor of one node of a run (async: its methods share one event-loop thread)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.outcome_: dict[str, Any] | None = None
        self.limit: cgroup.MemoryLimit | None = None
        self.stopped_file = ""
        self.log: CappedLog | None = None
        self.pump: threading.Thread | None = None

    async def free_port(self, host: str) -> int:
        return free_port(host)

    async def start(self, spec_data: dict[str, Any], rank: int, host: str, port: int) -> dict[str, Any]:
        """Start the node's command; returns where it runs: Ray node id, GPU ids, pid."""
        spec = LaunchSpec.from_dict(spec_data)
        self.stopped_file = spec.env.get("TIRESIAS_STOPPED_FILE", "")
        ctx = ray.get_runtime_context()
        gpus = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        env = node_env(spec, rank, host, port)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)            # Ray's assignment, not the placement's
        env["TIRESIAS_RAY_NODE_ID"] = ctx.get_node_id()
        if spec.memory_bytes:
            self.limit = cgroup.MemoryLimit.create(f"job{spec.job_id}-run{spec.run}-node{rank}", spec.memory_bytes)
        os.makedirs(os.path.dirname(os.path.abspath(spec.log_path)), exist_ok=True)
        self.log = CappedLog(spec.log_path, spec.max_log_bytes)        # the supervisor's cap and rotation
        self.log.write(f"=== tiresias: run {spec.run} of job {spec.job_id}, node {rank} ({spec.placement[rank][0]}, "
                       f"GPUs {env['CUDA_VISIBLE_DEVICES']}) at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
        read_end, write_end = os.pipe()
        try:
            self.proc = subprocess.Popen(node_command(spec, rank, host, port), env=env, cwd=spec.workdir,
                                         stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_child_setup(self.limit))
        except Exception:
            os.close(read_end)
            if self.limit is not None:
                self.limit.remove()
            raise
        finally:
            os.close(write_end)
        self.pump = start_pump(self.log, read_end, f"joblog-{spec.job_id}-{spec.run}-{rank}")
        return {"node_id": ctx.get_node_id(), "gpus": gpus, "pid": self.proc.pid}

    async def wait(self) -> dict[str, Any]:
        """Block until the node's command exits; its outcome ``{"code", "stopped"}``."""
        while self.outcome_ is None:
            await asyncio.sleep(0.1)
            self._check()
        return self.outcome_

    async def outcome(self) -> dict[str, Any] | None:
        """The outcome if the command has exited, else None (does not block)."""
        self._check()
        return self.outcome_

    async def signal(self, sig: int) -> None:
        """Signal the command's process group (and, for SIGKILL, its whole process tree)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if sig == signal.SIGKILL:
            kill_tree(self.proc.pid)
        signal_group(self.proc.pid, sig)

    def _check(self) -> None:
        if self.outcome_ is not None or self.proc is None or self.proc.poll() is None:
            return
        signal_group(self.proc.pid, signal.SIGKILL)          # what the command left in its group
        if self.pump is not None:
            self.pump.join(PUMP_DRAIN_S)                     # its last output reaches the log first
        if self.limit is not None:
            self.limit.remove()
        self.outcome_ = {"code": self.proc.returncode,
                         "stopped": bool(self.stopped_file) and os.path.exists(self.stopped_file)}


def _child_setup(limit: cgroup.MemoryLimit | None) -> Callable[[], None]:
    """The node command's pre-exec step: join the memory cgroup; die with the launcher actor."""
    parent = os.getpid()

    def setup() -> None:
        if limit is not None:
            limit.join_self()
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:                   # the actor died before the line above
            os._exit(1)
    return setup


@dataclass
class _Run:
    """A run this executor watches: its handle, launcher actors and what each node ended with."""
    handle: dict[str, Any]
    actors: list[Any]
    refs: list[Any]                                  # pending ``wait`` calls, None once answered
    results: list[dict[str, Any] | None]
    first_failure: dict[str, Any] | None = None
    stop_sent: float | None = None
    killed: bool = False

    def record(self, i: int, result: dict[str, Any]) -> None:
        self.results[i] = result
        self.refs[i] = None
        if self.first_failure is None and (result.get("lost") or result.get("code") != 0):
            self.first_failure = dict(result, node=self.handle["nodes"][i])

    def done(self) -> bool:
        return all(r is not None for r in self.results)


class RayExecutor:
    name = "ray"

    def __init__(self, address: str | None, namespace: str = "tiresias", ready_timeout: float = 60.0,
                 call_timeout: float = 30.0) -> None:
        if ray is None:
            raise RuntimeError("the ray executor needs Ray on this machine and every node: pip install 'ray==2.60.0'")
        self.namespace = namespace
        self.ready_timeout = ready_timeout
        self.call_timeout = call_timeout
        address = check_address(address)      # one line at once, not minutes in ray.init, for a wrong address
        with loopback_kept(address) as extra:             # None: the cluster this machine runs (never a new one)
            ray.init(address=address or "auto", namespace=namespace, ignore_reinit_error=True,
                     log_to_driver=False, logging_level=logging.WARNING, **extra)
        self._launcher = ray.remote(NodeLauncher)
        self._runs: dict[tuple[int, int], _Run] = {}
        self._known: dict[str, NodeInfo] = {}          # every node seen, so a dead one stays listed
        self._lock = threading.RLock()

    # --- nodes -----------------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            current = self._scan()
            for name, info in self._known.items():
                if name not in current:
                    self._known[name] = NodeInfo(info.name, info.gpus, False, info.address)
            self._known.update({name: info for name, (info, _) in current.items()})
            return [self._known[name] for name in sorted(self._known)]

    def _scan(self) -> dict[str, tuple[NodeInfo, str]]:
        """Ray's nodes with GPUs: name -> (NodeInfo, Ray node id); a live node wins over a dead one."""
        found: dict[str, tuple[NodeInfo, str]] = {}
        for node in ray.nodes():
            name = node_name(node)
            known = self._known.get(name)
            gpus = int((node.get("Resources") or {}).get("GPU", 0)) or (known.gpus if known else 0)
            if gpus <= 0:
                continue
            info = NodeInfo(name, gpus, bool(node["Alive"]), node["NodeManagerAddress"])
            if name not in found or (info.alive and not found[name][0].alive):
                found[name] = (info, node["NodeID"])
        return found

    # --- launch ----------------------------------------------------------------------------------
    def launch(self, spec: LaunchSpec) -> dict[str, Any]:
        with self._lock:
            nodes = self._scan()
            for node in spec.nodes:
                if node not in nodes or not nodes[node][0].alive:
                    raise ValueError(f"Ray node {node!r} is not alive (known: {', '.join(sorted(nodes)) or 'none'})")
            name = run_name(spec.job_id, spec.run)
            pg = self._reserve(name, spec, [nodes[n][1] for n in spec.nodes])
            actors: list[Any] = []
            try:
                actors = [self._new_actor(f"{name}-node{i}", pg, i, len(g)) for i, (_, g) in enumerate(spec.placement)]
                host = nodes[spec.nodes[0]][0].address
                port = ray.get(actors[0].free_port.remote(host), timeout=self.ready_timeout)
                placed = ray.get([a.start.remote(spec.to_dict(), i, host, port) for i, a in enumerate(actors)],
                                 timeout=self.ready_timeout)
            except Exception:
                self._signal(actors, signal.SIGKILL)
                self._discard(actors, pg)
                raise
            handle = {"executor": "ray", "namespace": self.namespace, "placement_group": name,
                      "actors": [f"{name}-node{i}" for i in range(len(actors))], "nodes": spec.nodes,
                      "ray_nodes": [p["node_id"] for p in placed], "gpus": [p["gpus"] for p in placed],
                      "rdzv": f"{host}:{port}", "stopped_file": spec.env.get("TIRESIAS_STOPPED_FILE", "")}
            self._runs[(spec.job_id, spec.run)] = _Run(handle, actors, [a.wait.remote() for a in actors],
                                                       [None] * len(actors))
            return handle

    def _reserve(self, name: str, spec: LaunchSpec, node_ids: list[str]) -> Any:
        """A detached placement group, bundle i pinned to Ray node ``node_ids[i]``."""
        bundles = [{"CPU": BUNDLE_CPU, **({"GPU": len(g)} if g else {})} for _, g in spec.placement]
        pg = placement_group(bundles, strategy="STRICT_SPREAD", name=name, lifetime="detached",
                             bundle_label_selector=[{RAY_NODE_ID_LABEL: i} for i in node_ids])
        if not pg.wait(timeout_seconds=self.ready_timeout):
            remove_placement_group(pg)
            raise RuntimeError(f"{name}: Ray could not reserve {bundles} on {spec.nodes} "
                               f"within {self.ready_timeout:.0f} s (GPUs still held?)")
        return pg

    def _new_actor(self, name: str, pg: Any, bundle: int, gpus: int) -> Any:
        return self._launcher.options(
            name=name, namespace=self.namespace, lifetime="detached", max_restarts=0, num_cpus=BUNDLE_CPU,
            num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle)).remote()

    # --- stop ------------------------------------------------------------------------------------
    def terminate(self, job_id: int, run: int, handle: dict[str, Any], force: bool = False) -> None:
        sig = signal.SIGKILL if force else signal.SIGTERM
        with self._lock:
            tracked = self._runs.get((job_id, run))
            if tracked is not None:
                self._signal([a for a, r in zip(tracked.actors, tracked.results) if r is None], sig)
                tracked.killed = tracked.killed or force
                return
            actors = [a for a in map(self._actor, handle.get("actors", [])) if a is not None]
            self._signal(actors, sig)
            if force:                                # nobody polls this run: clear it away now
                self._discard(actors, self._group(handle.get("placement_group", "")))

    def _signal(self, actors: list[Any], sig: int) -> None:
        refs = [a.signal.remote(int(sig)) for a in actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout)

    def _discard(self, actors: list[Any], pg: Any | None) -> None:
        """Kill the actors (their commands have ended or been killed) and free the placement group."""
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:                 # already gone
                log.debug("ray.kill: %s", exc)
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception as exc:
                log.debug("remove_placement_group: %s", exc)

    # --- watch -----------------------------------------------------------------------------------
    def poll(self) -> list[RunEnd]:
        with self._lock:
            self._collect()
            ended = []
            for key, run in list(self._runs.items()):
                self._stop_rest(run)
                if run.done():
                    del self._runs[key]
                    ended.append(self._finish(key, run))
            return ended

    def _collect(self) -> None:
        """Take the answers of the ``wait`` calls that returned (or failed: actor or node gone)."""
        where = {ref: (run, i) for run in self._runs.values() for i, ref in enumerate(run.refs) if ref is not None}
        if not where:
            return
        ready, _ = ray.wait(list(where), num_returns=len(where), timeout=0)
        for ref in ready:
            run, i = where[ref]
            run.record(i, self._answer(ref, run.handle["actors"][i]))

    def _answer(self, ref: Any, actor: str) -> dict[str, Any]:
        try:
            return ray.get(ref, timeout=self.call_timeout)
        except ray.exceptions.RayError as exc:
            return {"code": None, "lost": f"launcher {actor} died: {error_line(exc)}"}

    def _stop_rest(self, run: _Run) -> None:
        """One node failed or was lost: SIGTERM the others, SIGKILL after ``KILL_AFTER_S``."""
        if run.first_failure is None or run.done() or run.killed:
            return
        live = [a for a, r in zip(run.actors, run.results) if r is None]
        if run.stop_sent is None:
            run.stop_sent = time.monotonic()
            self._signal(live, signal.SIGTERM)
        elif time.monotonic() - run.stop_sent > KILL_AFTER_S:
            run.killed = True
            self._signal(live, signal.SIGKILL)

    def _finish(self, key: tuple[int, int], run: _Run) -> RunEnd:
        self._discard(run.actors, self._group(run.handle["placement_group"]))
        first = run.first_failure
        lost = [r["lost"] for r in run.results if r and r.get("lost")]
        stopped_file = run.handle.get("stopped_file")
        stopped = any(r and r.get("stopped") for r in run.results) or bool(stopped_file and os.path.exists(stopped_file))
        detail = "; ".join(lost) if lost else (f"node {first['node']} exited with code {first['code']}" if first else "")
        return RunEnd(key[0], key[1], first["code"] if first else 0, stopped, bool(lost), detail)

    # --- after a master restart ------------------------------------------------------------------
    def reconcile(self, runs: dict[tuple[int, int], dict[str, Any]]) -> list[RunEnd]:
        with self._lock:
            self._remove_strays({h.get("placement_group") or run_name(*k) for k, h in runs.items()})
            ended = []
            for key, handle in runs.items():
                run = self._adopt(handle)
                if run.done():
                    ended.append(self._finish(key, run))
                else:
                    self._runs[key] = run
            return ended

    def _adopt(self, handle: dict[str, Any]) -> _Run:
        """Find a run's actors again: finished nodes answered now, running ones watched."""
        names = handle.get("actors", [])
        actors = [self._actor(n) for n in names]
        run = _Run(handle, actors, [None] * len(names), [None] * len(names))
        for i, actor in enumerate(actors):
            if actor is None:
                run.record(i, {"code": None, "lost": f"launcher {names[i]} is gone"})
                continue
            outcome = self._answer(actor.outcome.remote(), names[i])
            if outcome is None:
                run.refs[i] = actor.wait.remote()
            else:
                run.record(i, outcome)
        return run

    def _remove_strays(self, wanted: set[str]) -> None:
        """Kill the ``tiresias-*`` actors and placement groups of runs not in ``wanted``."""
        strays = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == self.namespace and _run_of(a["name"]) not in (None, *wanted)]
        actors = [a for a in map(self._actor, strays) if a is not None]
        self._signal(actors, signal.SIGKILL)
        self._discard(actors, None)
        for info in placement_group_table().values():
            name = info.get("name", "")
            if info.get("state") != "REMOVED" and _run_of(name) not in (None, *wanted):
                pg = self._group(name)
                if pg is not None:
                    remove_placement_group(pg)
        if strays:
            log.info("removed stray Ray actors: %s", ", ".join(strays))

    def _actor(self, name: str) -> Any | None:
        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return None

    def _group(self, name: str) -> Any | None:
        try:
            return ray.util.get_placement_group(name)
        except ValueError:
            return None

    def close(self) -> None:
        """Disconnect this driver; detached actors and their jobs keep running."""
        with self._lock:
            self._runs.clear()
            ray.shutdown()


def _run_of(name: str) -> str | None:
    """``tiresias-job3-run1-node0`` -> ``tiresias-job3-run1``; None for names not ours."""
    m = NAME_RE.match(name or "")
    return run_name(int(m.group(1)), int(m.group(2))) if m else None

