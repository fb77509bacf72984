"""``gandiva``: the settings of Gandiva as the original Tiresias simulator models it.

The model (node sets, packing by GPU memory, time slicing, rebalancing) is
``tiresias.gandiva``; ``tiresias.sim`` runs it with its own event loop
(``tiresias.sim.gandiva``), since its jobs share GPUs by time slices rather than being
started and preempted by a priority order. Simulator only.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cluster import ClusterSpec

SWITCH_SECONDS = 60.0     # the released simulator switches time-sliced jobs every 60 s


@dataclass
class GandivaModel:
    """``make_policy("gandiva")``: the model's settings; ``tiresias.sim`` runs it with
    ``tiresias.sim.gandiva``. ``cluster`` is the node shape (default: the simulated one)."""
    switch: float = SWITCH_SECONDS
    cluster: ClusterSpec | None = None
    name: str = "gandiva"

    def __post_init__(self) -> None:
        if not self.switch > 0:
            raise ValueError(f"the switching period must be > 0 s, got {self.switch}")
