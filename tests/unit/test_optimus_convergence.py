"""Optimus' convergence fit (tiresias/optimus/convergence.py): outliers, eq. (1), the convergence step
under its two targets (the fitted limit, the fitted loss at the epoch cap)."""
import math

import numpy as np
import pytest

from tiresias.optimus.convergence import (TARGET_CAP, TARGET_LIMIT, ConvergenceFit, clean_losses,
                                          fit_convergence)


def curve(b0, b1, b2, steps):
    return [(float(k), 1.0 / (b0 * k + b1) + b2) for k in steps]


def raw_betas(fit):
    """Eq. (1) in raw loss units: l = 1/((b0/s) k + b1/s) + s*b2."""
    return fit.beta0 / fit.scale, fit.beta1 / fit.scale, fit.beta2 * fit.scale


def test_clean_losses_replaces_a_spike_and_a_dip_by_the_neighbours_average():
    pts = curve(0.05, 1.0, 0.2, range(30))
    spiked = list(pts)
    spiked[10] = (10.0, 5.0)             # above the max of the previous 5 epochs
    spiked[20] = (20.0, 0.01)            # below the min of the next 5 epochs
    cleaned = clean_losses(spiked)
    assert cleaned[10][1] == pytest.approx((pts[9][1] + pts[11][1]) / 2)
    assert cleaned[20][1] == pytest.approx((pts[19][1] + pts[21][1]) / 2)
    untouched = [i for i in range(30) if i not in (10, 20)]
    assert [cleaned[i] for i in untouched] == [pts[i] for i in untouched]


def test_clean_losses_groups_points_by_epoch_and_sorts_them():
    # two points an epoch; the in-epoch bump stays (it is not compared with its own epoch)
    pts = [(0, 1.0), (5, 1.05), (10, 0.8), (15, 0.75), (20, 0.6), (25, 0.55), (30, 0.5), (35, 3.0)]
    cleaned = clean_losses(list(reversed(pts)), steps_per_epoch=10)
    assert [k for k, _ in cleaned] == [k for k, _ in pts]
    assert cleaned[1][1] == 1.05
    assert cleaned[-1][1] == pytest.approx(0.5)        # last: its only neighbour
    with pytest.raises(ValueError):
        clean_losses(pts, steps_per_epoch=0)


@pytest.mark.parametrize("betas", [(0.02, 1.0, 0.1), (0.5, 2.0, 0.0), (0.002, 0.5, 1.3)])
def test_fit_recovers_known_coefficients_without_noise(betas):
    fit = fit_convergence(curve(*betas, np.arange(0, 400, 4)))
    assert fit is not None and fit.points == 100
    assert raw_betas(fit) == pytest.approx(betas, rel=1e-3, abs=1e-4)
    assert fit.first_loss == 1.0 and fit.first_step == 0.0


def test_fit_with_noise_predicts_the_convergence_step():
    b0, b1, b2 = 0.02, 1.0, 0.1
    rng = np.random.default_rng(1)
    noisy = [(k, v * (1 + rng.normal(0, 0.02))) for k, v in curve(b0, b1, b2, np.arange(0, 600, 3))]
    fit = fit_convergence(noisy)
    exact = fit_convergence(curve(b0, b1, b2, np.arange(0, 600, 3)))
    assert raw_betas(fit)[2] == pytest.approx(b2, rel=0.25)
    for k in (0, 100, 300, 599):
        assert fit.raw_loss(k) == pytest.approx(1 / (b0 * k + b1) + b2, rel=0.03)
    assert fit.converged_step(0.05) == pytest.approx(exact.converged_step(0.05), rel=0.2)


def test_converged_step_matches_the_closed_form():
    fit = ConvergenceFit(beta0=0.1, beta1=1.0, beta2=0.2, scale=2.0, first_step=0.0, first_loss=1.2, points=10)
    # 1/(0.1k + 1) = 0.05 * (1.2 - 0.2)  ->  0.1k + 1 = 20  ->  k = 190
    assert fit.converged_step(0.05) == pytest.approx(190.0)
    assert fit.loss(190.0) == pytest.approx(0.2 + 0.05 * 1.0)
    assert fit.raw_loss(190.0) == pytest.approx(2.0 * 0.25)
    assert fit.remaining_steps(40.0) == pytest.approx(150.0)
    assert fit.remaining_steps(40.0, cap_step=100.0) == pytest.approx(60.0)
    assert fit.remaining_steps(500.0) == 0.0
    assert fit.converged_step(0.01) > fit.converged_step(0.05)


