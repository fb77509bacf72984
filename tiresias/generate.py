"""Synthetic workloads as Tesserae evaluated them: job traces the simulator reads as they are.

Pure functions over plain data. ``generate`` draws the jobs of one of ``KINDS``; the job types
(model, batch size, GPUs) come in as a plain sequence -- what the co-location profiles measured
(``tiresias.packing.profiles``; ``tiresias workload`` reads them) -- so this module depends on
no store. ``write_trace`` writes them in ``dlrt.trace``'s generic format (with ``model`` and
``batch_size``); ``offered_load`` is ``tiresias.load``'s over them.

Kinds (Tesserae §6.1 and §7.2; Shockwave's and Gavel's generators):

* ``shockwave`` (the default: 900 jobs at 80 jobs/hour on 80 GPUs) -- GPUs 1/2/4/8 with
  probabilities 0.6/0.3/0.09/0.01. Durations come from 100 evenly spaced values between 0.2
  and 5 hours (``SHOCKWAVE_HOURS``): a class -- small, medium, large, extra-large: the lowest
  20 %, the next 30 %, the next 40 % and the top 10 % of the values -- with probabilities
  0.72/0.2/0.05/0.03, then a value uniformly among the class's; seconds rounded to integers.
* ``gavel`` -- durations ``10**x`` minutes with ``x`` uniform in [1.5, 3] with probability 0.8,
  else uniform in [3, 4]; GPUs 1/2/4/8 with probabilities 0.7/0.1/0.15/0.05.

Both: Poisson arrivals (exponential gaps of mean ``3600 / rate`` seconds, the first job at 0).
A job's model is drawn uniformly among the models the types have at its GPU count -- or, when
there is none at that count (8 GPUs in Tesserae's table, which estimates multi-GPU speeds
linearly), at the largest count below it; the job still asks for its own count -- and its batch
size uniformly among that model's at that count. 1-GPU jobs thus get only 1-GPU types. A type
without a batch size (``""``: Gavel's A3C and CycleGAN) is written with an empty ``batch_size``,
which ``dlrt.trace`` reads back as None.

Reproducibility: every quantity (arrivals, GPUs, durations, models) has its own
``random.Random`` seeded from ``(seed, quantity)``, and jobs are drawn one after another, so the
same arguments give the same trace and ``jobs=N+k`` starts with the ``jobs=N`` trace.
"""
from __future__ import annotations

import bisect
import csv
import math
import os
import random
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from . import load as _load

__all__ = ["GeneratedJob", "KINDS", "GPU_PROBS", "SHOCKWAVE_HOURS", "SHOCKWAVE_CLASSES", "GAVEL_MINUTES_EXP",
           "generate", "write_trace", "offered_load", "TRACE_COLUMNS"]

KINDS = ("shockwave", "gavel")

# kind -> ((GPUs, probability), ...)
GPU_PROBS: dict[str, tuple[tuple[int, float], ...]] = {
    "shockwave": ((1, 0.6), (2, 0.3), (4, 0.09), (8, 0.01)),
    "gavel": ((1, 0.7), (2, 0.1), (4, 0.15), (8, 0.05)),
}

# numpy.linspace(0.2, 5, 100): the durations (hours) Shockwave's generator draws from
SHOCKWAVE_HOURS: tuple[float, ...] = tuple(i * ((5.0 - 0.2) / 99) + 0.2 for i in range(99)) + (5.0,)
# (name, first index, end index, probability): the classes' slices of SHOCKWAVE_HOURS
SHOCKWAVE_CLASSES: tuple[tuple[str, int, int, float], ...] = (
    ("small", 0, 20, 0.72), ("medium", 20, 50, 0.2), ("large", 50, 90, 0.05), ("extra-large", 90, 100, 0.03))
# gavel: (probability, low, high) of the exponent x of 10**x minutes
GAVEL_MINUTES_EXP: tuple[tuple[float, float, float], ...] = ((0.8, 1.5, 3.0), (0.2, 3.0, 4.0))

TRACE_COLUMNS = ("job_id", "submit_time", "num_gpus", "duration", "model", "batch_size")


@dataclass(frozen=True)
class GeneratedJob:
    job_id: int             # 0..N-1 in submit order
    submit_time: float      # seconds; the first job at 0.0
    num_gpus: int
    duration: float         # seconds when run alone
    model: str
    batch_size: str         # the job type's batch size label ("64", "256/16"; "" for none, as Gavel's A3C)


def _pick(rng: random.Random, weighted: Sequence[tuple[object, float]]):
    """One value of ``weighted`` ((value, probability), ...; probabilities sum to 1)."""
    r = rng.random()
    acc = 0.0
    for value, p in weighted:
        acc += p
        if r < acc:
            return value
    return weighted[-1][0]              # r within rounding of 1.0


