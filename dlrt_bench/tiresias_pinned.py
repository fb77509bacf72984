"""Replay every simulator figure that ``bench/results/`` pins and compare it with the file.

Each pinned result file names the command that wrote it (``PINNED``); this module runs the
command again into a temporary file, then compares the two trees: counts and strings must
be equal, floats within ``REL_TOL`` (simulated seconds summed in another order differ in the
last bits, nothing more), wall-clock fields (``sim_wall_seconds``, ``wall_seconds``) and the
host description are skipped. A change to the simulator or the shared driver that changes a
decision shows up here as a differing count or JCT.

    python bench/tiresias_pinned.py                  # every pinned file (minutes)
    python bench/tiresias_pinned.py --only 60job     # those whose name contains 60job
    python bench/tiresias_pinned.py --update         # rewrite the files from this code
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from dlrt import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DATA = ROOT.parent / "shared" / "data"
PHILLY = str(DATA / "traces" / "philly.csv")
SIXTY = str(DATA / "tiresias" / "60_job.csv")
REL_TOL = 1e-9
SKIP = {"sim_wall_seconds", "wall_seconds", "host", "python", "argv", "full_trace_las_over_fifo_wall",
        "decision", "philly_48x8_las_s", "us_per_event", "per_event_last_over_first", "wall_s"}


@dataclass(frozen=True)
class Pinned:
    """A pinned file and the command (argv of ``runner``) that writes it with ``--json FILE``."""
    name: str
    argv: tuple[str, ...]
    runner: str = "tiresias"          # tiresias: ``tiresias.cli``; queues / scale / optimus_workloads: benches

    @property
    def path(self) -> pathlib.Path:
        return RESULTS / self.name


PINNED = [
    Pinned("tiresias_60job_original.json", ("compare", "--trace", SIXTY, "--cluster", "2x4", "--original")),
    Pinned("tiresias_60job_modelled.json", ("compare", "--trace", SIXTY, "--cluster", "2x4")),
    Pinned("tiresias_60job_migrate.json", ("compare", "--trace", SIXTY, "--cluster", "2x4", "--migrate")),
    Pinned("tiresias_philly20k_nomigrate.json", ("simulate", "--trace", PHILLY, "--cluster", "48x8", "--models",
                                                 "cycle", "--limit", "20000", "--policy", "las")),
    Pinned("tiresias_philly20k_migrate.json", ("simulate", "--trace", PHILLY, "--cluster", "48x8", "--models",
                                               "cycle", "--limit", "20000", "--policy", "las", "--migrate")),
    Pinned("tiresias_philly_original.json", ("compare", "--trace", PHILLY, "--cluster", "48x8", "--original")),
    Pinned("tiresias_philly_modelled.json", ("compare", "--trace", PHILLY, "--cluster", "48x8", "--models",
                                             "cycle")),
    Pinned("tiresias_philly_64x8_original.json", ("compare", "--trace", PHILLY, "--cluster", "64x8",
                                                  "--original")),
    Pinned("tiresias_queues.json", (), runner="queues"),
    Pinned("tiresias_scale.json", ("--sizes", "1000", "--reps", "3"), runner="scale"),
    Pinned("optimus_workloads.json", (), runner="optimus_workloads"),
]


def _run(pinned: Pinned, out: pathlib.Path) -> None:
    if pinned.runner == "tiresias":
        from tiresias.cli import main
        argv = [*pinned.argv, "--no-progress", "--json", str(out)] if pinned.argv[0] == "compare" else \
            [*pinned.argv, "--json", str(out)]
        rc = main(argv)
    elif pinned.runner == "queues":
        from dlrt_bench.tiresias_queues import main
        rc = main([*pinned.argv, "--json", str(out)])
    elif pinned.runner == "optimus_workloads":
        from dlrt_bench.optimus_workloads import main as workloads
        rc = workloads([*pinned.argv, "--json", str(out)])
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from tiresias_scale import main  # type: ignore[import-not-found]
        rc = main([*pinned.argv, "--json", str(out)])
    if rc:
        raise RuntimeError(f"{pinned.name}: the command exited {rc}")


def differences(want: Any, got: Any, where: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` (the pinned tree), skipping wall-clock fields."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(want) | set(got)):
            if key in SKIP:
                continue
            if key not in got or key not in want:
                out.append(f"{where}/{key}: {'missing now' if key not in got else 'new'}")
                continue
            out += differences(want[key], got[key], f"{where}/{key}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} entries pinned, {len(got)} now"]
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(want, float) or isinstance(got, float):
        if isinstance(want, bool) or isinstance(got, bool) or not isinstance(want, (int, float)) \
                or not isinstance(got, (int, float)):
            return [f"{where}: {want!r} pinned, {got!r} now"]
        if math.isclose(want, got, rel_tol=REL_TOL, abs_tol=1e-9):
            return []
        return [f"{where}: {want!r} pinned, {got!r} now"]
    return [] if want == got else [f"{where}: {want!r} pinned, {got!r} now"]


def replay(pinned: Pinned, update: bool = False) -> dict[str, Any]:
    """Run ``pinned``'s command; its differences from the file (``update``: write the file)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / pinned.name
        t0 = time.perf_counter()
        _run(pinned, out)
        wall = time.perf_counter() - t0
        text = out.read_text()
    got = json.loads(text)
    want = json.loads(pinned.path.read_text()) if pinned.path.exists() else {}
    row = {"file": pinned.name, "wall_seconds": wall, "differences": differences(want, got)}
    if update:
        pinned.path.write_text(text)
        row["updated"] = True
    return row


def select(only: list[str] | None) -> list[Pinned]:
    return [p for p in PINNED if not only or any(o in p.name for o in only)]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("tiresias_pinned", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", default=None, help="only the pinned files whose name contains one of these")
    p.add_argument("--update", action="store_true", help="rewrite the pinned files from this code")
    cli.add_json(p)
    args = p.parse_args(argv)
    log = cli.text_out(args.json)
    rows = []
    for pinned in select(args.only):
        row = replay(pinned, args.update)
        rows.append(row)
        state = "same" if not row["differences"] else f"{len(row['differences'])} differences"
        state += ", file rewritten" if args.update else ""
        print(f"{pinned.name:40} {row['wall_seconds']:7.1f} s  {state}", file=log, flush=True)
        for line in row["differences"][:20]:
            print(f"    {line}", file=log, flush=True)
    if args.json:
        cli.write_json(args.json, {"bench": "tiresias_pinned", "files": rows})
    return 1 if not args.update and any(r["differences"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
