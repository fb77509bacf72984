"""The aggregator (parameter-server) dimension of a job: push+pull time per synchronous step.

Cost model (the shape of Optimus eq. (2)): ``w`` workers each push ``S`` gradient bytes and
pull ``S`` parameter bytes per step; ``p`` aggregators hold ``1/p`` of the keys each, so each
aggregator receives ``w*S/p`` and sends ``w*S/p`` bytes. The step's push+pull time is

    pushpull_time = per_byte_s * 2*w*S/p + per_worker_s * w + per_key_s * p

``per_byte_s`` is the aggregator-side cost of one byte (Optimus' ``w'/B``); ``per_worker_s``
the fixed cost of one worker's messages at an aggregator (``delta * w``); ``per_key_s`` the
fixed cost of one worker exchanging its key range with one more aggregator (``delta' * p``).

Default costs (``pushpull_costs.json`` next to this file) come from AutoPS's own measurements,
``bench/results/autops_pushpull*.json``: every row with ``transport == "tcp"``, mode ``sum``,
without CURVE, on one host (its ``autops_s`` is the median seconds per iteration of ``workers``
workers pushing and pulling a model of ``model_bytes`` through ``aggregators`` aggregators).
``fit_pushpull_costs`` solves ``autops_s ~ [2*w*S/p, w, p] . (per_byte, per_worker, per_key)``
with ``scipy.optimize.nnls``; all those rows have p = 2, so the last two columns together are
"a constant plus a slope in w" (W = 2 and 4). To re-measure on other hardware::

    autops bench pushpull --transport tcp --workers 2 4 --json new.json
    python -m tiresias.apps.pushpull fit new.json --out tiresias/apps/pushpull_costs.json

Model sizes (``model_bytes``): fp32 parameters. resnet50 (imagenet) and bert-base (bert) are
summed from ``../shared/data/models/tensor_shapes.json`` (``$AUTOPS_TENSOR_SHAPES`` overrides).
The others, as trained by the Pollux artifact (petuum/adaptdl ``osdi21-artifact``,
``benchmark/models/<app>``):

| app | model | parameters | source |
|---|---|---|---|
| cifar10 | ResNet-18 (CIFAR variant) | 11,173,962 | kuangliu/pytorch-cifar ResNet18 (the artifact's ``--model=ResNet18``), published count |
| yolov3 | YOLOv3, 20 VOC classes | 61,626,049 | 61,949,149 for 80 classes (ultralytics/yolov3 README) minus 3 heads x 180 channels x (1024+512+256 inputs + bias) |
| deepspeech2 | DeepSpeech2, 5 bi-GRU x 800 | 41,187,968 | counted from the artifact's ``model.py``/``train.py`` defaults (2 convs, 1,312 RNN inputs, 29 labels) |
| ncf | NeuMF-end, 32 factors, 3 MLP layers | 1,602,657 | counted from the artifact's ``model.py`` on ml-1m (6,040 users, 3,706 items) |
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

__all__ = ["PushPullCosts", "pushpull_time", "load_costs", "save_costs", "default_costs",
           "fit_pushpull_costs", "costs_from_pushpull_results", "model_bytes", "DEFAULT_COSTS_PATH"]

DEFAULT_COSTS_PATH = Path(__file__).resolve().parent / "pushpull_costs.json"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
TENSOR_SHAPES_ENV = "AUTOPS_TENSOR_SHAPES"
DEFAULT_TENSOR_SHAPES = PROJECT_ROOT.parent / "shared" / "data" / "models" / "tensor_shapes.json"
FP32_BYTES = 4
MODEL_FORMULA = "pushpull_time = per_byte_s*2*w*S/p + per_worker_s*w + per_key_s*p"

# Pollux application -> entry in tensor_shapes.json, or a published parameter count (see table).
SHAPES_MODEL = {"imagenet": "resnet50", "bert": "bert-base"}
PUBLISHED_PARAMS = {"cifar10": 11_173_962, "yolov3": 61_626_049,
                    "deepspeech2": 41_187_968, "ncf": 1_602_657}


@dataclass(frozen=True)
class PushPullCosts:
    """Seconds per byte through one aggregator, per extra aggregator, per worker."""
    per_byte_s: float
    per_key_s: float
    per_worker_s: float


def pushpull_time(model_bytes: int, workers: int, aggregators: int, costs: PushPullCosts) -> float:
    """Seconds of one synchronous step's push+pull (see the module docstring)."""
    if workers < 1 or aggregators < 1:
        raise ValueError(f"workers and aggregators must be >= 1 (got {workers}, {aggregators})")
    if model_bytes < 0:
        raise ValueError(f"model_bytes must be >= 0 (got {model_bytes})")
    per_aggregator_bytes = 2.0 * workers * model_bytes / aggregators
    return (costs.per_byte_s * per_aggregator_bytes + costs.per_worker_s * workers
            + costs.per_key_s * aggregators)


