"""The executor interface: how the master starts, stops and watches jobs on nodes.

The master decides (through the driver) which job runs where; an executor only carries it
out, and it never owns state: after a master restart the master hands it what SQLite says
is running (``reconcile``) and the executor reports what it still finds. Two backends:
``local`` (emulated nodes on this machine, a supervisor process per run) and ``ray`` (a
placement group per run, one launcher actor per node). A Kubernetes backend would fit the
same seam (launch = create/unsuspend a Job, terminate = suspend it).

A run is one start of a job: ``(job_id, run)``; a preempted job that resumes gets the next
run number. Every node of a run executes the same ``node_command`` with ``node_env``.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

# exit statuses a run can end with, besides a process exit code
LOST = "lost"          # the executor cannot find the run any more (node gone, actor gone)


@dataclass(frozen=True)
class NodeInfo:
    name: str
    gpus: int
    alive: bool = True
    address: str = "127.0.0.1"       # where a rendezvous on this node is reachable


@dataclass
class LaunchSpec:
    """Everything an executor needs to start one run of a job."""
    job_id: int
    run: int
    name: str
    command: list[str]
    launcher: str                                  # "torchrun": one worker per GPU; "plain": once per node
    placement: list[tuple[str, list[int]]]         # (node name, GPU indices on that node); an executor
                                                   # that assigns GPUs itself (Ray) records its own in the handle
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "."
    log_path: str = "job.log"                      # output of every node, appended (``joblog``)
    max_log_bytes: int = 0                         # the log's rotation cap (``joblog.CappedLog``; 0: none)
    run_dir: str = "."                             # per-run files: supervisor status, exit record
    memory_bytes: int | None = None                # per-node memory limit (cgroup) when declared
    run_as: str | None = None                      # OS user the node commands run as (local executor, as root)

    @property
    def nodes(self) -> list[str]:
        return [n for n, _ in self.placement]

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["placement"] = [[n, list(g)] for n, g in self.placement]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LaunchSpec":
        d = dict(d)
        d["placement"] = [(n, list(g)) for n, g in d["placement"]]
        return cls(**d)


@dataclass
class RunEnd:
    """How a run ended: ``exit_code`` 0 for success; ``stopped`` when the job marked that it
    exited because asked; ``lost`` when the executor lost it (node gone)."""
    job_id: int
    run: int
    exit_code: int | None
    stopped: bool = False
    lost: bool = False
    detail: str = ""


class Executor(Protocol):
    name: str

    def nodes(self) -> list[NodeInfo]:
        """The nodes jobs can run on, with their GPU counts and liveness."""

    def launch(self, spec: LaunchSpec) -> dict[str, Any]:
        """Start the run; returns a handle (plain JSON data) the master stores with the run."""

    def terminate(self, job_id: int, run: int, handle: dict[str, Any], force: bool = False) -> None:
        """Signal the run's processes: SIGTERM, or SIGKILL with ``force``. Idempotent."""

    def poll(self) -> list[RunEnd]:
        """Runs that ended since the last call (each reported once)."""

    def reconcile(self, runs: dict[tuple[int, int], dict[str, Any]]) -> list[RunEnd]:
        """After a master restart: adopt ``runs`` (``(job, run) -> handle``) that are still
        alive, so ``poll`` reports their end later; return those that ended meanwhile or
        are gone. Anything the executor runs that is not in ``runs`` is stopped."""

    def close(self) -> None:
        """Release the executor's own resources; running jobs keep running."""


def node_command(spec: LaunchSpec, node_rank: int, rdzv_host: str, rdzv_port: int,
                 python: str | None = None) -> list[str]:
    """The command node ``node_rank`` of a run executes.

    ``torchrun`` launcher: the job's command must be a Python script (and its arguments);
    ``torch.distributed.run`` starts one worker per GPU of the node, and a job spanning K
    nodes rendezvouses on ``rdzv_host:rdzv_port`` (node rank 0's address). ``plain``: the
    command as given, once per node, told its place by ``TIRESIAS_NODE_RANK`` and friends.
    """
    if spec.launcher == "plain":
        return list(spec.command)
    if spec.launcher != "torchrun":
        raise ValueError(f"unknown launcher {spec.launcher!r} (torchrun or plain)")
    nnodes = len(spec.placement)
    gpus = len(spec.placement[node_rank][1])
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
    if nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--master-addr", rdzv_host, "--master-port", str(rdzv_port)]
    script = list(spec.command)
    if script and os.path.basename(script[0]).startswith("python"):
        script = script[1:]            # "python train.py ..." -> torchrun runs train.py itself
    return cmd + script


def node_env(spec: LaunchSpec, node_rank: int, rdzv_host: str, rdzv_port: int,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of node ``node_rank``: the job's env plus its GPUs and its place in the run."""
    env = dict(os.environ if base is None else base)
    env.update(spec.env)
    gpus = spec.placement[node_rank][1]
    env.update({
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
        "TIRESIAS_RUN": str(spec.run),
        "TIRESIAS_NODE": spec.placement[node_rank][0],
        "TIRESIAS_NODE_RANK": str(node_rank),
        "TIRESIAS_NNODES": str(len(spec.placement)),
        "TIRESIAS_GPUS": str(sum(len(g) for _, g in spec.placement)),
        "TIRESIAS_RDZV": f"{rdzv_host}:{rdzv_port}",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def default_launcher(command: list[str]) -> str:
    """``torchrun`` for a Python script (``train.py ...`` or ``python train.py ...``), else ``plain``."""
    if not command:
        return "plain"
    first = os.path.basename(command[0])
    if first.endswith(".py"):
        return "torchrun"
    if first.startswith("python") and len(command) > 1 and command[1].endswith(".py"):
        return "torchrun"
    return "plain"
