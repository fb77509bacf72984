"""Optimus' speed models (tiresias/optimus/speed.py): eq. (3)/(4), their NNLS fit, the profile configs."""
import math

import numpy as np
import pytest

from tiresias.optimus.speed import SpeedModel, fit_speed, profile_configs

SYNC = SpeedModel(True, (0.01, 0.3, 0.4, 0.02, 0.05), batch=128)       # a ResNet-like sync job
ASYNC = SpeedModel(False, (2.83, 3.92, 0.0, 0.11), batch=None)           # the paper's Table 2 async


def test_speed_is_the_closed_form_of_eq4_and_eq3():
    p, w = 2, 4
    assert SYNC.speed(p, w) == pytest.approx(1 / (0.01 * 128 / 4 + 0.3 + 0.4 * 4 / 2 + 0.02 * 4 + 0.05 * 2))
    assert ASYNC.speed(p, w) == pytest.approx(4 / (2.83 + 3.92 * 4 / 2 + 0.0 * 4 + 0.11 * 2))
    for model in (SYNC, ASYNC):
        assert model.step_time(p, w) == pytest.approx(1 / model.speed(p, w))
        assert model.speed(0, 3) == 0.0 and model.speed(3, 0) == 0.0
        assert model.step_time(0, 3) == math.inf


def test_sync_speed_has_diminishing_returns_and_turns_down():
    speeds = [SYNC.speed(w, w) for w in range(1, 30)]
    gains = np.diff(speeds)
    assert gains[0] > 0 and gains[0] > gains[3]
    assert min(gains) < 0                   # more workers eventually slow a sync job down


@pytest.mark.parametrize("model", [SYNC, ASYNC], ids=["sync", "async"])
def test_fit_recovers_known_coefficients_exactly(model):
    configs = profile_configs(12, 12, count=10, seed=3)
    fit = fit_speed([(p, w, model.speed(p, w)) for p, w in configs], sync=model.sync, batch=model.batch)
    assert fit.sync == model.sync and fit.batch == model.batch
    assert fit.theta == pytest.approx(model.theta, abs=1e-9)


@pytest.mark.parametrize("model", [SYNC, ASYNC], ids=["sync", "async"])
def test_fit_with_noise_predicts_speeds_within_ten_percent(model):
    rng = np.random.default_rng(7)
    configs = profile_configs(16, 16, count=12, seed=1)
    samples = [(p, w, model.speed(p, w) * (1 + rng.normal(0, 0.03))) for p, w in configs]
    fit = fit_speed(samples, sync=model.sync, batch=model.batch)
    assert all(t >= 0 for t in fit.theta)
    errors = [abs(fit.speed(p, w) / model.speed(p, w) - 1) for p in range(1, 17) for w in range(1, 17)]
    assert np.mean(errors) < 0.10          # the paper's Fig. 8: < 10 % with 10 samples


def test_fit_rejects_no_samples_and_non_positive_speeds():
    with pytest.raises(ValueError, match="at least one"):
        fit_speed([])
    with pytest.raises(ValueError, match="positive"):
        fit_speed([(1, 1, 0.0)])
    with pytest.raises(ValueError, match="positive"):
        fit_speed([(1, 1, float("nan"))], sync=False)
    with pytest.raises(ValueError, match="at least 1"):
        fit_speed([(0, 1, 1.0)])


def test_profile_configs_spread_distinct_and_deterministic():
    configs = profile_configs(20, 40, count=8, seed=5)
    assert configs == profile_configs(20, 40, count=8, seed=5)
    assert configs != profile_configs(20, 40, count=8, seed=6)
    assert len(configs) == len(set(configs)) == 8
    assert (1, 1) in configs and any(w == 40 for _, w in configs)
    assert all(1 <= p <= 20 and 1 <= w <= 40 for p, w in configs)
    assert len({w for _, w in configs}) >= 6           # not bunched on one w
    assert sorted(profile_configs(2, 2, count=5)) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert profile_configs(1, 9, count=3, seed=0)[:2] == [(1, 1), (1, 9)]
