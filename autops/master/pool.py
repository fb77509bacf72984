"""pMaster's pool state: the aggregators, the jobs and the clusters, and the queries on them.

``AggInfo`` (one aggregator: identity, endpoints, state, cluster, load), ``JobInfo`` (one job:
its owner, keys, table, profile and elastic state) and ``Cluster`` (aggregators packed
together) are the records; ``PoolState`` holds them with the heartbeat timeout and the clock, keeps the
registry (aggregators by name and by socket identity, cluster names) and answers what
elasticity (``elastic``), live migration (``migration``) and reporting ask: the live and idle
aggregators, the bytes and tasks each one carries, the ``(D_j, e)`` loads the assignment policy
reads. Deciding what to change is theirs; this module imports no other part of pMaster.

A job's tenant is the name of the CURVE key its first registration came with (``tenant_of``);
the rule that a job cannot change owner is ``tenant_refused``.
"""
from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from dlrt.keys import MEMBER       # the services' own CURVE key: not a tenant

Clock = Callable[[], float]
Loads = dict[str, dict[str, tuple[float, float]]]


@dataclass
class AggInfo:
    agg_id: str
    identity: bytes
    endpoints: dict
    host: str
    pid: int
    last_seen: float
    stats: dict = field(default_factory=dict)
    state: str = "idle"                 # idle | temporary | active | draining (| starting: registering for a failover)
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
    pending_acks: set = field(default_factory=set)      # ASSIGN messages not answered yet
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
    last_heard: float = field(default_factory=time.monotonic)      # any word from its workers
    last_progress: float = field(default_factory=time.monotonic)   # its last pushes or new iterations
    # failures: server-mode keys' replicas, and what the agents compare to learn of a failover
    replicate: bool = True
    replicas: dict = field(default_factory=dict)   # key -> aggregator holding its replica
    epoch: int = 0                                 # bumped when keys moved after a failure
    lost_aggs: set = field(default_factory=set)    # aggregators of this job that were lost
    hint: dict = field(default_factory=dict)       # key -> preferred new owner (during a failover)
    adopted: dict = field(default_factory=dict)    # tensor -> settings, from aggregators after a restart
    # owner: the tenant (CURVE key name) its first registration came with; None: no tenant (no
    # CURVE, or the cluster's own key). ``tenant_known`` False: adopted after a restart with no
    # record of it; its next registration sets it
    tenant: str | None = None
    tenant_known: bool = True

    def conf(self, tensor: str) -> dict:
        """A tensor's settings (mode, average, optimizer, hp): as its workers declared it, or,
        for a job adopted after a restart whose workers have not declared again, as the
        aggregators holding it reported."""
        declared = self.tensors.get(tensor)
        return declared[2] if declared is not None else self.adopted[tensor]

    def cost(self, key: str) -> float:
        """e_t of a key; keys not measured yet get the job's CPU time per byte times their size."""
        e = self.e.get(key)
        if e is not None:
            return e
        known = [(self.e[k], self.keys[k].nbytes) for k in self.e if k in self.keys]
        nbytes = sum(b for _, b in known)
        return sum(x for x, _ in known) / nbytes * self.keys[key].nbytes if nbytes else 0.0


def tenant_of(peer: str | None) -> str | None:
    """The tenant a request's CURVE key names (``dlrt.curve.peer_name`` of its frames): the
    key's name; None without CURVE or for the cluster's own ``member`` key, which is no tenant."""
    return peer if peer and peer != MEMBER else None


def tenant_refused(known: bool, owner: str | None, tenant: str | None) -> bool:
    """Whether a registration of a job from ``tenant`` must be refused: the job's owner is
    ``known`` and is another (a job cannot change owner, nor gain or lose a tenant). A job whose
    owner is not known (adopted after a restart without a record of it) is refused nothing here."""
    return known and owner != tenant


