"""Cluster-scale simulation of placement and eviction at small scale (fast)."""
import json
import math
import random

import numpy as np
import pytest

from infiniswap import eviction, simulate


@pytest.fixture(scope="module")
def studies():
    return [simulate.placement_study(200, seed) for seed in (0, 1, 2)]


def test_cluster_is_seeded_and_documented():
    a = simulate.make_cluster(200, 3)
    b = simulate.make_cluster(200, 3)
    assert np.array_equal(a.local, b.local) and np.array_equal(a.demand, b.demand)
    assert a.params["usage_sigma"] == pytest.approx(math.log(3.35) / 2.3263, rel=1e-3)
    big = simulate.make_cluster(20000, 0)
    frac = big.local / big.capacity
    assert np.median(frac) == pytest.approx(0.35, rel=0.05)
    assert np.mean(frac) == pytest.approx(0.40, abs=0.02)          # §2.7.5: 40.8% before Infiniswap
    assert (big.demand > 0).mean() == pytest.approx(0.5, abs=0.02)


def test_power_of_two_less_imbalanced_than_random(studies):
    for st in studies:
        s = st["strategies"]
        for two in ("power_of_two", "power_of_two_split"):
            assert s[two]["max_over_min"] <= s["random"]["max_over_min"]
            assert s[two]["cv"] < s["random"]["cv"]
            assert s[two]["p90_over_p10"] < s["random"]["p90_over_p10"]
            # max is pinned by machines whose local use alone fills them; no strategy moves it much
            assert s[two]["max_over_median"] <= s["random"]["max_over_median"] * 1.05
        assert st["before"]["max_over_min"] > s["random"]["max_over_min"]


def test_m_new_before_m_old_spreads_slabs(studies):
    for st in studies:
        s = st["strategies"]
        split = s["power_of_two_split"]
        for other in ("random", "power_of_two"):
            assert split["mean_machines_per_device"] > s[other]["mean_machines_per_device"]
            assert split["mean_max_slabs_on_one_machine"] < s[other]["mean_max_slabs_on_one_machine"]
            assert split["devices_fully_spread"] > s[other]["devices_fully_spread"]


def test_every_strategy_places_the_same_demand(studies):
    for st in studies:
        means = {name: s["mean"] for name, s in st["strategies"].items()}
        assert all(s["unplaced"] == 0 for s in st["strategies"].values())
        assert max(means.values()) - min(means.values()) < 1e-3
        assert st["before"]["mean"] < min(means.values())


def test_placement_respects_headroom_and_never_self():
    cluster = simulate.make_cluster(100, 4)
    for name in simulate.STRATEGIES:
        res = simulate.place_slabs(cluster, name, random.Random(0))
        spare = np.floor(np.maximum(0, cluster.capacity - cluster.local - cluster.headroom))
        assert (res["hosted"] <= spare).all()
        for dev, where in res["where"].items():
            assert dev not in where
            assert sum(where.values()) <= cluster.demand[dev]
        assert res["hosted"].sum() + res["unplaced"] == cluster.demand.sum()
    with pytest.raises(ValueError):
        simulate.place_slabs(cluster, "best", random.Random(0))


def test_eviction_monte_carlo_agrees_with_formulas():
    ev = simulate.eviction_study(p_bs=(0.2, 0.5, 0.8), E=10, E_primes=(0, 5, 10), trials=1500, seed=1)
    assert ev["all_agree"]
    for row in ev["rows"]:
        assert row["random"]["formula"] == pytest.approx(eviction.p_lightly_random(row["p_b"], 10), abs=1e-6)
        assert row["batch_5"]["formula"] == pytest.approx(eviction.p_lightly_batch(row["p_b"], 10, 5), abs=1e-6)
        se = math.sqrt(row["batch_10"]["formula"] * (1 - row["batch_10"]["formula"]) / 1500)
        assert abs(row["batch_10"]["monte_carlo"] - row["batch_10"]["formula"]) <= 4 * se + 1 / 1500
    mid = ev["rows"][1]
    assert mid["batch_10"]["monte_carlo"] > mid["batch_5"]["monte_carlo"] > mid["random"]["monte_carlo"]


def test_run_is_json_and_reports():
    res = simulate.run(machines=120, seed=2, trials=200, p_bs=(0.3,), E_primes=(0, 10))
    again = json.loads(json.dumps(res))
    assert again == res
    text = simulate.format_report(res)
    for word in ("random", "power_of_two", "power_of_two_split", "no remote memory", "E'=10", "0.30"):
        assert word in text
    assert res == simulate.run(machines=120, seed=2, trials=200, p_bs=(0.3,), E_primes=(0, 10))


def test_main_prints(capsys):
    assert simulate.main(["--machines", "60", "--trials", "50", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["machines"] == 60
