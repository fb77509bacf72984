"""Smoke test of bench/autops_torch_step.py (``dlrt_bench.torch_step``) in a tiny configuration.

Real pMaster, aggregator and worker processes on loopback; a 2-layer Linear(32, 32) model and
a few steps, so it checks the JSON's structure and that every figure is a positive finite
number, never the speed. Four variants (eight worker processes, each importing torch) keep it
well under 30 s on a loaded 2-core machine; the ratio logic of every variant is checked on
made-up times without processes.
"""
from __future__ import annotations

import json
import math

import pytest

from dlrt_bench.torch_step import PEER, VARIANTS, Measured, main, summarize, table

pytestmark = pytest.mark.timeout(120)

ROW_KEYS = {"model", "width", "layers", "tensors", "params", "workers", "aggregators", "batch_per_worker", "steps",
            "warmup", "rounds", "threads_per_worker", "autops_small_round_trip_ms", "gloo_small_allreduce_ms",
            "variant", "system", "median_ms", "p90_ms", "mean_ms", "steps_per_s", "cpu_ms_per_step", "ratio_to_ddp",
            "ratio_to_sum", "peer", "ratio_to_peer", "final_loss", "steps_ms"}
FIGURES = ("median_ms", "p90_ms", "mean_ms", "steps_per_s", "cpu_ms_per_step")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_reports_every_variant(tmp_path):
    out = tmp_path / "step.json"
    variants = ["sum", "server-averaged", "sum-accumulate", "ddp"]
    rc = main(["--model", "mlp", "--width", "32", "--layers", "2", "--batch", "8", "--steps", "4", "--warmup", "1",
               "--rounds", "2", "--probes", "3", "--timeout", "60", "--variants", *variants, "--json", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == variants
    for row in rows:
        assert set(row) == ROW_KEYS, set(row) ^ ROW_KEYS
        assert row["model"] == "mlp" and row["workers"] == 2 and row["tensors"] == 4 and row["params"] == 2 * 33 * 32
        assert row["system"] == VARIANTS[row["variant"]][0]
        for key in FIGURES:
            assert positive(row[key]), (row["variant"], key, row[key])
        assert row["p90_ms"] >= row["median_ms"]
        assert len(row["steps_ms"]) == 4 and all(positive(t) for t in row["steps_ms"])
        assert math.isfinite(row["final_loss"])
        assert positive(row["autops_small_round_trip_ms"]) and positive(row["gloo_small_allreduce_ms"])
        assert positive(row["ratio_to_ddp"])
        if row["system"] == "autops":
            assert positive(row["ratio_to_sum"])
            assert row["peer"] == PEER[row["variant"]]
            # the peer was measured only for sum (ddp) in this run
            assert positive(row["ratio_to_peer"]) if row["peer"] == "ddp" else row["ratio_to_peer"] is None
        else:
            assert row["ratio_to_sum"] is None and row["peer"] is None and row["ratio_to_peer"] is None
    by = {r["variant"]: r for r in rows}
    assert by["ddp"]["ratio_to_ddp"] == 1.0 and by["sum"]["ratio_to_sum"] == 1.0


def test_ratios_of_every_variant_on_made_up_times():
    measured = {}
    for i, variant in enumerate(VARIANTS, start=1):
        m = Measured()
        m.add([{"times": [i * 0.001] * 3, "wall": i * 0.003, "cpu": 0.001, "loss": 1.0}], 0.0)
        measured[variant] = m
    base = {"model": "mlp", "width": 4, "layers": 1, "tensors": 2, "params": 20, "workers": 1, "aggregators": 1,
            "batch_per_worker": 2, "steps": 3, "warmup": 0, "rounds": 1,
            "autops_small_round_trip_ms": None, "gloo_small_allreduce_ms": None}
    rows = {r["variant"]: r for r in summarize(base, measured)}
    median = {v: (i + 1) * 0.001 for i, v in enumerate(VARIANTS)}
    for variant, row in rows.items():
        assert row["median_ms"] == pytest.approx(median[variant] * 1e3)
        assert row["steps_per_s"] == pytest.approx(1 / median[variant])
        assert row["ratio_to_ddp"] == pytest.approx(median[variant] / median["ddp"])
        if variant in PEER:
            assert row["ratio_to_sum"] == pytest.approx(median[variant] / median["sum"])
            assert row["ratio_to_peer"] == pytest.approx(median[variant] / median[PEER[variant]])
    text = table(list(rows.values()))
    assert all(v in text for v in VARIANTS)
