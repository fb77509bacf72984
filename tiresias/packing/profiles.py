"""Co-location throughput profiles: how fast two jobs run when they share the same GPUs.

This module owns the profile store (``ProfileStore``) that the packing policies query, and the
two loaders for the measured tables (``../shared/data/colocation``, see its SOURCE.md):

- ``blox_norm_speed.csv`` (Tesserae authors): per pair, each job's speed normalised to the job
  alone. A pair has one row per parallelism strategy (``pipeline_strategy``) and may be listed
  as (A, B), as (B, A) or both; Tesserae runs the best strategy, so the pair's speeds are those
  of the row, over both orders, with the largest ``speed1 + speed2`` (ties: the first row in
  the file). ``model2 == "Empty"`` rows (a job alone) only register the job type. The table
  has no absolute speeds: ``isolated()`` is None for its types.
- ``gavel_simulation_throughputs.json`` (Gavel): absolute steps/s alone ("null") and packed on
  one GPU, per GPU type. Normalised speed = packed steps/s / that job's own "null" steps/s.
  Multi-GPU pair entries are all 0 in the table: they are unmeasured, not out of memory.

Speeds are normalised: 1.0 = no slowdown, ``(0.0, 0.0)`` = the two do not fit in GPU memory
together. Lookups are symmetric: ``pair(b, a)`` is ``pair(a, b)`` swapped.

Linear estimate (Tesserae §4.3: data-parallel throughput scales linearly with GPUs, so the
normalised packed speeds do not depend on the GPU count). ``pair(a, b)`` for n-GPU types with
no measurement at n GPUs uses the measured pair of the same two (model, batch) at m GPUs,
where m = 1 if that pair is measured at 1 GPU (what Tesserae profiles), otherwise the largest
m < n at which it is measured; ``estimated(a, b)`` is then True. A measured (0.0, 0.0) is
carried over as is. No measurement at any m < n: ``pair`` is None. A type is ``knows()`` when
it is measured, or its (model, batch) is measured at fewer GPUs. ``isolated()`` of a type with
no entry is n x the 1-GPU entry of its (model, batch) when that one is a number.
"""
from __future__ import annotations

import ast
import csv
import json
import math
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["JobType", "ProfileStore", "load_profiles", "parse_gavel_key", "BLOX_COLUMNS"]

Pair = tuple[float, float]
PairKey = tuple["JobType", "JobType"]

BLOX_COLUMNS = (
    "index", "model1", "dataset1", "gpu_num1", "batch_size1", "speed1", "co_pipeline_rank",
    "pipeline_strategy", "model2", "dataset2", "gpu_num2", "batch_size2", "speed2",
)
DEFAULT_GAVEL_GPU = "v100"
# the Tesserae authors' table in the data directory beside the project (../shared/data)
DEFAULT_COLOCATION = Path(__file__).resolve().parents[3] / "shared" / "data" / "colocation" / "blox_norm_speed.csv"
NOT_FIT: Pair = (0.0, 0.0)


@dataclass(frozen=True, order=True)
class JobType:
    """A profiled kind of job: model, batch size as the table writes it ("64", "256/16"), GPUs."""

    model: str
    batch_size: str
    gpus: int

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"JobType.gpus must be a positive int, got {self.gpus!r}")

    def at(self, gpus: int) -> JobType:
        """The same (model, batch) on ``gpus`` GPUs."""
        return replace(self, gpus=gpus)


def _key(a: JobType, b: JobType) -> tuple[PairKey, bool]:
    """The canonical (sorted) key of a pair and whether (a, b) is stored swapped."""
    return ((a, b), False) if a <= b else ((b, a), True)