def load_costs(path: str | Path = DEFAULT_COSTS_PATH) -> PushPullCosts:
    """Read a costs JSON (an object with per_byte_s, per_key_s, per_worker_s; other keys ignored)."""
    data = json.loads(Path(path).read_text())
    try:
        return PushPullCosts(float(data["per_byte_s"]), float(data["per_key_s"]),
                             float(data["per_worker_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a push/pull costs file ({exc})") from None


def save_costs(costs: PushPullCosts, path: str | Path, **provenance: Any) -> None:
    """Write ``costs`` as JSON, with ``provenance`` (sources, fit) next to the three numbers."""
    Path(path).write_text(json.dumps({**asdict(costs), **provenance}, indent=2) + "\n")


@lru_cache(maxsize=1)
def default_costs() -> PushPullCosts:
    """The shipped costs (``pushpull_costs.json``)."""
    return load_costs(DEFAULT_COSTS_PATH)


def _usable(row: Mapping[str, Any], transport: str) -> bool:
    return (row.get("transport") == transport and row.get("mode", "sum") == "sum"
            and not row.get("curve") and row.get("site") in (None, "local")
            and all(k in row for k in ("workers", "aggregators", "model_bytes", "autops_s")))


def fit_pushpull_costs(rows: Iterable[Mapping[str, Any]],
                       transport: str = "tcp") -> tuple[PushPullCosts, dict[str, Any]]:
    """NNLS fit of the cost model to ``autops bench pushpull`` rows; returns the costs and a
    summary of the fit (rows used, residual, relative errors)."""
    used = [r for r in rows if _usable(r, transport)]
    if len(used) < 3:
        raise ValueError(f"need at least 3 {transport} push/pull rows to fit, got {len(used)}")
    design = np.array([[2.0 * r["workers"] * r["model_bytes"] / r["aggregators"],
                        float(r["workers"]), float(r["aggregators"])] for r in used])
    seconds = np.array([float(r["autops_s"]) for r in used])
    (per_byte, per_worker, per_key), residual = nnls(design, seconds)
    predicted = design @ np.array([per_byte, per_worker, per_key])
    rel = np.abs(predicted - seconds) / seconds
    fit = {"rows": len(used), "transport": transport,
           "columns": ["2*workers*model_bytes/aggregators", "workers", "aggregators"],
           "residual_norm_s": float(residual), "median_rel_error": float(np.median(rel)),
           "max_rel_error": float(rel.max())}
    return PushPullCosts(float(per_byte), float(per_key), float(per_worker)), fit


def _read_rows(path: str | Path) -> list[dict[str, Any]]:
    text = Path(path).read_text().strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def costs_from_pushpull_results(results_json: str | Path | Sequence[str | Path],
                                transport: str = "tcp") -> PushPullCosts:
    """Costs fitted to one or more ``autops bench pushpull --json`` files (JSON lines or list)."""
    paths = [results_json] if isinstance(results_json, (str, Path)) else list(results_json)
    rows = [row for path in paths for row in _read_rows(path)]
    return fit_pushpull_costs(rows, transport)[0]


@lru_cache(maxsize=None)
def _shapes_params(model: str, shapes_path: str) -> int:
    tensors = json.loads(Path(shapes_path).read_text())[model]["tensors"]
    return int(sum(np.prod(shape, dtype=np.int64) for _, shape in tensors))


def model_bytes(application: str | Any, tensor_shapes: str | Path | None = None) -> int:
    """fp32 parameter bytes of a Pollux application's model (a name or an object with .name)."""
    name = application if isinstance(application, str) else application.name
    if name in SHAPES_MODEL:
        path = tensor_shapes or os.environ.get(TENSOR_SHAPES_ENV) or DEFAULT_TENSOR_SHAPES
        return FP32_BYTES * _shapes_params(SHAPES_MODEL[name], str(path))
    if name in PUBLISHED_PARAMS:
        return FP32_BYTES * PUBLISHED_PARAMS[name]
    raise KeyError(f"no model size for application {name!r}; known: "
                   f"{sorted(SHAPES_MODEL) + sorted(PUBLISHED_PARAMS)}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiresias.apps.pushpull fit RESULTS.json ... [--out FILE]``."""
    parser = argparse.ArgumentParser(prog="python -m tiresias.apps.pushpull",
                                     description="Fit push/pull costs to autops bench pushpull results")
    sub = parser.add_subparsers(dest="command", required=True)
    fit_cmd = sub.add_parser("fit", help="fit costs to result files and write the costs JSON")
    fit_cmd.add_argument("results", nargs="+", help="autops bench pushpull --json files")
    fit_cmd.add_argument("--transport", default="tcp")
    fit_cmd.add_argument("--out", default="-", help="costs JSON to write (- prints it)")
    args = parser.parse_args(argv)
    per_file = {path: _read_rows(path) for path in args.results}
    costs, fit = fit_pushpull_costs([r for rows in per_file.values() for r in rows], args.transport)
    sources = [os.path.relpath(Path(path).resolve(), PROJECT_ROOT) for path, rows in per_file.items()
               if any(_usable(r, args.transport) for r in rows)]
    provenance = {"model": MODEL_FORMULA, "sources": sources, "fit": fit}
    if args.out == "-":
        json.dump({**asdict(costs), **provenance}, sys.stdout, indent=2)
        print()
    else:
        save_costs(costs, args.out, **provenance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