def test_a_flat_curve_never_converges_unless_capped():
    fit = fit_convergence([(k, 2.0) for k in range(20)])
    assert fit is not None
    assert fit.beta0 == pytest.approx(0.0, abs=1e-6)
    assert fit.converged_step() == math.inf
    assert fit.remaining_steps(5, cap_step=50) == 45


def test_robust_to_few_points_increasing_tails_and_bad_input():
    assert fit_convergence([]) is None
    assert fit_convergence([(0, 1.0), (1, 0.5)]) is None
    assert fit_convergence([(0, 0.0), (1, 0.0), (2, 0.0)]) is None
    three = fit_convergence([(0, 1.0), (1, 0.6), (2, 0.45)])
    assert three is not None and three.loss(1) < three.loss(0)
    slipping = curve(0.05, 1.0, 0.3, range(40)) + [(40 + i, 0.4 + 0.05 * i) for i in range(10)]
    fit = fit_convergence(slipping)
    assert fit is not None and all(math.isfinite(b) and b >= 0 for b in (fit.beta0, fit.beta1, fit.beta2))
    assert fit.remaining_steps(49) >= 0.0
    to_zero = fit_convergence([(0, 1.0), (1, 0.5), (2, 0.0), (3, 0.0)])
    assert to_zero is not None and to_zero.beta2 == 0.0


def exact_fit():
    return ConvergenceFit(beta0=0.1, beta1=1.0, beta2=0.2, scale=2.0, first_step=0.0, first_loss=1.2, points=10)


def test_cap_target_measures_the_improvement_to_the_fitted_loss_at_the_cap():
    fit = exact_fit()
    # loss(90) = 1/10 + 0.2 = 0.3; 0.3 + 0.05 * (1.2 - 0.3) = 0.345 -> 0.1k + 1 = 1/0.145
    assert fit.target_loss(TARGET_CAP, cap_step=90.0) == pytest.approx(0.3)
    assert fit.converged_step(0.05, target=TARGET_CAP, cap_step=90.0) == pytest.approx((1 / 0.145 - 1) / 0.1)
    assert fit.remaining_steps(40.0, cap_step=90.0, target=TARGET_CAP) == pytest.approx((1 / 0.145 - 1) / 0.1 - 40)
    # the default target is still the limit (the definition)
    assert fit.target_loss() == 0.2
    assert fit.converged_step(0.05) == fit.converged_step(0.05, target=TARGET_LIMIT) == pytest.approx(190.0)
    for cap in (10.0, 90.0, 1e4):
        assert fit.converged_step(0.05, target=TARGET_CAP, cap_step=cap) <= min(cap, 190.0)
    with pytest.raises(ValueError):
        fit.converged_step(0.05, target=TARGET_CAP)
    with pytest.raises(ValueError):
        fit.converged_step(0.05, target="best")


def test_step_at_loss_inverts_the_fitted_curve():
    fit = exact_fit()
    assert fit.step_at_loss(fit.loss(37.0)) == pytest.approx(37.0)
    assert fit.step_at_loss(2.0) == 0.0                  # above the first loss: already there
    assert fit.step_at_loss(0.2) == math.inf             # the limit itself is never reached
    assert fit.converged_step(0.05, target=TARGET_CAP, cap_step=0.0) == math.inf   # no improvement left


def test_the_targets_agree_when_the_limit_is_reached_long_before_the_cap():
    fit = fit_convergence(curve(0.05, 1.0, 0.1, np.arange(0, 400, 2)))
    limit = fit.converged_step(0.05)
    assert limit == pytest.approx(380.0, rel=1e-3)
    assert fit.converged_step(0.05, target=TARGET_CAP, cap_step=1e4) == pytest.approx(limit, rel=0.05)


def test_on_a_curve_flattening_faster_than_1_over_k_the_cap_target_is_the_usable_one():
    """Fitted on the first half of an exponential curve, "within 5% of the limit" lies several
    times too late (eq. (1)'s tail is 1/k); the cap target lands near the measured step."""
    rng = np.random.default_rng(0)
    steps = np.arange(100) * 50.0
    pts = [(k, (0.1 + 0.9 * math.exp(-k / 1250)) * (1 + rng.normal(0, 0.01))) for k in steps]
    first, best = pts[0][1], min(v for _, v in pts)
    measured = next(k for k, v in pts if v <= best + 0.05 * (first - best))
    fit = fit_convergence(pts[:50])
    assert fit.converged_step(0.05) > 3 * measured
    assert fit.converged_step(0.05, target=TARGET_CAP, cap_step=steps[-1]) == pytest.approx(measured, rel=0.2)
