"""Our elastic policy (elastic-srpt), the estimate errors of optimus-noisy and the DRF-allocation
ablation: the pure allocator on tiny hand-made jobs, and the policies in the one driver driven by
hand (fake clock: the driver's own)."""
from __future__ import annotations

import math

import pytest

from tiresias.cluster import ClusterSpec
from tiresias.driver import Driver
from tiresias.optimus.allocation import AllocJob, allocate_marginal_gain
from tiresias.optimus.baselines import allocate_drf
from tiresias.optimus.completion_rate import RateJob, allocate_completion_rate, completion_rate
from tiresias.optimus.estimate_error import error_factor, error_signs
from tiresias.policies import make_policy
from tiresias.policies.base import JobState
from tiresias.policies.elastic import WORKER, ElasticSRPT, OptimusDRFAllocation, OptimusNoisy, OptimusOracle


def _linear(p: int, w: int) -> float:
    return float(w)


# --- the pure allocator ------------------------------------------------------------------------

def test_the_first_gpu_goes_to_the_shortest_job():
    jobs = [RateJob(1, 1000.0, _linear), RateJob(2, 100.0, _linear), RateJob(3, 500.0, _linear)]
    assert allocate_completion_rate(jobs, gpus=1, cpus=1) == {1: (0, 0), 2: (1, 1), 3: (0, 0)}


def test_spare_gpus_go_to_the_short_job_where_eq9_gives_them_to_the_long_one():
    short = dict(job_id=1, remaining=100.0, speed=_linear, max_workers=3)
    long = dict(job_id=2, remaining=1000.0, speed=lambda p, w: w ** 0.9)
    ours = allocate_completion_rate([RateJob(**short), RateJob(**long)], gpus=4, cpus=4)
    assert ours == {1: (3, 3), 2: (1, 1)}
    eq9 = allocate_marginal_gain([AllocJob(demand=WORKER, max_aggregators=1, **short),
                                  AllocJob(demand=WORKER, max_aggregators=1, **long)], {"gpu": 4, "cpu": 4})
    assert eq9[2][0] > eq9[1][0]            # eq. (9): time saved grows with Q


def test_a_resize_must_pay_for_its_restart():
    def jobs(fraction: float) -> list[RateJob]:
        return [RateJob(1, 1000.0, _linear, max_workers=4, current_workers=2, restart_fraction=fraction),
                RateJob(2, 1050.0, _linear, max_workers=2)]
    assert allocate_completion_rate(jobs(0.0), gpus=4, cpus=4)[1] == (4, 4)   # free: job 1 grows, job 2 waits
    assert allocate_completion_rate(jobs(0.3), gpus=4, cpus=4) == {1: (2, 2), 2: (2, 2)}   # kept at 2


def test_completion_rate_charges_a_resize_but_not_the_current_count():
    job = RateJob(1, 200.0, _linear, current_workers=2, restart_fraction=0.25)
    assert completion_rate(job, 2, 1) == pytest.approx(2 / 200)
    assert completion_rate(job, 3, 1) == pytest.approx(0.75 * 3 / 200)
    assert completion_rate(job, 0, 1) == 0.0


def test_left_over_cpus_become_aggregators_where_they_help():
    def speed(p: int, w: int) -> float:
        return w / (1.0 + w / p)
    jobs = [RateJob(1, 100.0, speed, max_workers=1), RateJob(2, 100.0, _linear, max_workers=1)]
    out = allocate_completion_rate(jobs, gpus=2, cpus=5)
    assert out[1] == (1, 4) and out[2] == (1, 1)        # aggregators only help job 1


def test_a_job_never_gets_less_than_its_minimum_or_more_than_fits():
    jobs = [RateJob(1, 10.0, _linear, min_workers=3, max_workers=3), RateJob(2, 1e4, _linear, max_workers=8)]
    out = allocate_completion_rate(jobs, gpus=4, cpus=4)
    assert out == {1: (3, 3), 2: (1, 1)}
    assert allocate_completion_rate([RateJob(1, 10.0, _linear, min_workers=5)], gpus=4, cpus=4) == {1: (0, 0)}


# --- the policy in the driver --------------------------------------------------------------------

def _job(job_id: int, steps: float, submit: float = 0.0, hi: int = 4) -> JobState:
    return JobState(job_id, 1, submit, steps, wait_since=submit, min_gpus=1, max_gpus=hi,
                    rate=lambda w, p, nodes: float(w), aggregators=1, model="resnet50")


def _report(policy, job_id: int, cap_steps: float, step: float = 0.0) -> None:
    """What the simulator reports at arrival: the cap, and pre-run speeds (linear in w)."""
    policy.describe(job_id, batch=64, cap_steps=cap_steps)
    for w in (1, 2, 4):
        policy.observe_speed(job_id, w, w, float(w), step=step)


