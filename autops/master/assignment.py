"""Assignment of aggregation keys to aggregators (pure functions over plain data).

``spread_by_bytes`` is the standalone baseline: a job's keys spread over its own
aggregators balanced by bytes (or by any weight, e.g. measured CPU time), largest key
first onto the least-loaded aggregator. ``rebalance`` moves an existing table onto another
set of aggregators (a job's aggregator count changed) with few moves. The rest is the thesis' packing (§4.3.3.2-3):
``pack_task`` (Pseudocode 3), ``pack_job`` (all tasks of a job, opening aggregators as
needed) and ``recycle`` (free the least-loaded aggregators without new allocations).
The same functions run inside pMaster and inside the trace-driven simulation.
"""
from __future__ import annotations

import heapq
from typing import Callable, Iterable, Mapping, Sequence

from ..wire.cycles import EPS as _EPS, cycle_of, effective_iteration, runs_per_cycle


def spread_by_bytes(
    keys: Sequence[tuple[str, int]],
    aggregators: Sequence[str],
    load: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Map each ``(key, nbytes)`` to one of ``aggregators``.

    Greedy LPT: keys in decreasing size (ties by key name) each go to the aggregator
    with the least bytes so far (ties by the order of ``aggregators``). ``load`` gives
    bytes already on each aggregator (keys declared earlier).
    """
    if not aggregators:
        raise ValueError("no aggregators to spread keys over")
    load = load or {}
    heap = [(load.get(agg, 0), i, agg) for i, agg in enumerate(aggregators)]
    heapq.heapify(heap)
    table: dict[str, str] = {}
    for key, nbytes in sorted(keys, key=lambda kv: (-kv[1], kv[0])):
        used, i, agg = heapq.heappop(heap)
        table[key] = agg
        heapq.heappush(heap, (used + nbytes, i, agg))
    return table


def rebalance(table: Mapping[str, str], sizes: Mapping[str, int], targets: Sequence[str]) -> dict[str, str]:
    """``table`` (key -> aggregator) moved onto ``targets`` with few moves: keys on an
    aggregator outside ``targets`` go, largest first, to the least-loaded target; then, while
    some key of the most-loaded target is smaller than its gap to the least-loaded one, the
    largest such key moves there (each move lowers the sum of squared loads, so it ends)."""
    if not targets:
        raise ValueError("no aggregators to rebalance keys over")
    order = {agg: i for i, agg in enumerate(targets)}
    load = {agg: 0 for agg in targets}
    out: dict[str, str] = {}
    movers = []
    for key, agg in table.items():
        if agg in load:
            out[key] = agg
            load[agg] += int(sizes[key])
        else:
            movers.append(key)
    for key in sorted(movers, key=lambda k: (-int(sizes[k]), k)):
        agg = min(targets, key=lambda a: (load[a], order[a]))
        out[key] = agg
        load[agg] += int(sizes[key])
    while True:
        heavy = max(targets, key=lambda a: (load[a], -order[a]))
        light = min(targets, key=lambda a: (load[a], order[a]))
        gap = load[heavy] - load[light]
        fits = [k for k, a in out.items() if a == heavy and 0 < int(sizes[k]) < gap]
        if not fits:
            return out
        key = max(fits, key=lambda k: (int(sizes[k]), k))
        out[key] = light
        load[heavy] -= int(sizes[key])
        load[light] += int(sizes[key])


def bytes_per_aggregator(table: Mapping[str, str], sizes: Mapping[str, int]) -> dict[str, int]:
    """Total bytes each aggregator carries under ``table``."""
    out: dict[str, int] = {}
    for key, agg in table.items():
        out[agg] = out.get(agg, 0) + int(sizes[key])
    return out


# --- Pseudocode 3: packing jobs' aggregation tasks onto few aggregators (thesis §4.3.3.2) ---
#
# An aggregator runs in cycles: its cycle is the largest standalone iteration duration D of
# the jobs it serves, and a job with a shorter D runs floor(C / D) times per cycle, so its
# effective iteration duration becomes d = C / floor(C / D). A task may join an aggregator
# only if no job there (nor the task's own job) would lose LossLimit or more of its speed,
# (d - D) / d < LossLimit, and only where the cycle's free CPU time still holds it; among those
# the best fit (least free time) wins, else a new aggregator is needed.

LOSS_LIMIT = 0.1


def loss(duration: float, cycle: float) -> float:
    """Fraction of its standalone speed a job loses on that cycle: ``(d - D) / d``."""
    d = effective_iteration(duration, cycle)
    return (d - duration) / d


def free_time(cycle: float, jobs: Mapping[str, tuple[float, float]]) -> float:
    """``F_n``: CPU time left in one cycle; ``jobs`` maps job -> (D_j, sum of its tasks' e)."""
    return cycle - sum(runs_per_cycle(d, cycle) * e for d, e in jobs.values())


def joined_cycle(jobs: Mapping[str, tuple[float, float]], job: str, duration: float,
                 loss_limit: float = LOSS_LIMIT) -> tuple[float, float] | None:
    """Pseudocode 3's loss test of one aggregator for tasks of ``job``: None when with ``job``
    there (standalone iteration ``duration`` unless it is there already) some job would lose
    ``loss_limit`` or more of its speed, else ``(cycle, free time)`` of the aggregator with it.

    Adding tasks of ``job`` changes neither answer's loss test nor raises its free time.
    """
    members = dict(jobs)
    members.setdefault(job, (duration, 0.0))
    cycle = max(d for d, _ in members.values())
    if any(loss(d, cycle) >= loss_limit - _EPS for d, _ in members.values()):
        return None
    return cycle, free_time(cycle, members)


def holds(free: float, duration: float, cycle: float, cost: float) -> bool:
    """Pseudocode 3's room test: ``free`` time in the cycle holds a task of ``cost`` that runs
    ``runs_per_cycle(duration, cycle)`` times in it."""
    return free + _EPS >= runs_per_cycle(duration, cycle) * cost


def pack_task(job: str, duration: float, cost: float,
              aggregators: Mapping[str, Mapping[str, tuple[float, float]]],
              loss_limit: float = LOSS_LIMIT) -> str | None:
    """Where a task of ``job`` (standalone iteration ``duration``, CPU time ``cost`` per
    iteration) goes: the name of the best-fit aggregator, or None for a new one.

    ``aggregators`` maps name -> {job: (D_j, sum of e of that job's tasks there)}. An
    aggregator qualifies when it passes ``joined_cycle`` and ``holds``; the least free wins.
    """
    best: tuple[float, str] | None = None
    for name, jobs in aggregators.items():
        joined = joined_cycle(jobs, job, duration, loss_limit)
        if joined is None:
            continue
        cycle, free = joined
        if holds(free, duration, cycle, cost) and (best is None or (free, name) < best):
            best = (free, name)
    return best[1] if best else None


Loads = Mapping[str, Mapping[str, tuple[float, float]]]


def busy_fraction(jobs: Mapping[str, tuple[float, float]]) -> float:
    """Share of an aggregator's cycle its tasks keep the CPU busy (0 when empty)."""
    cycle = cycle_of(jobs)
    return 0.0 if cycle <= 0 else (cycle - free_time(cycle, jobs)) / cycle


def job_demand(duration: float, costs: Iterable[float]) -> float:
    """CPU a job's aggregation needs, in aggregators (CPU seconds per second of training)."""
    return sum(costs) / duration if duration > 0 else 0.0


def pack_job(job: str, duration: float, tasks: Sequence[tuple[str, float]],
             aggregators: Loads, new_name: Callable[[int], str],
             loss_limit: float = LOSS_LIMIT, allow_new: bool = True
             ) -> tuple[dict[str, str], list[str]] | None:
    """Assign every ``(task, cost)`` of ``job`` with Pseudocode 3, largest cost first.

    When no aggregator fits a task, a new one named ``new_name(i)`` (i = 0, 1, ...) is
    opened and joins the candidates. Returns ``(task -> aggregator, names opened)``, or
    None when ``allow_new`` is False and some task does not fit. ``aggregators`` is not
    modified.
    """
    loads = {name: dict(jobs) for name, jobs in aggregators.items()}
    table: dict[str, str] = {}
    opened: list[str] = []
    for task, cost in sorted(tasks, key=lambda tc: (-tc[1], tc[0])):
        name = pack_task(job, duration, cost, loads, loss_limit)
        if name is None:
            if not allow_new:
                return None
            name = new_name(len(opened))
            if name in loads:
                raise ValueError(f"new aggregator name {name!r} is already in use")
            opened.append(name)
            loads[name] = {}
        d_old, e_old = loads[name].get(job, (duration, 0.0))
        loads[name][job] = (d_old, e_old + cost)
        table[task] = name
    return table, opened


def recycle(aggregators: Loads, tasks: Mapping[str, Sequence[tuple[str, str, float]]],
            durations: Mapping[str, float], loss_limit: float = LOSS_LIMIT,
            exclude: Iterable[str] = ()) -> list[tuple[str, dict[str, str]]]:
    """Aggregators that can be freed after a job exit (thesis §4.3.3.3, "Job Exit").

    From the least-loaded aggregator up, try to re-assign all its tasks
    (``tasks[name]`` = ``[(job, task, cost)]``; task ids unique across jobs) to the others with
    Pseudocode 3 and no new allocation; on success it is recycled and the next one is tried,
    on the first failure the procedure stops. Returns ``[(freed aggregator, {task: new
    aggregator})]`` in order; tasks an earlier step moved onto a later victim move again with
    it, so a task's last entry is where it ends (``final_moves``). Aggregators in ``exclude``
    are neither freed nor used as destinations.
    """
    blocked = set(exclude)
    loads = {name: dict(jobs) for name, jobs in aggregators.items() if name not in blocked}
    current = {name: list(tasks.get(name, ())) for name in loads}
    plan: list[tuple[str, dict[str, str]]] = []
    order = sorted(loads, key=lambda n: (busy_fraction(loads[n]), n))
    for victim in order:
        if victim not in loads or not loads[victim]:
            continue
        others = {n: dict(j) for n, j in loads.items() if n != victim}
        if not others:
            break
        moves: dict[str, str] = {}
        arrived: dict[str, list] = {}
        for job, task, cost in sorted(current[victim], key=lambda t: (-t[2], t[1])):
            dest = pack_task(job, durations[job], cost, others, loss_limit)
            if dest is None:
                moves = {}
                break
            d_old, e_old = others[dest].get(job, (durations[job], 0.0))
            others[dest][job] = (d_old, e_old + cost)
            moves[task] = dest
            arrived.setdefault(dest, []).append((job, task, cost))
        if not moves:
            break
        plan.append((victim, moves))
        loads = others
        current[victim] = []
        for dest, items in arrived.items():
            current[dest].extend(items)
    return plan


def final_moves(plan: Sequence[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """Where each task of a ``recycle`` plan ends up: pMaster applies a plan whole, moving
    each task once, straight to its last destination."""
    out: dict[str, str] = {}
    for _, moves in plan:
        out.update(moves)
    return out
