"""How often a migration with no pause at all would meet the pause goals, for stored
``autops bench migrate`` rows -- those written before the benchmark reported it
(``noise_only_targets_share``) included -- under either baseline of the pause.

``autops bench migrate`` takes a move's pause against the job's communication time (the
slower worker's, per iteration: ``pause_baseline: "job"``); rows written before it took the
same maximum against the median of every worker's time (``worker``; such rows carry it as
``pause_ms_per_repeat``, newer rows as ``pause_vs_worker_ms_per_repeat``). Either figure a
row lacks is rebuilt from it.

A stored row keeps each worker's communication time per iteration (``comm_ms``) and each
move's iterations (``iteration_at_call``, ``iteration_at_done``, ``switch_iterations``), not
the clock times its migration windows were cut by. ``rebuild`` lays the records on a
synthetic clock -- iteration ``i`` on the communication phase of ``i`` -- with each move's
window from the iteration the call came in to the one it was done in, and takes the figures
as ``autops_migrate.pauses`` does. The windows are approximate (a call or a done near an
iteration's edge shifts them by one), so the rebuilt figures are too; what a row stored is
taken as it is.

``against_noise`` pools the moves of many runs against the same statistic over their
iterations without a migration, per site, mode and neighbour job: whether the moves pause
the job more than the machine's noise does, when no single run can tell.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Iterable

import numpy as np

from .autops_migrate import noise_only_share, pauses, targets_met

PERIOD = 10.0       # the synthetic clock's iteration, s: longer than any communication phase
BASELINES = ("job", "worker")
# where a row keeps each baseline's per-move pauses and no-migration values, by the baseline
# the row was written with
STORED = {"job": {"job": ("pause_ms_per_repeat", "quiet_pause_ms"),
                  "worker": ("pause_vs_worker_ms_per_repeat", "quiet_pause_vs_worker_ms")},
          "worker": {"worker": ("pause_ms_per_repeat", "quiet_pause_ms")}}


def rebuild(row: dict) -> dict | None:
    """``autops_migrate.pauses`` over the row's iterations on the synthetic clock; None where
    a move lacks its switch iterations."""
    moves = row.get("per_repeat") or []
    if not moves or any(m.get("switch_iterations") is None for m in moves):
        return None
    per_rank = {r: [(i + 1, PERIOD * (i + 1), PERIOD * (i + 1) + 1, PERIOD * (i + 1) + 1 + c / 1e3)
                    for i, c in enumerate(comm)] for r, comm in enumerate(row["comm_ms"])}
    windows = [(PERIOD * (m["iteration_at_call"] + 1) + 0.5, PERIOD * (m["iteration_at_done"] + 1) + 1.5)
               for m in moves]
    params = row.get("params") or {}
    return pauses(per_rank, [{"switch_iterations": m["switch_iterations"]} for m in moves], windows,
                  params.get("skip", 2), params.get("gap", 5))


def figures(row: dict, baseline: str = "job") -> tuple[list[float] | None, list[float] | None]:
    """The row's per-move pauses and its no-migration statistic (ms) against ``baseline``
    (``BASELINES``): as stored where the row has them, else rebuilt (``rebuild``); None for
    what neither gives."""
    written = row.get("pause_baseline", "worker")
    pause_key, quiet_key = STORED.get(written, {}).get(baseline, (None, None))
    pause = row.get(pause_key) if pause_key else None
    quiet = row.get(quiet_key) if quiet_key else None
    if pause is None or quiet is None:
        got = rebuild(row)
        if got is not None:
            own = "" if baseline == "job" else "_vs_worker"
            pause = pause if pause is not None else got[f"pause{own}_ms_per_repeat"]
            quiet = quiet if quiet is not None else got[f"quiet_pause{own}_ms"]
    return (list(pause) if pause is not None else None), (list(quiet) if quiet is not None else None)


def quiet_pauses(row: dict, baseline: str = "job") -> list[float] | None:
    """The row's no-migration pause statistic against ``baseline``, ms, one value per stretch
    (``pauses``); None where a move lacks its switch iterations."""
    return figures(row, baseline)[1]


def both_figures(row: dict, baseline: str = "job") -> tuple[list[float], list[float]] | None:
    """``figures`` of a stored ``migrate`` row that gives both its per-move pauses and its
    no-migration statistic; None for any other row, or one without switch iterations or
    iterations without a migration."""
    if row.get("benchmark") != "migrate" or not row.get("pause_ms_per_repeat") or "comm_ms" not in row:
        return None
    pause, quiet = figures(row, baseline)
    return (pause, quiet) if pause and quiet else None


def assess(row: dict, baseline: str = "job") -> dict | None:
    """One stored row against ``baseline``: where and how it ran, the goals it met, and the
    shares a run without a pause would meet them in (``noise_only_share``); None for a row
    this cannot read."""
    got = both_figures(row, baseline)
    if got is None:
        return None
    pause, quiet = got
    stored = row.get("noise_only_targets_share") if row.get("pause_baseline", "worker") == baseline else None
    shares = stored or noise_only_share(quiet, len(pause), row["mode"])
    met = targets_met(pause, row["mode"])
    return {"site": row.get("site"), "mode": row["mode"], "order": row.get("order"), "code": row.get("code"),
            "baseline": baseline, "moves": len(pause), "met": {**met, "all": all(met.values())},
            "noise_only": shares, "quiet_median": statistics.median(quiet)}


def summarize(assessed: Iterable[dict]) -> list[dict]:
    """Per (site, mode, baseline): runs, the median of their no-migration statistics' medians,
    and per goal the runs that met it against the runs a migration with no pause would be
    expected to meet it in (the sum of the shares), with the median share."""
    groups: dict[tuple, list[dict]] = {}
    for a in assessed:
        groups.setdefault((a["site"], a["mode"], a.get("baseline", "job")), []).append(a)
    out = []
    for (site, mode, baseline), runs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        goals = {}
        for name in runs[0]["noise_only"]:
            shares = [r["noise_only"][name] for r in runs]
            goals[name] = {"met": sum(bool(r["met"][name]) for r in runs),
                           "expected_without_pause": round(sum(shares), 1),
                           "share_median": round(statistics.median(shares), 3),
                           "share_range": [min(shares), max(shares)]}
        quiet = [r["quiet_median"] for r in runs if r.get("quiet_median") is not None]
        out.append({"site": site, "mode": mode, "baseline": baseline, "runs": len(runs),
                    "quiet_median_ms": round(statistics.median(quiet), 1) if quiet else None, "goals": goals})
    return out


def against_noise(rows: Iterable[dict], over_ms: float = 60.0, baseline: str = "job") -> list[dict]:
    """Per (site, mode, neighbour job) of stored rows: every move's pause pooled, against the
    same statistic pooled over the stretches without a migration (``figures``) -- whether the
    moves pause the job more than this machine's noise does. Per group: ``runs``, ``moves``,
    ``quiet`` (how many no-migration values), the medians and p90s of both (ms), the share of
    each above ``over_ms``, the Hodges-Lehmann shift (the median of every move-minus-quiet
    difference, ms: what a move adds to the statistic) and the two-sided Mann-Whitney U
    test's p-value (no shift: a large p)."""
    from scipy.stats import mannwhitneyu

    groups: dict[tuple, list[tuple[list[float], list[float]]]] = {}     # per group, each run's figures
    for row in rows:
        got = both_figures(row, baseline)
        if got is not None:
            other = (row.get("params") or {}).get("other") or "none"
            groups.setdefault((row.get("site"), row["mode"], other), []).append(got)
    out = []
    for (site, mode, other), runs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        m = np.asarray([x for pause, _ in runs for x in pause], dtype=float)
        q = np.asarray([x for _, quiet in runs for x in quiet], dtype=float)
        out.append({"site": site, "mode": mode, "other": other, "baseline": baseline, "runs": len(runs),
                    "moves": len(m), "quiet": len(q),
                    "median_ms": round(float(np.median(m)), 1), "quiet_median_ms": round(float(np.median(q)), 1),
                    "p90_ms": round(float(np.percentile(m, 90)), 1),
                    "quiet_p90_ms": round(float(np.percentile(q, 90)), 1),
                    f"share_over_{over_ms:.0f}ms": round(float(np.mean(m > over_ms)), 3),
                    f"quiet_share_over_{over_ms:.0f}ms": round(float(np.mean(q > over_ms)), 3),
                    "shift_ms": round(float(np.median(np.subtract.outer(m, q))), 1),
                    "p_value": round(float(mannwhitneyu(m, q, alternative="two-sided").pvalue), 4)})
    return out