def _check_speed(value: float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


class ProfileStore:
    """Isolated and pairwise (normalised) speeds by job type, with Tesserae's linear estimate."""

    def __init__(
        self,
        isolated: Mapping[JobType, float | None],
        pairs: Mapping[tuple[JobType, JobType], tuple[float, float]],
        source: str = "",
    ) -> None:
        self.source = source
        self._isolated: dict[JobType, float | None] = {}
        for t, speed in isolated.items():
            self._isolated[t] = None if speed is None else _check_speed(speed, f"isolated speed of {t}")
        self._pairs: dict[PairKey, Pair] = {}
        for (a, b), (sa, sb) in pairs.items():
            self._check_same_gpus(a, b)
            value = (_check_speed(sa, f"speed of {a}"), _check_speed(sb, f"speed of {b}"))
            key, swapped = _key(a, b)
            if swapped:
                value = (value[1], value[0])
            if self._pairs.get(key, value) != value:
                raise ValueError(f"pair ({a}, {b}) is given twice with different speeds")
            self._pairs[key] = value
        # GPU counts at which each (model, batch) is measured, for the linear estimate
        self._counts: dict[tuple[str, str], set[int]] = {}
        for t in self._isolated:
            self._note(t)
        for a, b in self._pairs:
            self._note(a)
            self._note(b)

    def _note(self, t: JobType) -> None:
        self._counts.setdefault((t.model, t.batch_size), set()).add(t.gpus)

    @staticmethod
    def _check_same_gpus(a: JobType, b: JobType) -> None:
        if a.gpus != b.gpus:
            raise ValueError(f"a packed pair shares the same GPUs: {a} and {b} have different GPU counts")

    def __repr__(self) -> str:
        return f"ProfileStore({self.source!r}, {len(self.job_types())} job types, {len(self._pairs)} pairs)"

    # -- queries -------------------------------------------------------------------------------

    def job_types(self) -> list[JobType]:
        """Every measured job type, sorted."""
        types = set(self._isolated)
        for a, b in self._pairs:
            types.update((a, b))
        return sorted(types)

    def knows(self, t: JobType) -> bool:
        """Measured, or estimable: its (model, batch) is measured at fewer GPUs."""
        counts = self._counts.get((t.model, t.batch_size), set())
        return any(m <= t.gpus for m in counts)

    def isolated(self, t: JobType) -> float | None:
        """Absolute speed alone (Gavel: steps/s), or None when the table has none.

        A type with no entry gets n x its (model, batch)'s 1-GPU speed (linear scaling)."""
        if t in self._isolated:
            return self._isolated[t]
        one = self._isolated.get(t.at(1))
        return None if one is None else t.gpus * one

    def _measured(self, a: JobType, b: JobType) -> Pair | None:
        key, swapped = _key(a, b)
        value = self._pairs.get(key)
        if value is None or not swapped:
            return value
        return (value[1], value[0])

    def _estimate(self, a: JobType, b: JobType) -> Pair | None:
        """The linear estimate of an n-GPU pair (see the module docstring), None if there is none."""
        shared = self._counts.get((a.model, a.batch_size), set()) & self._counts.get((b.model, b.batch_size), set())
        candidates = [m for m in shared if m < a.gpus and self._measured(a.at(m), b.at(m)) is not None]
        if not candidates:
            return None
        m = 1 if 1 in candidates else max(candidates)
        return self._measured(a.at(m), b.at(m))

    def pair(self, a: JobType, b: JobType) -> tuple[float, float] | None:
        """Normalised speeds (of a, of b) when they share the same GPUs.

        ``(0.0, 0.0)``: they do not fit together; None: no measurement and no estimate."""
        self._check_same_gpus(a, b)
        measured = self._measured(a, b)
        return measured if measured is not None else self._estimate(a, b)

    def estimated(self, a: JobType, b: JobType) -> bool:
        """True when ``pair(a, b)`` comes from the linear estimate, not a measurement."""
        self._check_same_gpus(a, b)
        return self._measured(a, b) is None and self._estimate(a, b) is not None

    # -- updates -------------------------------------------------------------------------------

    def observe(self, a: JobType, b: JobType, speed_a: float, speed_b: float, weight: float = 0.5) -> None:
        """Fold in measured normalised speeds of a and b sharing GPUs.

        new = (1 - weight) * old + weight * measured. The measurement replaces the value
        outright when the pair is unknown or only estimated, and when the old or the measured
        value is (0.0, 0.0): fitting in memory is not averaged."""
        self._check_same_gpus(a, b)
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight must be in [0, 1], got {weight!r}")
        seen = (_check_speed(speed_a, f"speed of {a}"), _check_speed(speed_b, f"speed of {b}"))
        old = self._measured(a, b)
        if old is not None and old != NOT_FIT and seen != NOT_FIT:
            seen = ((1 - weight) * old[0] + weight * seen[0], (1 - weight) * old[1] + weight * seen[1])
        key, swapped = _key(a, b)
        self._pairs[key] = (seen[1], seen[0]) if swapped else seen
        self._note(a)
        self._note(b)

    def with_noise(self, level: float, rng: random.Random) -> ProfileStore:
        """A copy whose every pair speed is multiplied by its own factor ~ U[1 - level, 1 + level].

        Tesserae Fig. 16 (profiling error). Results are clipped at >= 0, so a (0.0, 0.0) pair
        stays (0.0, 0.0); isolated speeds are unchanged. Pairs are drawn in sorted order, so a
        seeded ``rng`` gives the same copy every time."""
        if not 0.0 <= level <= 1.0:
            raise ValueError(f"noise level must be in [0, 1], got {level!r}")
        noisy: dict[PairKey, Pair] = {}
        for key in sorted(self._pairs):
            sa, sb = self._pairs[key]
            fa, fb = rng.uniform(1 - level, 1 + level), rng.uniform(1 - level, 1 + level)
            noisy[key] = (max(0.0, sa * fa), max(0.0, sb * fb))
        return ProfileStore(self._isolated, noisy, source=f"{self.source} (noise {level:g})")


# -- loaders -----------------------------------------------------------------------------------

_GAVEL_NAME = re.compile(r"^(?P<model>[^()]+?) \(batch size (?P<batch>\d+)\)$")
_GAVEL_BARE = re.compile(r"^[^()]+$")


def parse_gavel_key(key: str) -> JobType:
    """``"('ResNet-18 (batch size 16)', 1)"`` -> ``JobType("ResNet-18", "16", 1)``.

    Gavel names two jobs without a batch size (``('A3C', 1)``, ``('CycleGAN', 1)``): their
    batch size is ``""``."""
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(f"not a Gavel job key: {key!r}") from None
    if (
        not isinstance(value, tuple) or len(value) != 2 or not isinstance(value[0], str)
        or isinstance(value[1], bool) or not isinstance(value[1], int) or value[1] < 1
    ):
        raise ValueError(f"not a Gavel job key (want \"('<model> (batch size B)', scale)\"): {key!r}")
    name, gpus = value
    match = _GAVEL_NAME.match(name)
    if match:
        return JobType(match["model"], match["batch"], gpus)
    if _GAVEL_BARE.match(name):
        return JobType(name.strip(), "", gpus)
    raise ValueError(f"not a Gavel job name: {name!r} in {key!r}")


def _load_blox(path: Path, text: str) -> ProfileStore:
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in BLOX_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path}: not a blox co-location table, missing columns {', '.join(missing)}")
    isolated: dict[JobType, float | None] = {}
    best: dict[PairKey, tuple[float, Pair]] = {}  # canonical key -> (speed sum, speeds), first best row
    for row in reader:
        line = reader.line_num
        try:
            a = JobType(row["model1"], row["batch_size1"], int(row["gpu_num1"]))
            isolated[a] = None
            if row["model2"] == "Empty":
                continue
            b = JobType(row["model2"], row["batch_size2"], int(row["gpu_num2"]))
            isolated[b] = None
            if a.gpus != b.gpus:
                raise ValueError(f"GPU counts differ ({a.gpus} and {b.gpus})")
            speeds = (_check_speed(row["speed1"], "speed1"), _check_speed(row["speed2"], "speed2"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: line {line}: {exc}") from None
        key, swapped = _key(a, b)
        if swapped:
            speeds = (speeds[1], speeds[0])
        total = round(speeds[0] + speeds[1], 9)  # rounded so equal sums tie exactly
        if key not in best or total > best[key][0]:
            best[key] = (total, speeds)
    return ProfileStore(isolated, {k: v for k, (_, v) in best.items()}, source=str(path))


def _load_gavel(path: Path, text: str, gpu_type: str | None) -> ProfileStore:
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed JSON: {exc}") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"{path}: not a Gavel throughput table (want {{gpu_type: {{job: {{...}}}}}})")
    gpu_type = DEFAULT_GAVEL_GPU if gpu_type is None else gpu_type
    if gpu_type not in table:
        raise ValueError(f"{path}: unknown GPU type {gpu_type!r}; available: {', '.join(sorted(table))}")
    try:
        entries = {parse_gavel_key(k): v for k, v in table[gpu_type].items()}
        alone = {t: _check_speed(e["null"], f"null speed of {t}") for t, e in entries.items()}
        pairs: dict[PairKey, Pair] = {}
        for a, e in entries.items():
            for other, packed in e.items():
                if other == "null":
                    continue
                b = parse_gavel_key(other)
                if b not in alone:
                    raise ValueError(f"{other} is paired with {a} but has no entry of its own")
                if len(packed) != 2:
                    raise ValueError(f"pair {a} / {other} has {len(packed)} speeds, want 2")
                pa, pb = (_check_speed(s, f"packed speed of {a} / {other}") for s in packed)
                if a.gpus != b.gpus or (a.gpus > 1 and pa == pb == 0.0):
                    continue  # multi-GPU pairs are not measured (all 0 in the table)
                if (pa, pb) == NOT_FIT:
                    pairs[(a, b)] = NOT_FIT
                elif alone[a] > 0.0 and alone[b] > 0.0:
                    pairs[(a, b)] = (pa / alone[a], pb / alone[b])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed Gavel table at {gpu_type!r}: {exc}") from None
    return ProfileStore(alone, _symmetric(path, pairs), source=f"{path} [{gpu_type}]")


def _symmetric(path: Path, pairs: dict[PairKey, Pair]) -> dict[PairKey, Pair]:
    """One entry per unordered pair; Gavel lists both orders, which must agree."""
    out: dict[PairKey, Pair] = {}
    for (a, b), value in pairs.items():
        key, swapped = _key(a, b)
        if swapped:
            value = (value[1], value[0])
        if key in out and not all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(out[key], value)):
            raise ValueError(f"{path}: pair {a} / {b} has different speeds in its two orders")
        out.setdefault(key, value)
    return out


def load_profiles(path: str | os.PathLike, gpu_type: str | None = None) -> ProfileStore:
    """Load a blox CSV (``.csv``) or a Gavel JSON (``.json``) table; other names by content.

    ``gpu_type`` picks the Gavel GPU type (default ``"v100"``) and is an error for a blox
    table. A missing or malformed file is a ValueError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ValueError(f"{path}: cannot read profile table: {reason}") from None
    suffix = path.suffix.lower()
    is_json = suffix == ".json" or (suffix != ".csv" and text.lstrip().startswith("{"))
    if is_json:
        return _load_gavel(path, text, gpu_type)
    if gpu_type is not None:
        raise ValueError(f"{path}: gpu_type={gpu_type!r} applies to Gavel tables only, not a blox CSV")
    return _load_blox(path, text)
