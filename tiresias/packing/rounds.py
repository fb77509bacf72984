"""One scheduling round of Tesserae (Algorithm 1), as a pure function over plain data.

The scheduling policy has ordered the active jobs (highest priority first). The round:

1. places jobs without packing, in that order, while GPUs last, each with the node placement
   rule of the driver (``tiresias.placement.place``: best fit on one node, consolidated on the
   fewest nodes when the job needs it); a job that finds no GPUs is *pending*, and the walk
   goes on (a smaller job after it may still fit);
2. packs pending jobs onto placed jobs' GPUs (``matching.pack``, or Gavel's greedy rule), at
   most two jobs per GPU;
3. renames the new plan's nodes and GPUs to stay closest to the previous round's plan
   (``migration.plan_migration``), so that only the jobs that must move do. Gavel does not
   rename, and counts a job as migrated whenever its GPUs differ.

In step 1 a job that ran last round keeps its GPUs when they are all still free as the plan is
built (in priority order), and is placed anew otherwise: Gavel's rule, used by default for
Tesserae too, before its renaming. The paper plans each round from an empty cluster, where a
job ran before matters only through the renaming (``keep_in_place=False``); on the Shockwave
workload at 80 jobs/hour that moves about 1.5x as many jobs for a slightly worse JCT
(docs/tesserae.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from .. import placement as plc
from . import matching, migration

PACKINGS = ("tesserae", "gavel")
# command-line names: a priority policy with GPU sharing -> (packing, the priority policy)
SHARING_POLICIES = {f"tesserae-{p}": ("tesserae", p) for p in ("las", "gittins", "fifo")}
SHARING_POLICIES["gavel-las"] = ("gavel", "las")
SHARING_POLICIES["tesserae-optimus"] = ("tesserae", "optimus")    # allocation, then sharing
ROUND_SECONDS = 360.0        # Tesserae's rounds: six minutes


@dataclass(frozen=True)
class RoundJob:
    """An active job as a round sees it."""
    job_id: int
    gpus: int
    kind: Hashable = None          # the profile store's key
    may_share: bool = True
    consolidate: bool = False      # must be placed on the fewest nodes


@dataclass
class RoundPlan:
    """The outcome of a round: who runs where, who shares, who moved."""
    plan: list[list[frozenset[int]]]                 # plan[node][gpu]: jobs on that GPU (physical)
    placed: list[int] = field(default_factory=list)  # jobs given GPUs of their own, in order
    pairs: list[matching.Pair] = field(default_factory=list)   # pending jobs packed onto placed ones
    waiting: list[int] = field(default_factory=list)   # jobs left out this round
    migrated: list[int] = field(default_factory=list)  # jobs of both rounds whose GPUs changed
    naive: list[int] = field(default_factory=list)     # what Gavel's rule would have counted

    def gpus(self) -> dict[int, frozenset[tuple[int, int]]]:
        """job -> its (node, GPU) set."""
        return migration.gpu_sets(self.plan)

    def speeds(self) -> dict[int, float]:
        """The normalised speed of every packed job (jobs alone run at 1)."""
        out: dict[int, float] = {}
        for p in self.pairs:
            out[p.placed] = p.placed_speed
            out[p.pending] = p.pending_speed
        return out


def plan_round(ordered: Sequence[RoundJob], nodes: int, per_node: int, speeds: matching.Speeds | None,
               previous: migration.Plan | None = None, packing: str | None = "tesserae",
               keep_in_place: bool = True, timings: dict[str, float] | None = None) -> RoundPlan:
    """Algorithm 1 over ``ordered`` (see the module docstring). ``speeds(kind_a, kind_b)``
    gives a pair's normalised speeds (None: packing off); ``previous`` is the last round's
    physical plan (None: the first round, nothing to stay close to); ``packing`` is
    ``"tesserae"`` (matching, GPU-level renaming), ``"gavel"`` (greedy, no renaming) or None;
    ``keep_in_place``: a placed job keeps the GPUs it had when they are still free (Gavel's
    rule, and here Tesserae's too before its renaming); False plans Tesserae's rounds from an
    empty cluster, as published. ``timings`` (a dict) gets each phase's seconds."""
    clock = time.perf_counter
    t0 = clock()
    if packing is not None and packing not in PACKINGS:
        raise ValueError(f"packing must be one of {', '.join(PACKINGS)} or None, got {packing!r}")
    free = [per_node] * nodes
    slots: list[list[set[int]]] = [[set() for _ in range(per_node)] for _ in range(nodes)]
    before = migration.gpu_sets(previous) if previous is not None and (keep_in_place or packing == "gavel") else {}
    placed: list[RoundJob] = []
    pending: list[RoundJob] = []
    where: dict[int, list[tuple[int, int]]] = {}
    # GPUs that jobs of this round held last round: a job placed anew avoids them when it can,
    # so that a running job after it in priority order still finds its own free
    held = {cell for job in ordered for cell in before.get(job.job_id, ())}
    for job in ordered:
        gpus = _sticky(before.get(job.job_id), slots, job.gpus)
        if gpus is None:
            gpus = _place(job, free, slots, held, per_node)
            if gpus is None:
                pending.append(job)
                continue
        for node, k in gpus:
            slots[node][k].add(job.job_id)
            free[node] -= 1
            held.discard((node, k))
        where[job.job_id] = gpus
        placed.append(job)
    t1 = clock()
    pairs: list[matching.Pair] = []
    if packing is not None and speeds is not None and pending and placed:
        cand = {j.job_id: matching.Candidate(j.job_id, j.gpus, j.kind, j.may_share) for j in placed + pending}
        rule = matching.pack if packing == "tesserae" else matching.pack_greedy
        pairs = rule([cand[j.job_id] for j in placed], [cand[j.job_id] for j in pending], speeds)
        for p in pairs:
            for node, k in where[p.placed]:
                slots[node][k].add(p.pending)
    packed = {p.pending for p in pairs}
    t2 = clock()
    if timings is not None:
        timings.update(placement=t1 - t0, packing=t2 - t1, migration=0.0)
    new = [[frozenset(s) for s in node] for node in slots]
    result = RoundPlan(new, [j.job_id for j in placed], pairs,
                       [j.job_id for j in pending if j.job_id not in packed])
    if previous is None:
        return result
    gpus_of = {j.job_id: j.gpus for j in ordered}
    if packing == "gavel":
        after = migration.gpu_sets(new)
        result.naive = result.migrated = sorted(j for j in after if j in before and before[j] != after[j])
        return result
    moved = migration.plan_migration(previous, new, gpus_of)
    result.plan, result.migrated, result.naive = moved.plan, moved.migrated, moved.naive
    if timings is not None:
        timings["migration"] = clock() - t2
    return result


def _place(job: RoundJob, free: list[int], slots: list[list[set[int]]], held: set[tuple[int, int]],
           per_node: int) -> list[tuple[int, int]] | None:
    """GPUs for a job placed anew: by the placement rule on GPUs nobody held last round when it
    fits there, else on any free GPUs (those nobody held first)."""
    if held:
        spare = [sum(1 for k in range(per_node) if not slots[n][k] and (n, k) not in held) for n in range(len(free))]
        alloc = plc.place(spare, job.gpus, job.consolidate, per_node)
        if alloc is not None:
            return [(n, k) for n, g in alloc
                    for k in [k for k in range(per_node) if not slots[n][k] and (n, k) not in held][:g]]
    alloc = plc.place(free, job.gpus, job.consolidate, per_node)
    if alloc is None:
        return None
    order = lambda n: sorted((k for k in range(per_node) if not slots[n][k]), key=lambda k: ((n, k) in held, k))
    return [(n, k) for n, g in alloc for k in order(n)[:g]]


def _sticky(before: frozenset[tuple[int, int]] | None, slots: list[list[set[int]]], gpus: int
            ) -> list[tuple[int, int]] | None:
    """Gavel's rule: a job keeps the GPUs it had when they are all still free in this plan."""
    if before is None or len(before) != gpus or any(slots[node][k] for node, k in before):
        return None
    return sorted(before)
