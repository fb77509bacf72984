"""One training process's connection to the parameter service, as ``autops.torch`` uses it.

``WorkerContext`` holds the agent (None when training alone), this rank and the world size,
the tensors declared so far, the per-name counters of the collectives, the names that
``DistributedOptimizer``s took (unique within a job), and the pinned-memory stager for CUDA
tensors. The tensor helpers below turn torch tensors into the flat numpy arrays the agent
moves.
"""
from __future__ import annotations

from typing import Any

import torch

from .agent import Agent, AutoPSError, Handle
from .device import DeviceStager, host_array

__all__ = ["WorkerContext", "flat_numpy", "on_device", "dtype_name"]


class WorkerContext:
    def __init__(self, agent: Agent | None, rank: int, size: int) -> None:
        self.agent = agent
        self.rank = rank
        self.size = size
        self.iterations: dict[str, int] = {}
        self.bcast_seq: dict[str, int] = {}
        self.declared: set[str] = set()
        self.outstanding: list[tuple[Handle, Any]] = []
        self.optimizer_names: set[str] = set()     # every name a DistributedOptimizer declared
        self._stager: DeviceStager | None = None

    def stager(self) -> DeviceStager:
        """The pinned-memory stager for device tensors (started on first use)."""
        if self._stager is None:
            self._stager = DeviceStager()
        return self._stager

    def declare(self, entries: list[tuple]) -> None:
        """Declare the tensors of ``entries`` (``(name, shape, dtype, options)``) not yet declared."""
        new = [e for e in entries if e[0] not in self.declared]
        if new:
            self.agent.declare(new)
            self.declared.update(e[0] for e in new)

    def take_names(self, names: list[str]) -> None:
        """Reserve ``names`` for one optimizer; ``ValueError`` naming those already taken."""
        taken = sorted(set(names) & self.optimizer_names)
        if taken:
            shown = ", ".join(repr(n) for n in taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
            raise ValueError(
                f"parameter names {shown} are already used by another DistributedOptimizer of this job: "
                f"give each model its own names, e.g. DistributedOptimizer(opt, named_parameters="
                f"model.named_parameters(), prefix='generator.')")
        self.optimizer_names.update(names)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def flat_numpy(t: torch.Tensor):
    """A CPU tensor's flat numpy view; a device tensor's copy on the host (read-only use)."""
    if not t.is_contiguous():
        raise AutoPSError("tensor must be contiguous")
    return host_array(t if t.device.type == "cpu" else t.detach().cpu())


def on_device(t: torch.Tensor) -> bool:
    """True for a CUDA tensor (staged through pinned memory), False for a CPU one."""
    if t.device.type == "cpu":
        return False
    if t.device.type != "cuda":
        raise AutoPSError(f"tensor on {t.device}: AutoPS moves CPU and CUDA tensors")
    if not t.is_contiguous():
        raise AutoPSError("tensor must be contiguous")
    return True


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")