def _shockwave_duration(rng: random.Random) -> float:
    _, lo, hi = _pick(rng, [((name, lo, hi), p) for name, lo, hi, p in SHOCKWAVE_CLASSES])
    return float(round(3600.0 * SHOCKWAVE_HOURS[rng.randrange(lo, hi)]))


def _gavel_duration(rng: random.Random) -> float:
    lo, hi = _pick(rng, [((lo, hi), p) for p, lo, hi in GAVEL_MINUTES_EXP])
    return 60.0 * 10.0 ** rng.uniform(lo, hi)


_DURATIONS = {"shockwave": _shockwave_duration, "gavel": _gavel_duration}


def _natural(text: str) -> list:
    """A sort key putting "32" before "128" (digits compared as numbers)."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text))]


def _catalogue(types: Sequence[tuple[str, str, int]]) -> dict[int, list[tuple[str, list[str]]]]:
    """GPU count -> [(model, [batch sizes]), ...], sorted (the draws do not depend on the order
    of ``types``); checks every type."""
    if isinstance(types, (str, bytes)) or not len(types):
        raise ValueError("types must be a non-empty sequence of (model, batch_size, gpus)")
    seen: dict[int, dict[str, set[str]]] = {}
    for t in types:
        try:
            model, batch, gpus = t
        except (TypeError, ValueError):
            raise ValueError(f"a job type must be (model, batch_size, gpus), got {t!r}") from None
        if not isinstance(model, str) or not model.strip() or not isinstance(batch, str):
            raise ValueError(f"a job type needs a model (a non-empty string) and a batch size (a string), got {t!r}")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"a job type's GPUs must be an integer >= 1, got {t!r}")
        seen.setdefault(gpus, {}).setdefault(model.strip(), set()).add(batch.strip())
    if 1 not in seen:
        raise ValueError("types hold no 1-GPU job type (1-GPU jobs would have no model)")
    return {g: [(m, sorted(b, key=_natural)) for m, b in sorted(by_model.items())]
            for g, by_model in sorted(seen.items())}


def _streams(kind: str, seed: int) -> dict[str, random.Random]:
    # a str seed is hashed (SHA-512): stable across runs and Python versions, whatever PYTHONHASHSEED
    return {name: random.Random(f"tiresias.generate/{kind}/{name}/{seed}")
            for name in ("arrivals", "gpus", "durations", "models")}


def generate(kind: str, jobs: int, rate: float, seed: int,
             types: Sequence[tuple[str, str, int]]) -> list[GeneratedJob]:
    """``jobs`` jobs of workload ``kind`` arriving at ``rate`` jobs per hour, drawn with ``seed``;
    models and batch sizes from ``types``, (model, batch_size, gpus) for every measured job type."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload kind {kind!r} (one of {', '.join(KINDS)})")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of jobs per hour above 0, got {rate!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    catalogue = _catalogue(types)
    counts = sorted(catalogue)
    rng = _streams(kind, seed)
    gpu_probs, duration = GPU_PROBS[kind], _DURATIONS[kind]
    lam = rate / 3600.0
    out: list[GeneratedJob] = []
    t = 0.0
    for i in range(jobs):
        if i:
            t += rng["arrivals"].expovariate(lam)
        gpus = _pick(rng["gpus"], gpu_probs)
        seconds = duration(rng["durations"])
        table = catalogue[counts[bisect.bisect_right(counts, gpus) - 1]]     # the largest count <= gpus
        model, batches = table[rng["models"].randrange(len(table))]
        batch = batches[rng["models"].randrange(len(batches))]
        out.append(GeneratedJob(i, t, gpus, seconds, model, batch))
    return out


def write_trace(jobs: Sequence[GeneratedJob], path: str | os.PathLike) -> None:
    """``jobs`` as a generic-format trace CSV (``TRACE_COLUMNS``); floats written exactly
    (``repr``), so ``dlrt.trace.load_trace`` reads back the same numbers."""
    with open(os.fspath(path), "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(TRACE_COLUMNS)
        for j in jobs:
            w.writerow([j.job_id, repr(float(j.submit_time)), j.num_gpus, repr(float(j.duration)), j.model,
                        j.batch_size])


def offered_load(jobs: Iterable, gpus: int) -> float | None:
    """The overall offered load of ``jobs`` on ``gpus`` GPUs (``tiresias.load.offered_load``:
    their GPU-seconds over what the GPUs serve from the first to the last submission); None
    when every job is submitted at once (a single job)."""
    return _load.offered_load(jobs, gpus).overall
