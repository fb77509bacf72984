"""Cluster-scale simulation of Infiniswap's placement and eviction policies.

This module owns the what-if studies behind ``infiniswap simulate``: it drives the
*same* pure policy functions the device and daemon use (``placement``, ``eviction``)
over a synthetic cluster, with no sockets, threads or processes. Everything is
deterministic for a given ``seed``.

(a) Placement (thesis §2.4.2, §2.7.5). ``machines`` machines of ``capacity`` GiB
    (default 64, as in §2.7), SlabSize 1 GiB, HeadRoom 8 GiB. Each machine's *local*
    memory use, as a fraction of capacity, is log-normal: median 0.35 and
    ``sigma = ln(3.35) / z_0.99 = 0.52``, so the 99th-percentile-to-median ratio is 3.35 --
    the Google cluster's imbalance in §2.2.3 (Facebook: 2.4) -- and the mean is about
    0.40, the 40.8% average utilization of the §2.7.5 cluster before Infiniswap; clipped
    to [0.01, 1]. A fraction ``paging_fraction`` (default 0.5: in §2.7.5 about half of the
    containers ran with 75% or 50% of their working set in memory) of the machines run a
    device that needs remote memory; its demand in slabs is exponential with mean
    ``demand_mean`` (default 24 slabs, so remote memory is about 19% of the cluster,
    the 40.8% -> 60% utilization increase of §2.7.5), at least 1. Devices place their
    slabs concurrently: in each round every device with demand left places one slab,
    devices in random order, never on its own machine. A daemon can give a slab while
    ``capacity - local - hosted - HeadRoom >= SlabSize`` (what FREE_MEM reports). When
    all daemons a strategy queried are full, the device tries again with fresh random
    choices (``retries``, default 2); a slab that still finds none stays on disk
    (``unplaced``). Strategies:

    * ``random``: uniform random daemon, trying a second if the first is full (the same
      query budget as power of two; ``placement.random_choice_with(attempts=2)``);
    * ``power_of_two``: two random daemons of all machines, the freer
      (``placement.power_of_two_with``);
    * ``power_of_two_split``: Infiniswap's: two from M_new, then M_old
      (``placement.place_with``).

    Reported per strategy: utilization imbalance across all machines (max/median and
    max/min as in §2.7.5, p99/median as in Fig. 2.2, p90/p10, coefficient of variation)
    next to the cluster before remote paging, and slab spread per device (distinct
    machines, the most slabs of one device on one machine, share of devices with every
    slab on its own machine). Note: the maximum (and so max/median and p99/median) is set
    by the few machines whose *local* use alone fills them (the log-normal's tail is
    clipped at capacity); hosting stops at capacity - HeadRoom, so no placement strategy
    moves it -- the strategies differ at the bottom (max/min, p90/p10, cv).

(b) Eviction (thesis §2.5.2, Fig. 2.7). A population of ``population`` mapped slabs, a
    fraction ``p_b`` of them busy (activity above HotSlab = 20 pages/s: ``20 * (1 + Exp(1))``;
    light ones uniform in [0, 20)). Per trial, random eviction takes ``E`` slabs
    (``eviction.random_evict``); batch eviction samples ``E + E'`` (``eviction.sample``) and
    evicts the ``E`` least active (``eviction.choose``). Success = all ``E`` evicted slabs
    light. The Monte-Carlo rate is reported next to ``p_lightly_random`` /
    ``p_lightly_batch`` with its standard error; the formulas assume each slab busy
    independently with probability ``p_b``, which sampling a few slabs from a large
    population with exactly ``p_b`` busy reproduces (hypergeometric ~ binomial, the
    finite-population error is below 1e-3 for the defaults).

Entry points: ``run(machines=1000, seed=0, ...) -> dict`` (JSON-serialisable) and
``format_report(result) -> str``; ``python -m infiniswap.simulate --machines 1000``.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np

from dlrt import cli

from . import eviction, placement

__all__ = [
    "Cluster", "make_cluster", "STRATEGIES", "place_slabs", "imbalance", "placement_study",
    "eviction_study", "run", "format_report", "main",
]

GIB = 1 << 30
HOT_SLAB = 20.0                                   # pages/s, §2.4.1
STRATEGIES = ("random", "power_of_two", "power_of_two_split")
P_BS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
E_PRIMES = (0, 1, 5, 10)


@dataclass
class Cluster:
    """A synthetic cluster in GiB (= slabs, SlabSize 1 GiB): per machine capacity, local use, demand."""
    capacity: np.ndarray          # GiB per machine
    local: np.ndarray             # GiB used by local applications
    demand: np.ndarray            # slabs the machine's device wants in remote memory (0: none)
    headroom: float = 8.0         # GiB a daemon keeps free
    params: dict = field(default_factory=dict)

    @property
    def machines(self) -> int:
        return len(self.capacity)


def make_cluster(machines: int = 1000, seed: int = 0, *, capacity: float = 64.0, headroom: float = 8.0,
                 usage_median: float = 0.35, usage_p99_over_median: float = 3.35,
                 paging_fraction: float = 0.5, demand_mean: float = 24.0) -> Cluster:
    """Draw a cluster as documented in the module docstring."""
    if machines < 2:
        raise ValueError(f"need at least 2 machines, got {machines}")
    if not 0.0 <= paging_fraction <= 1.0:
        raise ValueError(f"paging_fraction must be in [0, 1], got {paging_fraction}")
    gen = np.random.default_rng(seed)
    sigma = math.log(usage_p99_over_median) / NormalDist().inv_cdf(0.99)
    frac = np.clip(usage_median * np.exp(sigma * gen.standard_normal(machines)), 0.01, 1.0)
    cap = np.full(machines, float(capacity))
    pages = gen.random(machines) < paging_fraction
    demand = np.where(pages, np.maximum(1, np.rint(gen.exponential(demand_mean, machines))), 0).astype(int)
    params = dict(capacity_gib=capacity, headroom_gib=headroom, slab_gib=1, usage_median=usage_median,
                  usage_sigma=round(sigma, 4), paging_fraction=paging_fraction, demand_mean_slabs=demand_mean)
    return Cluster(cap, frac * cap, demand, float(headroom), params)


def place_slabs(cluster: Cluster, strategy: str, rng: random.Random, k: int = 2,
                retries: int = 2) -> dict[str, Any]:
    """Place every device's demand with ``strategy``; returns hosted slabs and per-device placements.

    A slab whose queried daemons are all full is tried again with fresh random choices up to
    ``retries`` times (the device keeps a hot slab's mapping pending), then left on disk.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
    n = cluster.machines
    spare = [float(x) for x in cluster.capacity - cluster.local - cluster.headroom]   # GiB before hosting
    hosted = [0] * n

    def query(addrs: Sequence[int]) -> dict[int, int]:          # what FREE_MEM would say
        return {a: max(0, int((spare[a] - hosted[a]) * GIB)) for a in addrs}

    devices = [i for i in range(n) if cluster.demand[i] > 0]
    left = {i: int(cluster.demand[i]) for i in devices}
    where: dict[int, dict[int, int]] = {i: {} for i in devices}    # device -> machine -> slabs
    others = {i: [m for m in range(n) if m != i] for i in devices}  # M_new (split) or whole pool
    m_old: dict[int, list[int]] = {i: [] for i in devices}
    unplaced = 0
    active = list(devices)
    while active:
        rng.shuffle(active)
        for dev in active:
            left[dev] -= 1
            addr = None
            for _ in range(1 + retries):
                if strategy == "random":
                    addr = placement.random_choice_with(others[dev], query, GIB, rng, attempts=k)
                elif strategy == "power_of_two":
                    addr = placement.power_of_two_with(others[dev], query, GIB, rng, k)
                else:
                    addr = placement.place_with(others[dev], m_old[dev], query, GIB, rng, k)
                if addr is not None:
                    break
            if addr is None:
                unplaced += 1
                continue
            hosted[addr] += 1
            if addr not in where[dev]:
                where[dev][addr] = 0
                if strategy == "power_of_two_split":
                    others[dev].remove(addr)
                    m_old[dev].append(addr)
            where[dev][addr] += 1
        active = [d for d in active if left[d] > 0]
    return {"hosted": np.array(hosted), "where": where, "unplaced": unplaced}


def imbalance(util: np.ndarray) -> dict[str, float]:
    """Imbalance of per-machine utilization fractions."""
    util = np.asarray(util, dtype=float)
    med = float(np.median(util))
    return {
        "mean": round(float(util.mean()), 4),
        "median": round(med, 4),
        "min": round(float(util.min()), 4),
        "max": round(float(util.max()), 4),
        "max_over_median": round(float(util.max()) / med, 3),
        "max_over_min": round(float(util.max() / util.min()), 3),
        "p99_over_median": round(float(np.percentile(util, 99)) / med, 3),
        "p90_over_p10": round(float(np.percentile(util, 90) / np.percentile(util, 10)), 3),
        "cv": round(float(util.std() / util.mean()), 4),
    }


def _spread(where: dict[int, dict[int, int]]) -> dict[str, float]:
    placed = [m for m in where.values() if m]
    if not placed:
        return {"devices": 0, "mean_slabs_per_device": 0.0, "mean_machines_per_device": 0.0,
                "mean_max_slabs_on_one_machine": 0.0, "devices_fully_spread": 0.0}
    slabs = np.array([sum(m.values()) for m in placed])
    distinct = np.array([len(m) for m in placed])
    worst = np.array([max(m.values()) for m in placed])
    return {
        "devices": len(placed),
        "mean_slabs_per_device": round(float(slabs.mean()), 3),
        "mean_machines_per_device": round(float(distinct.mean()), 3),
        "mean_max_slabs_on_one_machine": round(float(worst.mean()), 3),
        "devices_fully_spread": round(float((distinct == slabs).mean()), 4),
    }


def placement_study(machines: int = 1000, seed: int = 0, *, strategies: Sequence[str] = STRATEGIES,
                    k: int = 2, retries: int = 2, **cluster_kw: Any) -> dict[str, Any]:
    """Part (a): one cluster, every strategy on it with its own seeded ``random.Random``."""
    cluster = make_cluster(machines, seed, **cluster_kw)
    before = np.minimum(cluster.local / cluster.capacity, 1.0)
    out: dict[str, Any] = {
        "cluster": {**cluster.params, "machines": machines, "devices": int((cluster.demand > 0).sum()),
                    "demand_slabs": int(cluster.demand.sum()),
                    "hostable_slabs": int(np.floor(np.maximum(
                        0.0, cluster.capacity - cluster.local - cluster.headroom)).sum())},
        "before": imbalance(before),
        "strategies": {},
    }
    for name in strategies:
        res = place_slabs(cluster, name, random.Random(f"{seed}/{name}"), k, retries)
        util = np.minimum((cluster.local + res["hosted"]) / cluster.capacity, 1.0)
        out["strategies"][name] = {
            **imbalance(util),
            "unplaced": res["unplaced"],
            "max_slabs_hosted": int(res["hosted"].max()),
            **_spread(res["where"]),
        }
    return out


def _mc_row(successes: int, trials: int, formula: float, z: float) -> dict[str, Any]:
    rate = successes / trials
    se = math.sqrt(max(formula * (1.0 - formula), 0.0) / trials)
    return {"formula": round(formula, 6), "monte_carlo": round(rate, 6), "stderr": round(se, 6),
            "agrees": abs(rate - formula) <= z * se + 1.0 / trials}


def eviction_study(p_bs: Sequence[float] = P_BS, E: int = 10, E_primes: Sequence[int] = E_PRIMES,
                   trials: int = 4000, seed: int = 0, population: int = 100_000,
                   z: float = 4.0) -> dict[str, Any]:
    """Part (b): Monte Carlo of random vs batch eviction next to the analytical formulas.

    ``agrees`` is ``|mc - formula| <= z * stderr + 1/trials`` with ``stderr`` the binomial
    standard error of ``trials`` draws at the formula's probability.
    """
    if trials < 1 or population < E + max(E_primes, default=0):
        raise ValueError("need trials >= 1 and population >= E + max(E')")
    rng = random.Random(f"{seed}/eviction")
    slabs = range(population)
    rows = []
    for p_b in p_bs:
        n_busy = round(p_b * population)            # slabs with key < n_busy are busy

        def activity(s: int) -> float:
            return HOT_SLAB * (1.0 + rng.expovariate(1.0)) if s < n_busy else rng.uniform(0.0, HOT_SLAB)

        ok = sum(all(s >= n_busy for s in eviction.random_evict(slabs, E, rng)) for _ in range(trials))
        row: dict[str, Any] = {"p_b": p_b, "random": _mc_row(ok, trials, eviction.p_lightly_random(p_b, E), z)}
        for e2 in E_primes:
            ok = 0
            for _ in range(trials):
                picked = eviction.sample(slabs, E, e2, rng)
                evicted = eviction.choose({s: activity(s) for s in picked}, E)
                ok += all(s >= n_busy for s in evicted)
            row[f"batch_{e2}"] = _mc_row(ok, trials, eviction.p_lightly_batch(p_b, E, e2), z)
        rows.append(row)
    agree = all(cell["agrees"] for row in rows for key, cell in row.items() if key != "p_b")
    return {"E": E, "E_primes": list(E_primes), "trials": trials, "population": population,
            "z": z, "rows": rows, "all_agree": agree}


def run(machines: int = 1000, seed: int = 0, *, trials: int = 4000, E: int = 10,
        E_primes: Sequence[int] = E_PRIMES, p_bs: Sequence[float] = P_BS, **cluster_kw: Any) -> dict[str, Any]:
    """Both studies; a plain JSON-serialisable dict."""
    return {
        "machines": machines,
        "seed": seed,
        "placement": placement_study(machines, seed, **cluster_kw),
        "eviction": eviction_study(p_bs, E, E_primes, trials, seed),
    }


def _column(key: str) -> str:
    return "random" if key == "random" else "E'=" + key[len("batch_"):]


def format_report(result: dict[str, Any]) -> str:
    """The result of ``run`` as text tables."""
    pl = result["placement"]
    c = pl["cluster"]
    lines = [
        f"Placement: {c['machines']} machines x {c['capacity_gib']:g} GiB, HeadRoom {c['headroom_gib']:g} GiB, "
        f"SlabSize 1 GiB; {c['devices']} devices want {c['demand_slabs']} slabs "
        f"({c['hostable_slabs']} hostable before placement)",
        f"{'strategy':<20}{'max/med':>8}{'max/min':>9}{'p90/p10':>9}{'cv':>8}{'mean':>7}{'unplaced':>10}"
        f"{'machines/dev':>14}{'max on 1':>10}{'spread':>8}",
    ]
    b = pl["before"]
    lines.append(f"{'no remote memory':<20}{b['max_over_median']:>8.2f}{b['max_over_min']:>9.2f}"
                 f"{b['p90_over_p10']:>9.2f}{b['cv']:>8.3f}{b['mean']:>7.3f}{'-':>10}{'-':>14}{'-':>10}{'-':>8}")
    for name, s in pl["strategies"].items():
        lines.append(f"{name:<20}{s['max_over_median']:>8.2f}{s['max_over_min']:>9.2f}{s['p90_over_p10']:>9.2f}"
                     f"{s['cv']:>8.3f}{s['mean']:>7.3f}{s['unplaced']:>10d}{s['mean_machines_per_device']:>14.2f}"
                     f"{s['mean_max_slabs_on_one_machine']:>10.2f}{s['devices_fully_spread']:>8.3f}")
    lines.append(f"  machines/dev: distinct machines per device (demand {c['demand_slabs'] / max(c['devices'], 1):.2f} "
                 "slabs per device); max on 1: most slabs of one device on one machine (mean over devices); "
                 "spread: share of devices with every slab on its own machine")
    ev = result["eviction"]
    keys = ["random"] + [f"batch_{e}" for e in ev["E_primes"]]
    lines += ["", f"Eviction: P(all E={ev['E']} evicted slabs lightly active), formula / Monte Carlo "
                  f"({ev['trials']} trials per cell; '*' = outside {ev['z']:g} stderr)",
              f"{'p_b':>5}" + "".join(f"{_column(k):>18}" for k in keys)]
    for row in ev["rows"]:
        cells = "".join(f"{row[k]['formula']:>9.4f}/{row[k]['monte_carlo']:<7.4f}{' ' if row[k]['agrees'] else '*':>1}"
                        for k in keys)
        lines.append(f"{row['p_b']:>5.2f}{cells}")
    lines.append(f"all Monte-Carlo estimates agree with the formulas: {ev['all_agree']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = cli.parser("infiniswap simulate", __doc__.splitlines()[0])
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=4000, help="Monte-Carlo trials per eviction cell")
    cli.add_log_level(ap)
    cli.add_json(ap, "write the result as JSON to FILE ('-' for stdout instead of the tables)")
    args = ap.parse_args(argv)
    cli.setup_logging(args.log_level)
    try:
        result = run(args.machines, args.seed, trials=args.trials)
    except ValueError as exc:          # --machines 0, --trials 0: one line, exit status 2
        ap.error(str(exc))
    cli.emit(args.json, result, format_report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
