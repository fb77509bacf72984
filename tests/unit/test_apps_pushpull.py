"""tiresias.apps.pushpull: the push/pull cost model, its fit, model sizes, Application.speed."""
from __future__ import annotations

import json

import pytest

from tiresias.apps.profiles import DEFAULT_TRACES, load_applications
from tiresias.apps.pushpull import (DEFAULT_COSTS_PATH, PushPullCosts, costs_from_pushpull_results,
                                    fit_pushpull_costs, load_costs, model_bytes, pushpull_time, save_costs)

COSTS = PushPullCosts(per_byte_s=1e-9, per_key_s=1e-3, per_worker_s=2e-3)


def test_more_aggregators_less_time_more_workers_more():
    times_p = [pushpull_time(100_000_000, 8, p, COSTS) for p in (1, 2, 4, 8)]
    assert times_p == sorted(times_p, reverse=True)
    times_w = [pushpull_time(100_000_000, w, 2, COSTS) for w in (1, 2, 4, 8)]
    assert times_w == sorted(times_w)
    # each aggregator moves 2*w*S/p bytes
    assert pushpull_time(10**6, 4, 2, COSTS) == pytest.approx(1e-9 * 4e6 + 2e-3 * 4 + 1e-3 * 2)
    with pytest.raises(ValueError):
        pushpull_time(10, 0, 1, COSTS)


def test_costs_json_round_trip(tmp_path):
    path = tmp_path / "costs.json"
    save_costs(COSTS, path, sources=["x.json"])
    assert load_costs(path) == COSTS
    assert json.loads(path.read_text())["sources"] == ["x.json"]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a push/pull costs file"):
        load_costs(tmp_path / "bad.json")


def test_shipped_costs_are_positive():
    costs = load_costs(DEFAULT_COSTS_PATH)
    assert costs.per_byte_s > 0 and costs.per_key_s >= 0 and costs.per_worker_s >= 0


def test_fit_recovers_known_costs(tmp_path):
    rows = [{"transport": "tcp", "mode": "sum", "workers": w, "aggregators": p, "model_bytes": s,
             "autops_s": pushpull_time(s, w, p, COSTS)}
            for w in (2, 4) for p in (1, 2, 4) for s in (10**7, 10**8)]
    rows.append({"transport": "ipc", "workers": 2, "aggregators": 2, "model_bytes": 1, "autops_s": 9.0})
    costs, fit = fit_pushpull_costs(rows)
    assert fit["rows"] == 12
    assert costs.per_byte_s == pytest.approx(COSTS.per_byte_s, rel=1e-6)
    assert costs.per_worker_s == pytest.approx(COSTS.per_worker_s, rel=1e-6)
    path = tmp_path / "results.json"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert costs_from_pushpull_results(path).per_key_s == pytest.approx(COSTS.per_key_s, rel=1e-6)
    with pytest.raises(ValueError, match="at least 3"):
        fit_pushpull_costs(rows[-1:])


def test_model_bytes():
    assert model_bytes("imagenet") == 4 * 25_557_032       # ResNet-50 from tensor_shapes.json
    assert 100e6 < model_bytes("bert") / 4 < 120e6          # BERT-base, ~110M parameters
    assert model_bytes("cifar10") == 4 * 11_173_962
    with pytest.raises(KeyError):
        model_bytes("nope")


@pytest.mark.skipif(not DEFAULT_TRACES.is_dir(), reason="Pollux traces not present")
def test_application_speed_modes():
    app = load_applications(costs=COSTS)["imagenet"]
    assert app.speed(3, 8, 1600, sync="measured") == pytest.approx(1 / app.step_time(8, 1600))
    expected = 1 / (app.compute_time(8, 1600) + pushpull_time(app.model_bytes, 8, 3, COSTS))
    assert app.speed(3, 8, 1600) == pytest.approx(expected)
    assert app.speed(4, 8, 1600) > app.speed(1, 8, 1600)
    with pytest.raises(ValueError, match="sync must be"):
        app.speed(1, 1, 1600, sync="allreduce")