def test_an_arrival_is_scheduled_at_once_and_the_short_job_takes_the_gpus():
    policy = ElasticSRPT(interval=600.0)
    drv = Driver(policy, ClusterSpec(1, 4))
    drv.submit(_job(1, 1e6))
    _report(policy, 1, 1e6)
    drv.schedule()
    assert drv.jobs[1].num_gpus == 4
    drv.advance(100.0)
    drv.submit(_job(2, 1e3, submit=100.0))
    _report(policy, 2, 1e3)
    decision = drv.schedule()                   # not the interval's round: the arrival's
    assert [j.job_id for j in decision.started] == [2] and drv.jobs[2].num_gpus == 4
    assert not drv.jobs[1].running              # SRPT: the long job waits for the short one


def test_without_event_rounds_an_arrival_waits_for_the_interval():
    policy = ElasticSRPT(interval=600.0, event_rounds=False)
    drv = Driver(policy, ClusterSpec(1, 4))
    drv.submit(_job(1, 1e6))
    _report(policy, 1, 1e6)
    drv.schedule()
    drv.advance(100.0)
    drv.submit(_job(2, 1e3, submit=100.0))
    _report(policy, 2, 1e3)
    assert drv.schedule().started == []
    assert policy.next_change(drv.running.values(), 100.0) == 600.0


def test_a_completion_hands_the_freed_gpus_out_at_once():
    policy = ElasticSRPT(interval=600.0)
    drv = Driver(policy, ClusterSpec(1, 4))
    for job_id, steps in ((1, 100.0), (2, 1e6)):
        drv.submit(_job(job_id, steps, hi=2))
        _report(policy, job_id, steps)
    drv.schedule()
    assert drv.jobs[1].num_gpus == 2 and drv.jobs[2].num_gpus == 2
    drv.advance(50.0)
    drv.finish(drv.jobs[1])
    assert policy.next_change(drv.running.values(), 50.0) == 50.0      # a round now, not at 600


def test_it_reads_reports_not_the_oracle():
    allocations = []
    for true_steps in (10.0, 1e9):              # the truth differs, the reports do not
        policy = ElasticSRPT(interval=600.0)
        drv = Driver(policy, ClusterSpec(1, 4))
        for job_id in (1, 2):
            job = _job(job_id, true_steps if job_id == 1 else 1e5, hi=4)
            drv.submit(job)
            _report(policy, job_id, 5e4 if job_id == 1 else 1e5)
        drv.schedule()
        allocations.append({j: drv.jobs[j].num_gpus if drv.jobs[j].running else 0 for j in (1, 2)})
    assert allocations[0] == allocations[1] == {1: 4, 2: 0}


def test_the_new_policies_are_registered():
    assert make_policy("elastic-srpt", interval=60).interval == 60.0
    assert isinstance(make_policy("optimus-noisy"), OptimusNoisy)
    assert isinstance(make_policy("optimus-drf-alloc"), OptimusDRFAllocation)
    with pytest.raises(ValueError, match="horizon"):
        ElasticSRPT(horizon=0)


# --- estimate errors and the DRF-allocation ablation --------------------------------------------

def test_error_signs_are_seeded_per_job():
    assert error_signs(3, 7) == error_signs(3, 7)
    assert all(s in (-1, 1) for s in error_signs(0, 1))
    assert len({error_signs(0, j) for j in range(40)}) == 4      # every combination occurs


def test_error_factor_shrinks_with_progress():
    assert error_factor(0.2, 1, 1.0) == pytest.approx(1.2)
    assert error_factor(0.2, -1, 0.5) == pytest.approx(0.9)
    assert error_factor(0.2, 1, 0.0) == 1.0
    assert error_factor(0.2, 1, 3.0) == pytest.approx(1.2)     # clamped
    with pytest.raises(ValueError):
        error_factor(-0.1, 1, 1.0)


def test_optimus_noisy_is_the_oracle_times_its_errors():
    job = _job(5, 1000.0)
    job.executed = 500.0
    exact_q, exact_f = OptimusOracle().estimate(job, 4)
    q0, f0 = OptimusNoisy(error=0.0).estimate(job, 4)
    assert q0 == exact_q and f0(2, 3) == exact_f(2, 3)
    noisy = OptimusNoisy(error=0.4, seed=1)
    q_sign, f_sign = error_signs(1, 5)
    q, f = noisy.estimate(job, 4)
    assert q == pytest.approx(exact_q * (1 + q_sign * 0.2))     # half left: half the error
    assert f(2, 3) == pytest.approx(exact_f(2, 3) * (1 + f_sign * 0.2))


def test_the_drf_allocation_ablation_learns_like_optimus_and_allocates_like_drf():
    policy = OptimusDRFAllocation(interval=60.0)
    assert policy.learns
    jobs = [AllocJob(1, 100.0, _linear, WORKER, max_workers=8), AllocJob(2, 1e4, _linear, WORKER, max_workers=8)]
    assert policy.decide(jobs, {"gpu": 6.0, "cpu": 6.0}) == allocate_drf(jobs, {"gpu": 6.0, "cpu": 6.0})
    assert math.isclose(sum(w for w, _ in policy.decide(jobs, {"gpu": 6.0, "cpu": 6.0}).values()), 6)
