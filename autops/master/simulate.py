"""``autops simulate``: trace-driven simulation of the AutoPS aggregator pool (thesis §4.5.2.4,
Fig. 4.12).

It replays a job trace (``dlrt.trace.load_trace``) through the *same* pure policy code
pMaster runs -- ``assignment.pack_job`` / ``recycle`` (Pseudocode 3, §4.3.3.2-3) and
``scaling.cluster_free_cpu`` / ``choose_cluster`` / ``allocate_now`` / ``idle_to_release``
(§4.3.3.4) -- with no processes or sockets, and compares the aggregators AutoPS keeps allocated
with the parameter servers the running jobs would reserve standalone (ps-lite), sampled every
``--interval`` seconds of simulated time. Deterministic for a given ``--seed``.

Model of a job (assumptions, all reported in the JSON):

* Jobs run from ``submit_time`` for ``duration`` seconds: this studies the parameter service,
  not GPU scheduling, so there is no queueing.
* Workers ``W = ceil(num_gpus / 4)`` (one per 4-GPU machine, the thesis' "Ns-Nw" jobs) and the
  user's standalone request is as many parameter servers, ``requested = W``.
* Model: the trace's model column when it names a known model, else drawn with a seeded RNG
  from ``--models``. Tasks are the model's aggregation keys as the live system cuts them
  (``partition.plan_keys``: 4 MiB partitions, pMaster's choice for a model of 32 MiB or more
  that it packs -- a live job asking for W aggregators of its own may get smaller ones,
  ``partition.auto_partition_bytes``; keys under 64 KiB are still separate keys).
* Standalone iteration duration ``D`` per model, an assumed table (``ITER_SECONDS``; override
  with ``--iter-seconds``): vgg19 1.0 s, resnet50 0.6 s, bert-base 0.9 s, bert-large 1.8 s,
  alexnet 0.35 s (4 GPUs per worker, maximum batch; rough, not measured here).
* CPU time of a task per iteration ``e_t = W * bytes / AGG_RATE``; ``AGG_RATE`` = 2e9 bytes
  per CPU-second (about numpy's in-place add throughput; an assumption, ``--agg-rate``).
  A job's CPU demand is ``assignment.job_demand(D, costs)`` aggregators.

Events: on arrival a job holds ``requested`` temporary dedicated aggregators for
``--profile-seconds`` (profiling, §4.3.3.1; a job that ends sooner never leaves them); then
pMaster picks the best-fit cluster (``choose_cluster`` over ``cluster_free_cpu``; None opens a
new cluster) and that cluster packs the job (``pack_job``), opening aggregators where nothing
fits; the temporaries are given back. If the packing opens ``n`` aggregators and
``allocate_now(n, --threshold)`` says no, the allocation is *deferred* for real: the job stays on
its temporaries and is placed afresh (allocation granted) at the next period boundary.

``--cluster-size`` bounds a cluster as far as one job allows: with ``--oversize spill``
(default) a cluster whose packing of the job would take it past the bound is passed over for
the next best fit (``choose_cluster`` over the rest), and a new cluster is opened when none
takes the job; only a job that alone needs more than ``--cluster-size`` aggregators makes a
bigger cluster (``oversize_placements``). A job is never split across clusters. With
``--oversize grow`` the first choice is final and the cluster grows as needed (free CPU counts
unused shares of aggregators that other models' jobs cannot use, so clusters then grow far).

On exit the job's tasks are removed; with ``--release exit`` (default) aggregators left empty
are given back at once, then ``recycle`` runs in that cluster and its plan is applied (each
moved task is a migration; freed aggregators are given back). With ``--release period`` empty
and recycled aggregators stay allocated (idle, still used for new jobs) until the next period
boundary, the behaviour behind the thesis' ratios above 1. Every ``--period`` seconds: deferred
jobs are placed, ``recycle`` runs on each cluster changed since its last recycle (``recycle``
is a deterministic function of the cluster's state, so skipping unchanged ones changes
nothing), ``idle_to_release`` gives idle aggregators back and clusters without aggregators are
dissolved. A ``recycle`` plan is applied whole, as pMaster applies it: every moved task goes
once, straight to its last destination (``assignment.final_moves``).

Allocated aggregators (temporaries included) and requested ones (sum of ``requested`` of
running jobs) are integrated exactly over time (``cpu_saving``) and sampled every
``--interval`` seconds (ratio percentiles, the series and the plot). ``fluid_bound_saving`` is
what a perfectly divisible packing would save (demand instead of allocated aggregators).

Speed (none of it changes a decision): a job's keys are computed once per model and their
costs once per (model, W); Pseudocode 3 is given each aggregator's jobs merged by equal ``D``
(``merge_by_duration``), the cluster's aggregators narrowed to those where a task of the job
could go (``fitting_aggregators``), clusters that would surely exceed their bound are passed
over unpacked (``must_open``), and a ``recycle`` whose first victim provably cannot be emptied
is not run (``recycle_is_futile``). Tasks are never coarsened. The full Philly trace (82k jobs)
takes about 3-4.5 minutes on a 2-vCPU machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

from dlrt import cli
from dlrt.trace import ignored_message, load_trace, skipped_message

from .assignment import (LOSS_LIMIT, _EPS, Loads, busy_fraction, final_moves, holds, job_demand, joined_cycle,
                         pack_job, recycle, runs_per_cycle)
from ..models import model_tensors
from ..wire.partition import DEFAULT_PARTITION_BYTES, DEFAULT_SMALL_BYTES, plan_keys
from .scaling import allocate_now, choose_cluster, cluster_free_cpu, idle_to_release

# Assumed standalone iteration durations (seconds), 4 GPUs per worker, maximum batch size.
ITER_SECONDS: dict[str, float] = {
    "vgg19": 1.0, "resnet50": 0.6, "bert-base": 0.9, "bert-large": 1.8, "alexnet": 0.35,
}
AGG_RATE = 2e9                  # assumed aggregation bytes per CPU-second (numpy add-like)
GPUS_PER_WORKER = 4
DEFAULT_MODELS = ("vgg19", "resnet50", "bert-base", "alexnet")
SERIES_POINTS = 2000            # at most this many [t, allocated, requested] points in the JSON

_EXIT, _PROFILED, _ARRIVE = 0, 1, 2       # order of simultaneous events


# --- pure helpers --------------------------------------------------------------------------
def fitting_aggregators(loads: Loads, job: str, duration: float, min_cost: float,
                        loss_limit: float = LOSS_LIMIT) -> dict[str, Mapping[str, tuple[float, float]]]:
    """The aggregators of ``loads`` where ``pack_task`` could put at least one task of ``job``.

    Runs ``pack_task``'s own two tests (``joined_cycle``, ``holds``): the loss test depends only
    on the jobs' durations (and the job's own), which packing more of this job does not change,
    and free time only shrinks as tasks are added; so an aggregator failing either test now (for
    the cheapest task, ``min_cost``) is never chosen by ``pack_job`` for this job, and dropping
    it leaves ``pack_job``'s result unchanged. ``job`` must not be on any of them yet.
    """
    out: dict[str, Mapping[str, tuple[float, float]]] = {}
    for name, jobs in loads.items():
        joined = joined_cycle(jobs, job, duration, loss_limit)
        if joined is not None and holds(joined[1], duration, joined[0], min_cost):
            out[name] = jobs
    return out


def merge_by_duration(jobs: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """One aggregator's jobs with equal ``D`` merged into one entry ``(D, sum of their e)``.

    Pseudocode 3 sees an aggregator's jobs only through their durations (cycle, loss) and
    ``runs_per_cycle(D, C) * e`` summed over them (free time), so jobs sharing a ``D`` may be
    summed first: ``pack_task``, ``pack_job`` and ``recycle`` decide the same on the merged
    view, up to the order of floating-point additions (bit-identical when all jobs on an
    aggregator share one ``D``, as with the default table, where no two models can share an
    aggregator). A job being packed or moved, not found there, gets its own entry as usual.
    Entry names ``"D=<D>"`` cannot be job names (those are ``j<N>``).
    """
    out: dict[str, tuple[float, float]] = {}
    for d, e in jobs.values():
        name = f"D={d!r}"
        prev = out.get(name)
        out[name] = (d, e) if prev is None else (d, prev[1] + e)
    return out


def room_for(candidates: Loads, job: str, duration: float, loss_limit: float = LOSS_LIMIT) -> float:
    """An upper bound on the CPU time per iteration of ``job``'s tasks that ``candidates`` can take.

    A task of cost ``e`` joins aggregator ``n`` only while ``runs * e <= F_n`` (and ``F_n``
    only shrinks as the job's tasks join), so ``n`` takes at most ``F_n / runs`` of the job,
    and nothing where ``joined_cycle``'s loss test fails.
    """
    room = 0.0
    for jobs in candidates.values():
        joined = joined_cycle(jobs, job, duration, loss_limit)
        if joined is not None:
            cycle, free = joined
            room += max(0.0, free + _EPS) / runs_per_cycle(duration, cycle)
    return room


def must_open_given(room: float, duration: float, total_cost: float) -> int:
    """Aggregators a job of ``total_cost`` surely opens when existing ones take at most ``room``:
    a new aggregator holds at most ``duration`` of it."""
    excess = total_cost - room
    return max(0, math.ceil(excess / duration - 1e-6)) if excess > 0 else 0


def must_open(candidates: Loads, job: str, duration: float, total_cost: float,
              loss_limit: float = LOSS_LIMIT) -> int:
    """A lower bound on the aggregators ``pack_job`` opens for ``job`` (tasks summing to
    ``total_cost``, none placed yet) over ``candidates``."""
    return must_open_given(room_for(candidates, job, duration, loss_limit), duration, total_cost)


def recycle_is_futile(aggregators: Loads, tasks: Mapping[str, Sequence[tuple[str, str, float]]],
                      durations: Mapping[str, float], loss_limit: float = LOSS_LIMIT,
                      exclude: Sequence[str] = ()) -> bool:
    """True when ``recycle`` with these arguments surely returns an empty plan.

    ``recycle`` stops at the first aggregator it cannot empty, so its plan is empty when the
    first candidate victim (least busy, as ``recycle`` orders them) cannot be emptied. When all
    that victim's tasks belong to jobs of one duration ``D``, the others can take at most
    ``sum_n (F_n + eps) / runs_n`` of them (``F_n`` with the victim's jobs added; 0 where the
    loss test fails), the same bound as ``room_for``; less than the victim's total proves it.
    Otherwise (several durations on the victim) this answers False.
    """
    blocked = set(exclude)
    loads = {n: jobs for n, jobs in aggregators.items() if n not in blocked}
    victims = [n for n in loads if loads[n]]
    if not victims:
        return True
    victim = min(victims, key=lambda n: (busy_fraction(loads[n]), n))
    if len(loads) < 2:
        return True
    moving = tasks.get(victim, ())
    durs = {durations[job] for job, _, _ in moving}
    if len(durs) != 1:
        return False
    (d,) = durs
    need = math.fsum(cost for _, _, cost in moving)
    others = {name: jobs for name, jobs in loads.items() if name != victim}
    return need > room_for(others, "\0victim", d, loss_limit) + 1e-7


def workers_of(num_gpus: int) -> int:
    """Worker machines (and standalone parameter servers) of a job: one per 4 GPUs."""
    return max(1, math.ceil(num_gpus / GPUS_PER_WORKER))


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` (0..100) of an ascending sequence; None when it
    is empty (JSON has no NaN)."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# --- configuration and state ----------------------------------------------------------------
@dataclass
class SimConfig:
    models: tuple[str, ...] = DEFAULT_MODELS
    iter_seconds: dict[str, float] = field(default_factory=lambda: dict(ITER_SECONDS))
    agg_rate: float = AGG_RATE
    seed: int = 0
    cluster_size: int = 16
    loss_limit: float = LOSS_LIMIT
    period: float = 300.0
    threshold: int = 1
    profile_seconds: float = 60.0
    interval: float = 60.0
    release: str = "exit"                  # "exit" or "period"
    oversize: str = "spill"                # "spill" or "grow"
    shapes: str | None = None
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    small_bytes: int = DEFAULT_SMALL_BYTES

    def check(self) -> None:
        for name in ("agg_rate", "period", "interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive")
        if self.cluster_size < 1:
            raise ValueError("cluster-size must be at least 1")
        if self.threshold < 1:
            raise ValueError("threshold must be at least 1")
        if self.profile_seconds < 0:
            raise ValueError("profile-seconds must be >= 0")
        if not 0 < self.loss_limit <= 1:
            raise ValueError("loss-limit must be in (0, 1]")
        if self.release not in ("exit", "period"):
            raise ValueError("release must be 'exit' or 'period'")
        if self.oversize not in ("spill", "grow"):
            raise ValueError("oversize must be 'spill' or 'grow'")
        if not self.models:
            raise ValueError("models: give at least one model")
        for m in self.models:
            if m not in self.iter_seconds:
                raise ValueError(f"model {m!r} has no iteration duration; add it with --iter-seconds {m}=SECONDS")
        for m, d in self.iter_seconds.items():
            if not d > 0:
                raise ValueError(f"iteration duration of {m!r} must be positive, got {d}")


@dataclass
class _Job:
    jid: str
    requested: int
    duration: float                       # standalone iteration duration D
    demand: float
    tasks: list[tuple[str, float]]        # (globally unique task name, CPU seconds per iteration)
    min_cost: float
    total_cost: float
    state: str = "profiling"              # profiling | deferred | placed | done
    cluster: str | None = None
    where: dict[str, str] = field(default_factory=dict)      # task -> aggregator


@dataclass
class _Cluster:
    loads: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    tasks: dict[str, dict[str, tuple[str, float]]] = field(default_factory=dict)
    dirty: bool = True                    # changed since its last recycle
    free: float | None = None             # cached cluster_free_cpu
    merged: dict[str, dict[str, tuple[float, float]]] | None = None     # cached merge_by_duration
    fits: dict[tuple[float, float], tuple[dict, float]] = field(default_factory=dict)  # cached candidates


class _TaskView(Mapping):
    """``recycle``'s ``tasks`` argument, built lazily per aggregator it asks for."""

    def __init__(self, tasks: dict[str, dict[str, tuple[str, float]]]):
        self._tasks = tasks

    def __getitem__(self, agg: str) -> list[tuple[str, str, float]]:
        return [(job, task, cost) for task, (job, cost) in self._tasks[agg].items()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)


class Simulation:
    """One replay of a trace; ``run(jobs)`` returns the result dictionary."""

    def __init__(self, config: SimConfig, progress: bool = False):
        config.check()
        self.cfg = config
        self.progress = progress
        self.rng = random.Random(config.seed)
        self._keys: dict[str, list[tuple[str, int]] | None] = {}
        self._costs: dict[tuple[str, int], list[tuple[str, float]]] = {}
        self.clusters: dict[str, _Cluster] = {}
        self.jobs: dict[str, _Job] = {}
        self.durations: dict[str, float] = {}
        self.deferred: dict[str, _Job] = {}
        self.next_agg = 0
        self.next_cluster = 0
        # accounting
        self.now = 0.0
        self.last = 0.0
        self.temp = 0                     # temporary (profiling) aggregators
        self.n_aggs = 0                   # aggregators in clusters
        self.requested = 0
        self.demand = 0.0
        self.area_alloc = 0.0
        self.area_req = 0.0
        self.area_demand = 0.0
        self.peak_alloc = 0
        self.peak_req = 0
        self.samples_t = array("d")
        self.samples_alloc = array("l")
        self.samples_req = array("l")
        self.stats = dict(migrations=0, recycled_aggregators=0, aggregators_opened=0, aggregators_released=0,
                          deferred_allocations=0, oversize_placements=0, spills=0, clusters_opened=0,
                          clusters_dissolved=0, clusters_peak=0, largest_cluster=0, jobs_placed=0,
                          jobs_exited_while_profiling=0, recycle_calls=0, recycle_futile=0)
        self.model_counts: dict[str, int] = {}

    # --- job model --------------------------------------------------------------------------
    def model_keys(self, model: str) -> list[tuple[str, int]] | None:
        """``(key, nbytes)`` of a model, or None when the shapes file does not have it."""
        if model not in self._keys:
            try:
                tensors = model_tensors(model, self.cfg.shapes)
            except ValueError:
                self._keys[model] = None
            else:
                keys = plan_keys(tensors, self.cfg.partition_bytes, self.cfg.small_bytes)
                self._keys[model] = [(k.key, k.nbytes) for k in keys]
        return self._keys[model]

    def pick_model(self, trace_model: str | None) -> str:
        if trace_model and trace_model in self.cfg.iter_seconds and self.model_keys(trace_model):
            return trace_model
        return self.rng.choice(self.cfg.models)

    def task_costs(self, model: str, workers: int) -> list[tuple[str, float]]:
        """``(key, e_t)`` of a model's keys for ``workers`` workers (cached)."""
        ck = (model, workers)
        if ck not in self._costs:
            keys = self.model_keys(model)
            if keys is None:
                raise ValueError(f"model {model!r} is not in the tensor shapes file")
            self._costs[ck] = [(k, workers * nbytes / self.cfg.agg_rate) for k, nbytes in keys]
        return self._costs[ck]

    def make_job(self, jid: str, num_gpus: int, trace_model: str | None) -> _Job:
        model = self.pick_model(trace_model)
        self.model_counts[model] = self.model_counts.get(model, 0) + 1
        w = workers_of(num_gpus)
        costs = self.task_costs(model, w)
        d = self.cfg.iter_seconds[model]
        tasks = [(f"{jid}|{k}", c) for k, c in costs]
        return _Job(jid, w, d, job_demand(d, (c for _, c in costs)), tasks, min(c for _, c in costs),
                    math.fsum(c for _, c in costs))

    # --- accounting -------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        return self.temp + self.n_aggs

    def _integrate(self, t: float) -> None:
        dt = t - self.last
        if dt > 0:
            alloc = self.allocated
            self.area_alloc += alloc * dt
            self.area_req += self.requested * dt
            self.area_demand += max(0.0, self.demand) * dt
            self.peak_alloc = max(self.peak_alloc, alloc)
            self.peak_req = max(self.peak_req, self.requested)
            self.last = t

    def _sample(self, t: float) -> None:
        self.samples_t.append(t)
        self.samples_alloc.append(self.allocated)
        self.samples_req.append(self.requested)

    # --- cluster operations -----------------------------------------------------------------
    def _touch(self, cl: _Cluster) -> None:
        cl.dirty = True
        self._changed(cl)

    @staticmethod
    def _changed(cl: _Cluster) -> None:
        cl.free = None
        cl.merged = None
        cl.fits = {}

    @staticmethod
    def _merged(cl: _Cluster) -> dict[str, dict[str, tuple[float, float]]]:
        if cl.merged is None:
            cl.merged = {name: merge_by_duration(jobs) for name, jobs in cl.loads.items()}
        return cl.merged

    def _cluster_free(self, cl: _Cluster) -> float:
        if cl.free is None:
            cl.free = cluster_free_cpu(cl.loads, self.cfg.cluster_size)
        return cl.free

    def _release(self, cl: _Cluster, agg: str) -> None:
        del cl.loads[agg]
        del cl.tasks[agg]
        self.n_aggs -= 1
        self.stats["aggregators_released"] += 1
        self._touch(cl)

    def _new_name(self, i: int) -> str:
        return f"a{self.next_agg + i}"

    def _pack_in(self, cname: str | None, job: _Job) -> tuple[dict[str, str], list[str]] | None:
        """``pack_job`` in a cluster (None: a new one); None when, with ``oversize="spill"``, the
        packing would surely take the cluster past ``cluster_size`` (``must_open`` bound)."""
        cfg = self.cfg
        if cname is None:
            return pack_job(job.jid, job.duration, job.tasks, {}, self._new_name, cfg.loss_limit)
        cl = self.clusters[cname]
        ck = (job.duration, job.min_cost)
        if ck not in cl.fits:         # the same for every job of this (model, workers) until cl changes
            cand = fitting_aggregators(self._merged(cl), job.jid, job.duration, job.min_cost, cfg.loss_limit)
            cl.fits[ck] = (cand, room_for(cand, job.jid, job.duration, cfg.loss_limit))
        candidates, room = cl.fits[ck]
        if cfg.oversize == "spill":
            lower = must_open_given(room, job.duration, job.total_cost)
            if lower > 0 and len(cl.loads) + lower > cfg.cluster_size:
                return None
        return pack_job(job.jid, job.duration, job.tasks, candidates, self._new_name, cfg.loss_limit)

    def _choose(self, job: _Job) -> tuple[str | None, dict[str, str], list[str]]:
        """pMaster's forwarding: best-fit cluster by free CPU, then the cluster's packing.

        With ``oversize="spill"`` a cluster whose packing would take it past ``cluster_size``
        aggregators is passed over for the next best fit (``choose_cluster`` over the rest);
        None (a new cluster) when no cluster takes the job within the bound. With ``"grow"``
        the first choice is final and the cluster grows as needed.
        """
        free = {name: self._cluster_free(cl) for name, cl in self.clusters.items()}
        while True:
            cname = choose_cluster(free, job.demand)
            packed = self._pack_in(cname, job)
            if packed is None:
                self.stats["spills"] += 1
                del free[cname]
                continue
            table, opened = packed
            if (cname is None or self.cfg.oversize == "grow" or not opened
                    or len(self.clusters[cname].loads) + len(opened) <= self.cfg.cluster_size):
                return cname, table, opened
            self.stats["spills"] += 1
            del free[cname]

    def _place(self, job: _Job, force: bool) -> None:
        """Forward a profiled job to a cluster and pack it there (or defer the allocation)."""
        cfg = self.cfg
        cname, table, opened = self._choose(job)
        if opened and not force and not allocate_now(len(opened), cfg.threshold):
            if job.state != "deferred":
                self.stats["deferred_allocations"] += 1
            job.state = "deferred"
            self.deferred[job.jid] = job
            return
        if cname is None:
            cname = f"c{self.next_cluster}"
            self.next_cluster += 1
            self.clusters[cname] = _Cluster()
            self.stats["clusters_opened"] += 1
            self.stats["clusters_peak"] = max(self.stats["clusters_peak"], len(self.clusters))
        cl = self.clusters[cname]
        self.next_agg += len(opened)
        for agg in opened:
            cl.loads[agg] = {}
            cl.tasks[agg] = {}
        self.n_aggs += len(opened)
        self.stats["aggregators_opened"] += len(opened)
        for task, cost in job.tasks:
            agg = table[task]
            d_old, e_old = cl.loads[agg].get(job.jid, (job.duration, 0.0))
            cl.loads[agg][job.jid] = (d_old, e_old + cost)
            cl.tasks[agg][task] = (job.jid, cost)
        job.where = table
        job.cluster = cname
        job.state = "placed"
        self.deferred.pop(job.jid, None)
        self.durations[job.jid] = job.duration
        self.temp -= job.requested
        self._touch(cl)
        self.stats["jobs_placed"] += 1
        if len(cl.loads) > cfg.cluster_size and opened:
            self.stats["oversize_placements"] += 1
        self.stats["largest_cluster"] = max(self.stats["largest_cluster"], len(cl.loads))

    def _recycle(self, cl: _Cluster) -> None:
        """Run ``recycle`` on a cluster and apply its plan whole, as pMaster does: each moved
        task goes once, straight to its last destination (``final_moves``); victims are freed."""
        idle = [agg for agg, jobs in cl.loads.items() if not jobs]
        merged, view = self._merged(cl), _TaskView(cl.tasks)
        if recycle_is_futile(merged, view, self.durations, self.cfg.loss_limit, exclude=idle):
            self.stats["recycle_futile"] += 1
            cl.dirty = False
            return
        self.stats["recycle_calls"] += 1
        plan = recycle(merged, view, self.durations, self.cfg.loss_limit, exclude=idle)
        victims = [victim for victim, _ in plan]
        origin = {task: victim for victim in victims for task in cl.tasks[victim]}
        moves = final_moves(plan)
        for task, dest in moves.items():
            jid, cost = cl.tasks[origin[task]].pop(task)
            cl.tasks[dest][task] = (jid, cost)
            d_old, e_old = cl.loads[dest].get(jid, (self.durations[jid], 0.0))
            cl.loads[dest][jid] = (d_old, e_old + cost)
            self.jobs[jid].where[task] = dest
        self.stats["migrations"] += len(moves)
        for victim in victims:
            if cl.tasks[victim]:
                raise AssertionError(f"recycle plan for {victim} does not move all its tasks")
            self.stats["recycled_aggregators"] += 1
            cl.loads[victim] = {}
            self._changed(cl)
            if self.cfg.release == "exit":
                self._release(cl, victim)
        cl.dirty = bool(plan)

    def _period(self) -> None:
        for job in list(self.deferred.values()):
            self._place(job, force=True)
        for cl in self.clusters.values():
            if cl.dirty:
                self._recycle(cl)
        for name in list(self.clusters):
            cl = self.clusters[name]
            for agg in idle_to_release(cl.loads):
                self._release(cl, agg)
            if not cl.loads:
                del self.clusters[name]
                self.stats["clusters_dissolved"] += 1

    # --- events -----------------------------------------------------------------------------
    def _arrive(self, job: _Job) -> None:
        self.jobs[job.jid] = job
        self.temp += job.requested
        self.requested += job.requested
        self.demand += job.demand

    def _exit(self, job: _Job) -> None:
        self.requested -= job.requested
        self.demand -= job.demand
        if job.state in ("profiling", "deferred"):
            if job.state == "profiling":
                self.stats["jobs_exited_while_profiling"] += 1
            self.temp -= job.requested
            self.deferred.pop(job.jid, None)
        elif job.state == "placed":
            cl = self.clusters[job.cluster]
            touched = set()
            for task, agg in job.where.items():
                del cl.tasks[agg][task]
                touched.add(agg)
            for agg in touched:
                del cl.loads[agg][job.jid]
            del self.durations[job.jid]
            self._touch(cl)
            if self.cfg.release == "exit":
                for agg in sorted(touched):
                    if not cl.loads[agg]:
                        self._release(cl, agg)
            self._recycle(cl)
        job.state = "done"
        job.tasks = []
        job.where = {}
        del self.jobs[job.jid]

    def _advance(self, t: float, inclusive: bool = False) -> None:
        """Period boundaries and samples before ``t`` (at ``t`` too when ``inclusive``)."""
        cfg = self.cfg
        while True:
            tp = self._np * cfg.period
            ts = self._ns * cfg.interval
            nxt = min(tp, ts)
            if nxt > t or (nxt == t and not inclusive):
                return
            self._integrate(nxt)
            if tp <= ts:
                self._period()
                self._np += 1
            else:
                self._sample(nxt)
                self._ns += 1

    def run(self, trace_jobs: Sequence[Any]) -> dict[str, Any]:
        """Replay ``trace_jobs`` (``TraceJob``-like, sorted by submit time)."""
        import heapq
        started = time.perf_counter()
        cfg = self.cfg
        heap: list[tuple[float, int, int, str]] = []
        specs: dict[str, Any] = {}
        for seq, tj in enumerate(trace_jobs):
            jid = f"j{tj.job_id}"
            specs[jid] = tj
            heap.append((float(tj.submit_time), _ARRIVE, seq, jid))
        heapq.heapify(heap)
        seq = len(heap)
        self._np, self._ns = 1, 0               # next period boundary k*period (k >= 1), next sample
        end = 0.0
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=len(trace_jobs), unit="job", file=sys.stderr, mininterval=0.5)
        pending: dict[str, _Job] = {}
        while heap:
            t, kind, _, jid = heapq.heappop(heap)
            self._advance(t)
            self._integrate(t)
            self.now = t
            end = max(end, t)
            if kind == _ARRIVE:
                tj = specs.pop(jid)
                job = self.make_job(jid, tj.num_gpus, getattr(tj, "model", None))
                self._arrive(job)
                pending[jid] = job
                seq += 1
                heapq.heappush(heap, (t + float(tj.duration), _EXIT, seq, jid))
                seq += 1
                heapq.heappush(heap, (t + cfg.profile_seconds, _PROFILED, seq, jid))
                if bar is not None:
                    bar.update(1)
            elif kind == _PROFILED:
                job = pending.get(jid)
                if job is not None and job.state == "profiling":
                    self._place(job, force=False)
            else:
                self._exit(pending.pop(jid))
        self._advance(end, inclusive=True)
        self._integrate(end)
        if bar is not None:
            bar.close()
        return self.result(len(trace_jobs), end, time.perf_counter() - started)

    # --- results ----------------------------------------------------------------------------
    def result(self, njobs: int, end: float, wall: float) -> dict[str, Any]:
        cfg = self.cfg
        ratios = sorted(a / r for a, r in zip(self.samples_alloc, self.samples_req) if r > 0)
        sum_a = float(sum(self.samples_alloc))
        sum_r = float(sum(self.samples_req))
        n = len(self.samples_t)
        step = max(1, math.ceil(n / SERIES_POINTS))
        series = [[self.samples_t[i], self.samples_alloc[i], self.samples_req[i]] for i in range(0, n, step)]
        return {
            "cpu_saving": 1 - self.area_alloc / self.area_req if self.area_req else 0.0,
            "cpu_saving_sampled": 1 - sum_a / sum_r if sum_r else 0.0,
            "fluid_bound_saving": 1 - self.area_demand / self.area_req if self.area_req else 0.0,
            "allocated_aggregator_seconds": self.area_alloc,
            "requested_aggregator_seconds": self.area_req,
            "demand_aggregator_seconds": self.area_demand,
            "jobs": njobs,
            "simulated_seconds": end,
            "samples": n,
            "samples_with_requests": len(ratios),
            "ratio_percentiles": {
                "p50": percentile(ratios, 50), "p90": percentile(ratios, 90),
                "p99": percentile(ratios, 99), "max": ratios[-1] if ratios else None,
            },
            "share_of_time_ratio_below_1": (sum(1 for r in ratios if r < 1) / len(ratios)) if ratios else None,
            "peak_allocated": self.peak_alloc,
            "peak_requested": self.peak_req,
            **self.stats,
            "model_counts": dict(sorted(self.model_counts.items())),
            "wall_seconds": wall,
            "parameters": {
                "models": list(cfg.models), "seed": cfg.seed, "cluster_size": cfg.cluster_size,
                "loss_limit": cfg.loss_limit, "period_s": cfg.period, "threshold": cfg.threshold,
                "profile_seconds": cfg.profile_seconds, "interval_s": cfg.interval,
                "release": cfg.release, "oversize": cfg.oversize, "partition_bytes": cfg.partition_bytes,
                "small_bytes": cfg.small_bytes, "shapes": cfg.shapes or "(default)",
            },
            "assumptions": {
                "iteration_seconds": dict(cfg.iter_seconds),
                "agg_rate_bytes_per_cpu_second": cfg.agg_rate,
                "gpus_per_worker": GPUS_PER_WORKER,
                "workers": "ceil(num_gpus / 4); requested parameter servers = workers",
                "task_cpu_seconds": "workers * key_bytes / agg_rate per iteration",
                "jobs_run_at_submit": "no GPU queueing: a job runs from submit_time for duration",
                "temporaries": "requested dedicated aggregators for profile_seconds, counted as allocated",
                "deferral": "an allocation allocate_now() refuses waits (job on its temporaries) "
                            "until the next period boundary, then is granted",
                "cluster_size": "bound per cluster: a cluster the job would overfill is passed over "
                                "(oversize=spill) unless the job alone needs more; oversize=grow lets it grow",
                "release": "exit: empty aggregators given back at job exit / recycle; period: kept idle "
                           "(and reusable) until the next period boundary",
            },
            "key_counts": {m: len(k) for m, k in sorted(self._keys.items()) if k is not None},
            "series_columns": ["t_seconds", "allocated", "requested"],
            "series_step_samples": step,
            "series": series,
            "_ratios": ratios,
            "_samples": (self.samples_t, self.samples_alloc, self.samples_req),
        }


