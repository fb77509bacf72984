"""What a simulation returns: the jobs with their times, and the run's figures."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..policies.base import JobState


@dataclass
class SimResult:
    policy: str
    jobs: list[JobState]
    capacity: int
    makespan: float
    busy_gpu_seconds: float
    preemptions: int
    wall_seconds: float
    events: int = 0
    timeline: list = field(default_factory=list)   # (time, job_id, "start"|"stop"|"end") when recorded
    placement: str = "count"
    placement_waits: int = 0          # admitted by count, not placeable (consolidation blocked)
    repacks: int = 0
    migrations: int = 0               # jobs moved by repacks (with the matching)
    migrations_naive: int = 0         # ... had the new plan been applied without renaming nodes
    overhead_seconds: float = 0.0
