"""The Pollux applications as simulated jobs: measured step times and validation curves.

``load_application(traces/<app>)`` reads one folder of the Pollux artifact
(``../shared/data/pollux/traces``, ``$TIRESIAS_POLLUX_TRACES`` overrides; see its SOURCE.md)
into an ``Application``: how long an optimizer step takes at a GPU count and global batch
size, how many steps each epoch takes, and the validation curve as a decreasing quantity.

Step times (``StepTimes``). ``placements.csv`` rows (placement "22" = 2 GPUs on each of 2
nodes) are averaged per (nodes, GPUs, local batch) over the placements with those counts, and
``scalability.csv`` adds the larger spreads (6-16 nodes). A query (nodes, GPUs, local batch):

1. local batch: linear in log(local batch) between the two nearest measured local batches
   of that configuration; below the smallest measured one, the value at the smallest (never
   extrapolated below a measured time); above the largest, its sync time plus its compute
   time scaled by local / largest (compute in proportion to the samples).
2. GPUs: a configuration not measured is linear in the GPU count between the nearest measured
   GPU counts on the same node count (clamped to that node count's measured range);
3. nodes: a node count not measured (5, 7, 9-11, 13-15) is linear in the node count between
   the nearest measured node counts, each at the GPU count clamped to its own range.

Measured points come back exactly and interpolated ones lie between their neighbours;
measurements that are not monotonic (yolov3's local batch 6 is slower than 8 on one GPU) are
kept as measured: no smoothing. ``nodes=None`` means the fewest nodes of 4 GPUs
(``ceil(gpus / 4)``). The local batch is ``batch_size / gpus``; above ``max_local_bsz`` (the
largest measured local batch; yolov3: 8, Pollux's cap) a step accumulates gradients over
``ceil(local / max_local_bsz)`` micro-batches: that many compute times plus one sync.
``compute_time = step_time - sync_time`` (floored at 0: five placement rows measure a sync
time above the step time). ``max_gpus(batch)`` = min(batch // smallest measured local
batch, the most GPUs measured): no GPU gets less than the smallest measured local batch.

Progress. ``progress`` is epochs x (data set size / smallest batch size); ``iteration``
counts optimizer steps. Row e of ``validation-<B>.csv`` is the state after epoch e+1, so epoch
e takes ``iteration[e] - iteration[e-1]`` steps (``steps_per_epoch``: not constant, the first
epochs take more at large batches) and one step in it adds
``(progress[e] - progress[e-1]) / steps`` progress (``progress_per_step``). ``total_steps``
is the last row's iteration, ``epoch_cap`` the row count.

Validation metric -> decreasing quantity (``loss_curve``, points at the ``iteration`` column):

| app | metric | value |
|---|---|---|
| cifar10 | top-1 accuracy (fraction) | 1 - accuracy |
| imagenet | top-1 accuracy (fraction) | 1 - accuracy |
| ncf | hit rate (fraction) | 1 - hit rate |
| bert | F1 in percent | 1 - F1/100 |
| deepspeech2 | word error rate in percent | WER as is |
| yolov3 | validation loss | as is |
"""
from __future__ import annotations

import csv
import math
import os
import re
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .pushpull import PushPullCosts, default_costs, model_bytes as app_model_bytes, pushpull_time