def simulate(trace_jobs: Sequence[Any], config: SimConfig | None = None, progress: bool = False) -> dict[str, Any]:
    """Replay ``trace_jobs`` and return the result (private ``_``-prefixed keys hold full samples)."""
    return Simulation(config or SimConfig(), progress=progress).run(trace_jobs)


def public(result: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-serialisable part of a result."""
    return {k: v for k, v in result.items() if not k.startswith("_")}


# --- plot -----------------------------------------------------------------------------------
def plot(result: Mapping[str, Any], path: str) -> None:
    """Allocated vs requested aggregators over time (top) and the CDF of their ratio (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    t, alloc, req = result["_samples"]
    days = np.asarray(t, dtype=float) / 86400.0
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7))
    top.plot(days, np.asarray(req), lw=0.6, label="requested (standalone PS)")
    top.plot(days, np.asarray(alloc), lw=0.6, label="allocated (AutoPS)")
    top.set_xlabel("time (days)")
    top.set_ylabel("aggregators")
    top.set_title(f"CPU time saved: {result['cpu_saving'] * 100:.1f}% "
                  f"({result['jobs']} jobs, {result['samples']} samples)")
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left")
    ratios = np.asarray(result["_ratios"], dtype=float)
    if len(ratios):
        y = np.arange(1, len(ratios) + 1) / len(ratios)
        bottom.step(ratios, y, where="post")
    bottom.axvline(1.0, color="grey", ls="--", lw=0.8)
    bottom.set_xlabel("allocated / requested")
    bottom.set_ylabel("fraction of time")
    bottom.set_ylim(0, 1)
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------
def _parse_iter_seconds(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad --iter-seconds item {item!r}: use MODEL=SECONDS") from None
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="job trace CSV (philly, tiresias or generic format)")
    parser.add_argument("--shapes", default=None,
                        help="tensor shapes JSON (default: $AUTOPS_TENSOR_SHAPES, else "
                             "../shared/data/models/tensor_shapes.json next to the repository)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="models drawn for jobs whose trace row names none (comma list)")
    parser.add_argument("--iter-seconds", type=_parse_iter_seconds, default={},
                        help="override standalone iteration durations, e.g. vgg19=1.2,alexnet=0.3 "
                             f"(defaults: {', '.join(f'{m}={d:g}' for m, d in ITER_SECONDS.items())})")
    parser.add_argument("--agg-rate", type=float, default=AGG_RATE,
                        help="aggregation bytes per CPU-second (an assumption)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices (models drawn, noise)")
    parser.add_argument("--cluster-size", type=int, default=16, help="aggregators per cluster (soft bound)")
    parser.add_argument("--loss-limit", type=float, default=LOSS_LIMIT,
                        help="LossLimit: largest speed loss packing may cause")
    parser.add_argument("--period", type=float, default=300.0, help="hybrid scaling period, seconds")
    parser.add_argument("--threshold", type=int, default=1,
                        help="allocate between periods only for requests of this many aggregators or more")
    parser.add_argument("--profile-seconds", type=float, default=60.0,
                        help="time a new job runs on its temporary dedicated aggregators")
    parser.add_argument("--interval", type=float, default=60.0, help="sampling interval, seconds")
    parser.add_argument("--release", choices=("exit", "period"), default="exit",
                        help="give empty aggregators back at job exit or at the next period")
    parser.add_argument("--oversize", choices=("spill", "grow"), default="spill",
                        help="a cluster whose packing would exceed --cluster-size: pass it over for the "
                             "next best fit (spill) or let it grow")
    parser.add_argument("--limit", type=cli.positive(int), default=None, help="first N jobs only")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the figure here")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")