@dataclass
class Cluster:
    """Aggregators packed together, and the jobs packed onto them (thesis §4.3.3.4)."""
    name: str
    aggs: set = field(default_factory=set)
    jobs: set = field(default_factory=set)


class PoolState:
    """The records of pMaster's pool and the queries on them; ``clock`` is the time source."""

    def __init__(self, heartbeat_timeout: float = 5.0, clock: Clock = time.monotonic) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.clock = clock
        self.aggs: dict[str, AggInfo] = {}
        self.by_identity: dict[bytes, str] = {}
        self.jobs: dict[str, JobInfo] = {}
        self.clusters: dict[str, Cluster] = {}
        self._cluster_ids = itertools.count()

    # --- aggregators ------------------------------------------------------------------------
    def add_aggregator(self, info: AggInfo) -> None:
        self.aggs[info.agg_id] = info
        self.by_identity[info.identity] = info.agg_id

    def forget_aggregator(self, agg: str) -> None:
        info = self.aggs.pop(agg, None)
        if info is not None:
            self.by_identity.pop(info.identity, None)

    def alive(self, info: AggInfo) -> bool:
        return info.alive(self.clock(), self.heartbeat_timeout)

    def live_aggregators(self) -> list[AggInfo]:
        now = self.clock()
        return [a for a in self.aggs.values() if a.alive(now, self.heartbeat_timeout)]

    def idle(self) -> list[AggInfo]:
        """Live aggregators without work, by name."""
        return sorted((a for a in self.live_aggregators() if a.state == "idle"), key=lambda a: a.agg_id)

    def busy_count(self) -> int:
        """Live aggregators that are not idle (temporary, active or draining)."""
        return sum(1 for a in self.live_aggregators() if a.state != "idle")

    def cluster_aggs(self, cluster: Cluster) -> list[str]:
        """The aggregators of ``cluster`` its controller may pack onto: active and shared."""
        return sorted(a for a in cluster.aggs if a in self.aggs and self.aggs[a].state == "active"
                      and self.aggs[a].exclusive is None)

    def open_cluster(self) -> Cluster:
        """A new cluster under a name no cluster has (restored ones included)."""
        name = f"c{next(self._cluster_ids)}"
        while name in self.clusters:
            name = f"c{next(self._cluster_ids)}"
        cluster = Cluster(name)
        self.clusters[cluster.name] = cluster
        return cluster

    def cluster_named(self, name: str) -> Cluster:
        """The cluster called ``name``, made when there is none (a restarted pMaster's)."""
        cluster = self.clusters.get(name)
        if cluster is None:
            cluster = self.clusters[name] = Cluster(name)
        return cluster

    # --- what the aggregators carry ------------------------------------------------------------
    def load_bytes(self) -> dict[str, int]:
        """Bytes of keys each aggregator owns (every registered aggregator, 0 when empty)."""
        load = {agg: 0 for agg in self.aggs}
        for job in self.jobs.values():
            for key, agg in job.table.items():
                load[agg] = load.get(agg, 0) + job.keys[key].nbytes
        return load

    def tasks_on(self, agg: str) -> dict[str, list[str]]:
        """job -> keys that ``agg`` owns or has been told to take over (``moves``)."""
        out: dict[str, list[str]] = {}
        for job in self.jobs.values():
            for key, owner in job.table.items():
                move = job.moves.get(key)
                if owner == agg or (move is not None and move[0] == agg):
                    out.setdefault(job.job, []).append(key)
        return out

    def loads(self, aggs: Iterable[str]) -> Loads:
        """{agg: {job: (D_j, sum of e_t of its keys there)}} for the assignment policy; jobs not
        profiled yet (no ``D_j``) are left out."""
        out: Loads = {a: {} for a in aggs}
        for job in self.jobs.values():
            d = job.standalone
            if d is None:
                continue
            for key, owner in job.table.items():
                if owner in out:
                    old = out[owner].get(job.job, (d, 0.0))
                    out[owner][job.job] = (d, old[1] + job.cost(key))
        return out