__all__ = ["Application", "StepTimes", "ValidationCurve", "load_application", "load_applications",
           "DEFAULT_TRACES", "METRIC_TO_LOSS", "GPUS_PER_NODE"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TRACES_ENV = "TIRESIAS_POLLUX_TRACES"
DEFAULT_TRACES = PROJECT_ROOT.parent / "shared" / "data" / "pollux" / "traces"
GPUS_PER_NODE = 4
LOCAL_BSZ_CAP = {"yolov3": 8}           # Pollux's simulator caps yolov3's local batch

METRIC_TO_LOSS: dict[str, Callable[[float], float]] = {
    "cifar10": lambda accuracy: 1.0 - accuracy,
    "imagenet": lambda accuracy: 1.0 - accuracy,
    "ncf": lambda hit_rate: 1.0 - hit_rate,
    "bert": lambda f1_percent: 1.0 - f1_percent / 100.0,
    "deepspeech2": lambda wer_percent: wer_percent,
    "yolov3": lambda loss: loss,
}


def _read_csv(path: Path, columns: tuple[str, ...]) -> list[tuple[float, ...]]:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(header[:len(columns)]) != columns:
            raise ValueError(f"{path}: expected columns {','.join(columns)}, got {header}")
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                rows.append(tuple(float(x) for x in row[:len(columns)]))
            except ValueError:
                raise ValueError(f"{path}:{line}: not numbers: {row}") from None
            if len(row) < len(columns):
                raise ValueError(f"{path}:{line}: {len(row)} fields, expected {len(columns)}")
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


@dataclass(frozen=True)
class _Curve:
    """One configuration's measurements over the local batch (sorted, log-spaced x)."""
    local_bsz: np.ndarray
    step_time: np.ndarray
    sync_time: np.ndarray

    def at(self, local_bsz: float) -> tuple[float, float]:
        top = self.local_bsz[-1]
        if local_bsz > top:
            sync = float(self.sync_time[-1])
            compute = max(float(self.step_time[-1]) - sync, 0.0)
            return sync + compute * local_bsz / top, sync
        x = math.log(max(local_bsz, self.local_bsz[0]))
        xs = np.log(self.local_bsz)
        return float(np.interp(x, xs, self.step_time)), float(np.interp(x, xs, self.sync_time))


class StepTimes:
    """Measured (nodes, GPUs, local batch) -> (step, sync) seconds, interpolated (see module)."""

    def __init__(self, rows: list[tuple[int, int, float, float, float]]):
        grouped: dict[tuple[int, int], dict[float, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
        for nodes, gpus, local, step, sync in rows:
            grouped[(int(nodes), int(gpus))][float(local)].append((step, sync))
        self._curves: dict[tuple[int, int], _Curve] = {}
        for config, by_local in grouped.items():
            locals_ = sorted(by_local)
            means = [np.mean(by_local[b], axis=0) for b in locals_]
            self._curves[config] = _Curve(np.array(locals_), np.array([m[0] for m in means]),
                                          np.array([m[1] for m in means]))
        self._gpus_on: dict[int, list[int]] = defaultdict(list)
        for nodes, gpus in sorted(self._curves):
            self._gpus_on[nodes].append(gpus)
        self._node_counts = sorted(self._gpus_on)
        self._memo: dict[tuple[int, int, float], tuple[float, float]] = {}

    @property
    def configurations(self) -> list[tuple[int, int]]:
        """Measured (nodes, GPUs) pairs."""
        return sorted(self._curves)

    def measured(self, nodes: int, gpus: int) -> list[tuple[float, float, float]]:
        """(local batch, step, sync) rows of one measured configuration."""
        c = self._curves[(nodes, gpus)]
        return list(zip(c.local_bsz.tolist(), c.step_time.tolist(), c.sync_time.tolist()))

    @property
    def max_gpus(self) -> int:
        return max(g for _, g in self._curves)

    @property
    def min_local_bsz(self) -> float:
        return min(float(c.local_bsz[0]) for c in self._curves.values())

    @property
    def max_local_bsz(self) -> float:
        return max(float(c.local_bsz[-1]) for c in self._curves.values())

    def at(self, nodes: int, gpus: int, local_bsz: float) -> tuple[float, float]:
        """(step_time, sync_time) seconds at ``gpus`` GPUs on ``nodes`` nodes."""
        key = (nodes, gpus, local_bsz)
        if key not in self._memo:
            self._memo[key] = self._at(nodes, gpus, local_bsz)
        return self._memo[key]

    def _at(self, nodes: int, gpus: int, local_bsz: float) -> tuple[float, float]:
        counts = self._node_counts
        nodes = min(nodes, counts[-1])
        if nodes in self._gpus_on:
            return self._on_nodes(nodes, gpus, local_bsz)
        i = bisect_left(counts, nodes)
        lo, hi = counts[i - 1], counts[i]
        weight = (nodes - lo) / (hi - lo)
        a, b = self._on_nodes(lo, gpus, local_bsz), self._on_nodes(hi, gpus, local_bsz)
        return tuple((1 - weight) * x + weight * y for x, y in zip(a, b))  # type: ignore[return-value]

    def _on_nodes(self, nodes: int, gpus: int, local_bsz: float) -> tuple[float, float]:
        measured = self._gpus_on[nodes]
        gpus = min(max(gpus, measured[0]), measured[-1])
        i = bisect_left(measured, gpus)
        if measured[i] == gpus:
            return self._curves[(nodes, gpus)].at(local_bsz)
        lo, hi = measured[i - 1], measured[i]
        weight = (gpus - lo) / (hi - lo)
        a = self._curves[(nodes, lo)].at(local_bsz)
        b = self._curves[(nodes, hi)].at(local_bsz)
        return tuple((1 - weight) * x + weight * y for x, y in zip(a, b))  # type: ignore[return-value]


@dataclass(frozen=True)
class ValidationCurve:
    """One ``validation-<B>.csv``: one row per epoch."""
    batch_size: int
    progress: tuple[float, ...]
    iteration: tuple[int, ...]
    metric: tuple[float, ...]


@dataclass
class Application:
    """A Pollux application: step times, validation curves, and what its model costs to sync."""
    name: str
    step_times: StepTimes
    validation: dict[int, ValidationCurve]
    max_local_bsz: float
    model_bytes: int | None = None
    costs: PushPullCosts | None = None
    epoch_cap: int = field(init=False)

    def __post_init__(self) -> None:
        caps = {len(c.metric) for c in self.validation.values()}
        if len(caps) != 1:
            raise ValueError(f"{self.name}: validation files disagree on the epoch count: {sorted(caps)}")
        self.epoch_cap = caps.pop()

    # --- configurations -------------------------------------------------------------------
    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.validation)

    def max_gpus(self, batch_size: int) -> int:
        """The most GPUs ``batch_size`` allows (module docstring)."""
        return max(1, min(int(batch_size // self.step_times.min_local_bsz), self.step_times.max_gpus))

    def _step_and_sync(self, gpus: int, batch_size: int, nodes: int | None) -> tuple[float, float]:
        if gpus < 1 or batch_size < 1:
            raise ValueError(f"{self.name}: gpus and batch_size must be >= 1 (got {gpus}, {batch_size})")
        if gpus > self.max_gpus(batch_size):
            raise ValueError(f"{self.name}: {gpus} GPUs exceed max_gpus({batch_size}) = "
                             f"{self.max_gpus(batch_size)}")
        nodes = math.ceil(gpus / GPUS_PER_NODE) if nodes is None else nodes
        if not 1 <= nodes <= gpus or gpus > nodes * GPUS_PER_NODE:
            raise ValueError(f"{self.name}: {gpus} GPUs cannot spread over {nodes} nodes of {GPUS_PER_NODE}")
        local = batch_size / gpus
        micro_batches = max(1, math.ceil(local / self.max_local_bsz - 1e-9))
        step, sync = self.step_times.at(nodes, gpus, local / micro_batches)
        compute = max(step - sync, 0.0)
        return micro_batches * compute + sync, sync

    def step_time(self, gpus: int, batch_size: int, nodes: int | None = None) -> float:
        """Seconds per optimizer step at ``gpus`` GPUs and global batch ``batch_size``."""
        return self._step_and_sync(gpus, batch_size, nodes)[0]

    def sync_time(self, gpus: int, batch_size: int, nodes: int | None = None) -> float:
        """The all-reduce (synchronization) part of ``step_time``."""
        return self._step_and_sync(gpus, batch_size, nodes)[1]

    def compute_time(self, gpus: int, batch_size: int, nodes: int | None = None) -> float:
        step, sync = self._step_and_sync(gpus, batch_size, nodes)
        return step - sync

    def speed(self, p: int, w: int, batch_size: int, sync: str = "pushpull") -> float:
        """Steps per second with ``w`` workers (GPUs) and ``p`` aggregators: ``"measured"`` =
        1/step_time (p ignored); ``"pushpull"`` = 1/(compute_time + pushpull_time)."""
        if sync == "measured":
            return 1.0 / self.step_time(w, batch_size)
        if sync != "pushpull":
            raise ValueError(f"sync must be 'pushpull' or 'measured', not {sync!r}")
        if self.model_bytes is None or self.costs is None:
            raise ValueError(f"{self.name}: no model size or push/pull costs for sync='pushpull'")
        return 1.0 / (self.compute_time(w, batch_size) + pushpull_time(self.model_bytes, w, p, self.costs))

    # --- progress and convergence ---------------------------------------------------------
    def _curve(self, batch_size: int) -> ValidationCurve:
        try:
            return self.validation[batch_size]
        except KeyError:
            raise ValueError(f"{self.name}: no validation file for batch size {batch_size}; "
                             f"have {self.batch_sizes}") from None

    def steps_per_epoch(self, batch_size: int) -> list[int]:
        """Optimizer steps of each epoch (iteration differences), ``epoch_cap`` of them."""
        it = self._curve(batch_size).iteration
        return [b - a for a, b in zip((0,) + it[:-1], it)]

    def progress_per_step(self, batch_size: int, epoch: int) -> float:
        """Progress one step adds during ``epoch`` (0-based; see the module docstring)."""
        curve = self._curve(batch_size)
        if not 0 <= epoch < self.epoch_cap:
            raise ValueError(f"{self.name}: epoch {epoch} outside 0..{self.epoch_cap - 1}")
        prev_progress = curve.progress[epoch - 1] if epoch else 0.0
        prev_iteration = curve.iteration[epoch - 1] if epoch else 0
        steps = curve.iteration[epoch] - prev_iteration
        return (curve.progress[epoch] - prev_progress) / steps if steps else 0.0

    def total_steps(self, batch_size: int) -> int:
        """Optimizer steps to the epoch cap."""
        return self._curve(batch_size).iteration[-1]

    def total_progress(self, batch_size: int) -> float:
        return self._curve(batch_size).progress[-1]

    def loss_curve(self, batch_size: int) -> list[tuple[float, float]]:
        """(step, decreasing value) after each epoch (table in the module docstring)."""
        curve = self._curve(batch_size)
        to_loss = METRIC_TO_LOSS.get(self.name)
        if to_loss is None:
            raise ValueError(f"no metric rule for application {self.name!r}")
        return [(float(k), float(to_loss(m))) for k, m in zip(curve.iteration, curve.metric)]


_VALIDATION = re.compile(r"validation-(\d+)\.csv$")


def load_application(path: str | Path, costs: PushPullCosts | None = None,
                     model_bytes: int | None = None) -> Application:
    """One ``traces/<app>/`` folder. ``costs``/``model_bytes`` default to the shipped push/pull
    costs and the app's model size (None where the model is unknown)."""
    path = Path(path)
    name = path.name
    rows: list[tuple[int, int, float, float, float]] = []
    for placement, local, step, sync in _read_csv(path / "placements.csv",
                                                   ("placement", "local_bsz", "step_time", "sync_time")):
        digits = str(int(placement))
        rows.append((len(digits), sum(int(d) for d in digits), local, step, sync))
    scalability = path / "scalability.csv"
    if scalability.exists():
        for nodes, gpus, local, step, sync in _read_csv(
                scalability, ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time")):
            rows.append((int(nodes), int(gpus), local, step, sync))
    validation = {}
    for file in sorted(path.glob("validation-*.csv")):
        match = _VALIDATION.search(file.name)
        if not match:
            continue
        batch = int(match.group(1))
        table = _read_csv(file, ("progress", "iteration", "metric"))
        validation[batch] = ValidationCurve(batch, tuple(r[0] for r in table),
                                            tuple(int(r[1]) for r in table), tuple(r[2] for r in table))
    if not validation:
        raise ValueError(f"{path}: no validation-<batch>.csv files")
    step_times = StepTimes(rows)
    if model_bytes is None:
        try:
            model_bytes = app_model_bytes(name)
        except KeyError:
            model_bytes = None
    return Application(name=name, step_times=step_times, validation=validation,
                       max_local_bsz=float(LOCAL_BSZ_CAP.get(name, step_times.max_local_bsz)),
                       model_bytes=model_bytes, costs=costs if costs is not None else default_costs())


def load_applications(root: str | Path | None = None,
                      costs: PushPullCosts | None = None) -> dict[str, Application]:
    """Every application folder (one with a placements.csv) under ``root``."""
    root = Path(root or os.environ.get(TRACES_ENV) or DEFAULT_TRACES)
    apps = {d.name: load_application(d, costs=costs)
            for d in sorted(root.iterdir()) if (d / "placements.csv").exists()}
    if not apps:
        raise ValueError(f"{root}: no application folders (with placements.csv)")
    return apps
