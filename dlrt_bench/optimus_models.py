"""How well Optimus' two models fit the Pollux applications (paper §3, Fig. 8 and Fig. 6).

``speed_fit_error``: per application, at the batch size the Pollux workloads ask for most, the
true speed ``f(p, w) = Application.speed(p, w, B, sync="pushpull")`` over every feasible
``(p <= 16, w <= max_gpus(B))``; ``--samples`` random configurations per draw (``--draws``
seeded draws) are fitted with ``tiresias.optimus.speed.fit_speed(samples, sync=True, batch=B)``
and the relative error ``|f_hat - f| / f`` is taken over the configurations not sampled. The
median is pooled over applications and draws (the paper: under 10% with 10 samples).

``convergence_error_half``: per application and batch size with at least three validation
points before half its epoch cap, ``tiresias.optimus.convergence.fit_convergence`` on those
points only (``Application.loss_curve``, one per epoch) predicts the step where the job has
converged (delta = 5%); the truth is the first measured point within 5% of (first value - best
value) of the best. Relative error ``|predicted - true| / true``; median over the curves (bert
has two validation points: reported apart). Three predictions per curve, all from the half:

- ``limit``: ``converged_step(delta)``, the issue's definition (improvement to the limit beta2);
- ``limit_capped``: the same stopped at the epoch cap, as ``remaining_steps(k, delta, cap)``;
- ``cap``: ``converged_step(delta, target="cap", cap_step=cap)``, improvement to the fitted loss
  at the epoch cap. This is the headline ``median_rel_error`` (``HEADLINE_TARGET``).

The method was chosen on cifar10 and ncf (``TUNING_APPS``), and every application is reported.

    python bench/optimus_models.py --json bench/results/optimus_models.json
"""
from __future__ import annotations

import argparse
import json
import os
import math
import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from tiresias.apps import Application, load_applications, load_workload
from tiresias.apps.profiles import DEFAULT_TRACES
from tiresias.apps.pushpull import DEFAULT_COSTS_PATH, load_costs
from tiresias.optimus.convergence import TARGET_CAP, TARGET_LIMIT, ConvergenceFit, fit_convergence
from tiresias.optimus.speed import fit_speed

DEFAULT_WORKLOADS = DEFAULT_TRACES.parent / "workloads"
MAX_AGGREGATORS = 16
DELTA = 0.05
PREDICTIONS = ("limit", "limit_capped", "cap")    # see the module docstring
HEADLINE_TARGET = "cap"
TUNING_APPS = ("cifar10", "ncf")                 # the split the convergence method was chosen on


def workload_batch_sizes(workloads: Path) -> dict[str, int]:
    """The batch size each application's jobs ask for most across the workload files."""
    asked: dict[str, Counter] = {}
    for path in sorted(workloads.glob("workload-*.csv")):
        for job in load_workload(path):
            asked.setdefault(job.application, Counter())[job.batch_size] += 1
    return {app: counts.most_common(1)[0][0] for app, counts in asked.items()}


def speed_grid(app: Application, batch: int) -> dict[tuple[int, int], float]:
    """True pushpull speed at every feasible (p, w)."""
    return {(p, w): app.speed(p, w, batch, sync="pushpull")
            for p in range(1, MAX_AGGREGATORS + 1) for w in range(1, app.max_gpus(batch) + 1)}


def speed_fit_errors(grid: dict[tuple[int, int], float], batch: int, samples: int,
                     seed: int) -> list[float]:
    """Relative errors over the unsampled configurations after fitting ``samples`` random ones."""
    configs = sorted(grid)
    chosen = set(random.Random(seed).sample(configs, samples))
    model = fit_speed([(p, w, grid[(p, w)]) for p, w in sorted(chosen)], sync=True, batch=batch)
    return [abs(model.speed(p, w) - grid[(p, w)]) / grid[(p, w)] for p, w in configs if (p, w) not in chosen]