JSON_HELP = ("write the full result (with the series) as JSON to FILE ('-' for stdout, instead of "
             "the summary printed there)")


def run(args: argparse.Namespace) -> int:
    """``autops simulate`` with parsed ``args``; a bad trace, model or parameter raises
    ``ValueError`` (the CLI's exit status 2), a trace without a valid job ``NoValidJob``
    (exit status 1). Skipped bad rows are counted on stderr, the first few named."""
    report = load_trace(args.trace, limit=args.limit)
    if report.ignored_columns:
        print(f"autops simulate: {ignored_message(report, args.trace)}", file=sys.stderr)
    if report.skipped:
        print(f"autops simulate: {skipped_message(report, args.trace)}", file=sys.stderr)
    iter_seconds = dict(ITER_SECONDS)
    iter_seconds.update(args.iter_seconds)
    config = SimConfig(models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
                       iter_seconds=iter_seconds, agg_rate=args.agg_rate, seed=args.seed,
                       cluster_size=args.cluster_size, loss_limit=args.loss_limit, period=args.period,
                       threshold=args.threshold, profile_seconds=args.profile_seconds,
                       interval=args.interval, release=args.release, oversize=args.oversize, shapes=args.shapes)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    sim = Simulation(config, progress=progress)
    for m in config.models:
        model_tensors(m, config.shapes)          # ValueError naming the file and the known models
    result = sim.run(report.jobs)
    out = public(result)
    out["trace"] = os.fspath(args.trace)
    out["trace_format"] = report.format
    out["trace_rows_skipped"] = report.skipped
    if args.json:
        cli.write_json(args.json, out, indent=1)
    if args.plot:
        pathlib.Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    if args.json != "-":
        summary = {k: v for k, v in out.items() if k not in ("series",)}
        print(json.dumps(summary, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("autops simulate", __doc__.split("\n\n")[0])
    add_arguments(parser)
    cli.add_log_level(parser, "WARNING")
    cli.add_json(parser, JSON_HELP)
    args = parser.parse_args(argv)
    cli.setup_logging(args.log_level)
    return cli.run_main("autops simulate", run, args)


if __name__ == "__main__":
    sys.exit(main())
