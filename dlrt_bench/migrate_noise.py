"""How often a migration with no pause at all would meet the pause goals, for stored
``autops bench migrate`` rows -- those written before the benchmark reported it
(``noise_only_targets_share``) included.

A stored row keeps each worker's communication time per iteration (``comm_ms``) and each
move's iterations (``iteration_at_call``, ``iteration_at_done``, ``switch_iterations``), not
the clock times its migration windows were cut by. ``quiet_pauses`` rebuilds the records on
a synthetic clock -- iteration ``i`` on the communication phase of ``i`` -- with each move's
window from the iteration the call came in to the one it was done in, and takes the
no-migration statistic as ``autops_migrate.pauses`` does. The windows are approximate (a
call or a done near an iteration's edge shifts them by one), so the statistic is too; rows
that carry ``quiet_pause_ms`` are taken as they are.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Iterable

from .autops_migrate import noise_only_share, pauses, targets_met

PERIOD = 10.0       # the synthetic clock's iteration, s: longer than any communication phase


def quiet_pauses(row: dict) -> list[float] | None:
    """The row's no-migration pause statistic, ms, one value per stretch (``pauses``); None
    where a move lacks its switch iterations."""
    if row.get("quiet_pause_ms") is not None:
        return list(row["quiet_pause_ms"])
    moves = row.get("per_repeat") or []
    if not moves or any(m.get("switch_iterations") is None for m in moves):
        return None
    per_rank = {r: [(i + 1, PERIOD * (i + 1), PERIOD * (i + 1) + 1, PERIOD * (i + 1) + 1 + c / 1e3)
                    for i, c in enumerate(comm)] for r, comm in enumerate(row["comm_ms"])}
    windows = [(PERIOD * (m["iteration_at_call"] + 1) + 0.5, PERIOD * (m["iteration_at_done"] + 1) + 1.5)
               for m in moves]
    params = row.get("params") or {}
    got = pauses(per_rank, [{"switch_iterations": m["switch_iterations"]} for m in moves], windows,
                 params.get("skip", 2), params.get("gap", 5))
    return got["quiet_pause_ms"]


def assess(row: dict) -> dict | None:
    """One stored row: where and how it ran, the goals it met, and the shares a run without
    a pause would meet them in (``noise_only_share``); None for a row this cannot read."""
    if row.get("benchmark") != "migrate" or not row.get("pause_ms_per_repeat") or "comm_ms" not in row:
        return None
    quiet = quiet_pauses(row)
    moves = len(row["pause_ms_per_repeat"])
    shares = row.get("noise_only_targets_share") or (noise_only_share(quiet, moves, row["mode"]) if quiet else None)
    if shares is None:                   # no iteration without a migration to draw from
        return None
    met = targets_met(row["pause_ms_per_repeat"], row["mode"])
    return {"site": row.get("site"), "mode": row["mode"], "order": row.get("order"), "code": row.get("code"),
            "moves": moves, "met": {**met, "all": all(met.values())}, "noise_only": shares}


def summarize(assessed: Iterable[dict]) -> list[dict]:
    """Per (site, mode): runs, and per goal the runs that met it against the runs a
    migration with no pause would be expected to meet it in (the sum of the shares), with
    the median share."""
    groups: dict[tuple, list[dict]] = {}
    for a in assessed:
        groups.setdefault((a["site"], a["mode"]), []).append(a)
    out = []
    for (site, mode), runs in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        goals = {}
        for name in runs[0]["noise_only"]:
            shares = [r["noise_only"][name] for r in runs]
            goals[name] = {"met": sum(bool(r["met"][name]) for r in runs),
                           "expected_without_pause": round(sum(shares), 1),
                           "share_median": round(statistics.median(shares), 3),
                           "share_range": [min(shares), max(shares)]}
        out.append({"site": site, "mode": mode, "runs": len(runs), "goals": goals})
    return out


def read_rows(paths: Iterable[Path]) -> Iterable[dict]:
    """The JSON rows of result files (one object per line, or one list)."""
    for path in paths:
        text = Path(path).read_text()
        if text.lstrip().startswith("["):
            yield from json.loads(text)
        else:
            yield from (json.loads(line) for line in text.splitlines() if line.strip())