def speed_fit_error(apps: dict[str, Application], batches: dict[str, int], samples: int,
                    draws: int) -> dict[str, Any]:
    pooled: list[float] = []
    per_app = {}
    for name, app in apps.items():
        batch = batches.get(name, app.batch_sizes[len(app.batch_sizes) // 2])
        grid = speed_grid(app, batch)
        errors = [e for seed in range(draws) for e in speed_fit_errors(grid, batch, samples, seed)]
        pooled.extend(errors)
        per_app[name] = {"batch_size": batch, "configurations": len(grid),
                         "median_rel_error": statistics.median(errors),
                         "p90_rel_error": sorted(errors)[int(0.9 * (len(errors) - 1))]}
    return {"samples": samples, "draws": draws, "max_aggregators": MAX_AGGREGATORS,
            "median_rel_error": statistics.median(pooled), "per_app": per_app}


def true_converged_step(curve: list[tuple[float, float]], delta: float) -> float:
    """First measured step within ``delta`` of the total improvement (first value -> best)."""
    first, best = curve[0][1], min(v for _, v in curve)
    threshold = best + delta * (first - best)
    return next(k for k, v in curve if v <= threshold)


def predicted_steps(fit: ConvergenceFit | None, delta: float, cap_step: float) -> dict[str, float]:
    """The converged step each of ``PREDICTIONS`` gives (inf without a fit)."""
    if fit is None:
        return {name: math.inf for name in PREDICTIONS}
    limit = fit.converged_step(delta, target=TARGET_LIMIT)
    return {"limit": limit, "limit_capped": min(limit, cap_step),
            "cap": fit.converged_step(delta, target=TARGET_CAP, cap_step=cap_step)}


def convergence_rows(apps: dict[str, Application], delta: float) -> tuple[list[dict], list[dict]]:
    """(fitted rows, curves too short to fit) for every application and batch size."""
    rows, short = [], []
    for name, app in apps.items():
        half = app.epoch_cap // 2
        for batch in app.batch_sizes:
            curve = app.loss_curve(batch)
            head = curve[:half]
            if len(head) < 3:
                short.append({"app": name, "batch_size": batch, "points": len(curve), "half_points": len(head)})
                continue
            truth = true_converged_step(curve, delta)
            cap_step = float(app.total_steps(batch))
            fit = fit_convergence(head)
            predicted = predicted_steps(fit, delta, cap_step)
            errors = {key: _rel(step, truth) for key, step in predicted.items()}
            # diagnostic: the fitted curve's step at the measured threshold (knows the best value)
            first, best = curve[0][1], min(v for _, v in curve)
            at_threshold = fit.step_at_loss((best + delta * (first - best)) / fit.scale) if fit is not None else math.inf
            rows.append({"app": name, "batch_size": batch, "fit_points": len(head), "cap_step": cap_step,
                         "true_step": truth, "predicted_step": predicted[HEADLINE_TARGET],
                         "rel_error": errors[HEADLINE_TARGET], "predicted": predicted, "rel_errors": errors,
                         "beta2": fit.beta2 * fit.scale if fit is not None else None,
                         "half_min": min(v for _, v in head), "best": best,
                         "fit_step_at_true_threshold": at_threshold,
                         "rel_error_at_true_threshold": _rel(at_threshold, truth)})
    return rows, short


def _rel(predicted: float, truth: float) -> float:
    return abs(predicted - truth) / truth if math.isfinite(predicted) else math.inf


def _medians(rows: list[dict], key: str) -> dict[str, Any]:
    apps = dict.fromkeys(r["app"] for r in rows)
    return {"median_rel_error": statistics.median(r["rel_errors"][key] for r in rows),
            "tuning_median_rel_error": statistics.median(
                r["rel_errors"][key] for r in rows if r["app"] in TUNING_APPS),
            "per_app_median": {name: statistics.median(r["rel_errors"][key] for r in rows if r["app"] == name)
                               for name in apps}}


def convergence_error_half(apps: dict[str, Application], delta: float = DELTA) -> dict[str, Any]:
    rows, short = convergence_rows(apps, delta)
    by_prediction = {key: _medians(rows, key) for key in PREDICTIONS}
    headline = by_prediction[HEADLINE_TARGET]
    return {"delta": delta, "target": HEADLINE_TARGET, "tuning_apps": list(TUNING_APPS),
            "median_rel_error": headline["median_rel_error"],
            "median_rel_error_at_true_threshold": statistics.median(r["rel_error_at_true_threshold"] for r in rows),
            "per_app_median": headline["per_app_median"], "by_prediction": by_prediction,
            "rows": rows, "not_fitted": short}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def print_tables(speed: dict[str, Any], convergence: dict[str, Any]) -> None:
    print(f"speed fit (eq. 4, {speed['samples']} samples x {speed['draws']} draws, p <= {MAX_AGGREGATORS}):"
          f" pooled median relative error {speed['median_rel_error']:.1%}")
    print(f"  {'app':12} {'batch':>6} {'configs':>7} {'median':>8} {'p90':>8}")
    for name, r in speed["per_app"].items():
        print(f"  {name:12} {r['batch_size']:6d} {r['configurations']:7d} "
              f"{r['median_rel_error']:8.1%} {r['p90_rel_error']:8.1%}")
    print_convergence(convergence)


def print_convergence(convergence: dict[str, Any]) -> None:
    by = convergence["by_prediction"]
    print(f"convergence (eq. 1 on the first half of the epochs, delta {convergence['delta']:.0%}): median relative"
          f" error {convergence['median_rel_error']:.1%} (target {convergence['target']!r}; chosen on"
          f" {', '.join(convergence['tuning_apps'])})")
    for key in PREDICTIONS:
        per_app = " ".join(f"{name} {err:.0%}" for name, err in by[key]["per_app_median"].items())
        print(f"  {key:13} median {by[key]['median_rel_error']:7.1%}"
              f" (tuning apps {by[key]['tuning_median_rel_error']:.1%}): {per_app}")
    print(f"  diagnostic, fit read at the measured threshold: {convergence['median_rel_error_at_true_threshold']:.1%}")
    print(f"  {'app':12} {'batch':>6} {'points':>6} {'cap step':>9} {'true step':>10} {'limit':>10} {'error':>8}"
          f" {'capped':>8} {'cap tgt':>10} {'error':>8}")
    for r in convergence["rows"]:
        pred, err = r["predicted"], r["rel_errors"]
        print(f"  {r['app']:12} {r['batch_size']:6d} {r['fit_points']:6d} {r['cap_step']:9.0f} {r['true_step']:10.0f}"
              f" {pred['limit']:10.0f} {err['limit']:8.1%} {err['limit_capped']:8.1%}"
              f" {pred['cap']:10.0f} {err['cap']:8.1%}")
    for r in convergence["not_fitted"]:
        print(f"  {r['app']:12} {r['batch_size']:6d}  not fitted: {r['half_points']} point(s) before half "
              f"of {r['points']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/optimus_models.py", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default=str(DEFAULT_TRACES), help="Pollux traces/ folder")
    parser.add_argument("--workloads", default=str(DEFAULT_WORKLOADS), help="Pollux workloads/ folder")
    parser.add_argument("--costs", default=str(DEFAULT_COSTS_PATH), help="push/pull costs JSON")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    args = parser.parse_args(argv)
    apps = load_applications(args.traces, costs=load_costs(args.costs))
    speed = speed_fit_error(apps, workload_batch_sizes(Path(args.workloads)), args.samples, args.draws)
    convergence = convergence_error_half(apps)
    print_tables(speed, convergence)
    if args.json:
        result = {"speed_fit_error": speed["median_rel_error"],
                  "convergence_error_half": convergence["median_rel_error"],
                  "speed_fit": speed, "convergence_fit": convergence,
                  "costs": os.path.relpath(args.costs), "traces": os.path.relpath(args.traces)}
        Path(args.json).write_text(json.dumps(_json_safe(result), indent=1) + "\n")
    return 0