# ``around_switch``: the iterations a move's excesses are taken for (offsets from its switch
# iteration) and those its baseline comes from, well before the MIGRATE call (about 3 to 4
# iterations before the switch) and after the move was done (about 1 after)
AROUND = range(-5, 5)
CONTEXT = (*range(-9, -5), *range(5, 9))


def around_switch(rows: Iterable[dict], over_ms: float = 60.0) -> list[dict]:
    """Per (site, mode, first move or a later one) of stored ``sum`` / ``server`` rows whose
    moves switched in one iteration: the job's communication time (the slower worker's) at
    each offset in ``AROUND`` from the switch iteration, minus its median over the offsets in
    ``CONTEXT`` (the same baseline for every row, whichever its own), pooled over the moves --
    ``moves``, and per offset the median, mean and p90 excess (ms) and the share above
    ``over_ms``. Offset -1 is the old owners' last iteration, 0 the new owners' first, the
    offsets before -1 the lead iterations in which the workers learn of the move."""
    groups: dict[tuple, dict[int, list[float]]] = {}
    for row in rows:
        if row.get("benchmark") != "migrate" or "comm_ms" not in row or not row.get("per_repeat"):
            continue
        job = [max(times) for times in zip(*row["comm_ms"])]
        for n, move in enumerate(row["per_repeat"]):
            switch = move.get("switch_iterations")
            if not switch or switch[0] != switch[1]:
                continue
            at = switch[0] - 1                     # iteration i is the job's (i - 1)-th record
            context = [job[at + d] for d in CONTEXT if 0 <= at + d < len(job)]
            if len(context) < len(CONTEXT) // 2 or at + max(AROUND) >= len(job) or at + min(AROUND) < 0:
                continue
            base = statistics.median(context)
            key = (row.get("site"), row["mode"], "first" if n == 0 else "later")
            for d in AROUND:
                groups.setdefault(key, {}).setdefault(d, []).append(job[at + d] - base)
    out = []
    for key in sorted(groups, key=lambda k: tuple(map(str, k))):
        site, mode, which = key
        out.append({"site": site, "mode": mode, "move": which, "moves": len(groups[key][0]), "offsets": {
            d: {"median_ms": round(statistics.median(v), 1), "mean_ms": round(statistics.fmean(v), 1),
                "p90_ms": round(float(np.percentile(v, 90)), 1),
                f"share_over_{over_ms:.0f}ms": round(sum(x > over_ms for x in v) / len(v), 3)}
            for d, v in sorted(groups[key].items())}})
    return out


def read_rows(paths: Iterable[Path]) -> Iterable[dict]:
    """The JSON rows of result files (one object per line, or one list)."""
    for path in paths:
        text = Path(path).read_text()
        if text.lstrip().startswith("["):
            yield from json.loads(text)
        else:
            yield from (json.loads(line) for line in text.splitlines() if line.strip())
