"""The driver's configuration (``DriverConfig``): placement, cost models, the progress
guarantee, rounds and GPU sharing; filled from the command line (``tiresias.cli``) or the live
master's options (``tiresias.service``), checked here."""
from __future__ import annotations

from dataclasses import dataclass

from . import placement as plc
from . import progress
from .packing.rounds import PACKINGS

PLACEMENTS = ("count", "tiresias", "consolidate", "spread", "most-free")


@dataclass
class DriverConfig:
    placement: str = "count"
    packlimit: float = plc.DEFAULT_PACKLIMIT
    overheads: bool = False        # charge pause + resume on every resume after a preemption
    slowdown: bool = False         # slow down skewed jobs placed unconsolidated
    migrate: bool = False          # repack + Hungarian renaming when consolidation is blocked
    defer_release: bool = False    # live: preempted jobs hold their GPUs until ``released``
    preemption_cost: float | None = None   # seconds per resume instead of the model's (measured live)
    min_run_factor: float = progress.DEFAULT_MIN_RUN_FACTOR   # progress guarantee: k x resume cost
    min_run: float = progress.DEFAULT_MIN_RUN                 # ... and at least this many seconds
    start_cost: float = 0.0        # simulator, with overheads: seconds charged at a job's first start
    decide_every: float | None = None   # simulator: passes only at multiples of this (Pollux's 60 s)
    packing: str | None = None     # GPU sharing by rounds: "tesserae" (matching) or "gavel" (greedy)
    learn_profiles: bool = False   # GPU sharing: fold the speeds packed jobs run at into the profile
    fresh_plans: bool = False      # GPU sharing: plan each round from an empty cluster (Tesserae as published)

    def __post_init__(self) -> None:
        progress.check_guard(self.min_run_factor, self.min_run)
        for name in ("preemption_cost", "start_cost", "decide_every"):
            value = getattr(self, name)
            if value is None:
                continue
            if not ((value > 0 if name == "decide_every" else value >= 0) and value < float("inf")):
                raise ValueError(f"{name} must be a finite number of seconds >= 0 (decide_every > 0), "
                                 f"got {value!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.packing is not None:
            if self.packing not in PACKINGS:
                raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
            if self.placement == "count" or self.migrate or self.decide_every is None:
                raise ValueError("GPU sharing plans GPUs on nodes in rounds: it needs node placement, "
                                 "a round length (decide_every) and no repacking (migrate)")
        if self.defer_release and (self.placement == "count" or self.migrate):
            raise ValueError("live scheduling places jobs on nodes and does not repack running jobs "
                             "(placement 'count' and migrate are simulator-only)")
