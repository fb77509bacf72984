"""The records of pMaster's pool, and the narrow view of pMaster its parts work through.

``AggInfo`` (one aggregator: identity, endpoints, state, cluster, load) and ``JobInfo`` (one
job: its keys, table, profile and elastic state) are the pool state pMaster keeps.
``PoolHost`` is what elasticity (``elastic``) and live migration (``migration``) may use of
pMaster: the aggregators and jobs, and a few actions (send to an aggregator, release a job,
forget an aggregator). Both modules type against it, so none of them imports ``master``.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol


@dataclass
class AggInfo:
    agg_id: str
    identity: bytes
    endpoints: dict
    host: str
    pid: int
    last_seen: float
    stats: dict = field(default_factory=dict)
    state: str = "idle"                 # idle | temporary | active | draining
    cluster: str | None = None
    reserved_for: str | None = None     # temporary: the job being profiled on it
    exclusive: str | None = None        # serves only this (reverted or dedicated) job
    busy: float | None = None           # estimated share of its execution cycle in use

    def alive(self, now: float, timeout: float) -> bool:
        return now - self.last_seen <= timeout


@dataclass
class JobInfo:
    job: str
    secret: str
    world_size: int
    num_aggregators: int
    mode: str
    average: bool
    optimizer: str | None
    hp: dict
    partition_bytes: int
    small_bytes: int
    aggregators: list
    ranks: set = field(default_factory=set)
    done_ranks: set = field(default_factory=set)
    tensors: dict = field(default_factory=dict)   # name -> (shape, dtype)
    keys: dict = field(default_factory=dict)      # key -> KeySpec
    table: dict = field(default_factory=dict)     # key -> agg id
    pending_acks: set = field(default_factory=set)
    parked: list = field(default_factory=list)    # (identity, req) waiting for acks
    failure: str | None = None
    created: float = field(default_factory=time.time)
    # elasticity
    requested: int = 0
    state: str = "profiling"            # profiling | packed | dedicated
    cluster: str | None = None
    home: str | None = None             # aggregator for broadcasts
    moves: dict = field(default_factory=dict)      # key -> (new aggregator, first iteration)
    touched: set = field(default_factory=set)      # aggregators that hold state of this job
    temps: list = field(default_factory=list)      # temporary aggregators of the profiling phase
    pending: set = field(default_factory=set)      # aggregators still starting for it
    best_effort: bool = False
    registrations: list = field(default_factory=list)   # (identity, req) waiting for pending
    iterations: int = 0
    rank_d: dict = field(default_factory=dict)     # rank -> latest mean iteration duration
    measured: float | None = None       # d_j: recent iteration duration (slowest rank)
    standalone: float | None = None     # D_j: profiled standalone iteration duration
    samples: list = field(default_factory=list)    # (iterations, mean duration) while profiling
    profiled: int = 0
    e: dict = field(default_factory=dict)          # key -> CPU seconds per iteration (EWMA)
    e_reports: int = 0
    low_iters: int = 0
    recent: collections.deque = field(default_factory=collections.deque)   # (iterations, mean d) in the window
    reverts: int = 0
    revert_waiting: tuple | None = None
    last_heard: float = field(default_factory=time.monotonic)

    def cost(self, key: str) -> float:
        """e_t of a key; keys not measured yet get the job's CPU time per byte times their size."""
        e = self.e.get(key)
        if e is not None:
            return e
        known = [(self.e[k], self.keys[k].nbytes) for k in self.e if k in self.keys]
        nbytes = sum(b for _, b in known)
        return sum(x for x, _ in known) / nbytes * self.keys[key].nbytes if nbytes else 0.0


class PoolHost(Protocol):
    """The part of pMaster that ``Elastic`` and ``Migrations`` use."""

    aggs: dict[str, AggInfo]
    jobs: dict[str, JobInfo]
    heartbeat_timeout: float

    def live_aggregators(self) -> list[AggInfo]: ...

    def load_bytes(self) -> dict[str, int]: ...

    def send_agg(self, agg: str, op: str, callback: Callable | None, **fields) -> None: ...

    def forget_aggregator(self, agg: str) -> None: ...

    def release_job(self, job_id: str) -> None: ...

    def flush_registrations(self, job: JobInfo) -> None: ...
