"""Optimus' marginal-gain allocation (tiresias/optimus/allocation.py, paper §4.1 eq. (9))."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from tiresias.optimus.allocation import AllocJob, Demand, allocate_marginal_gain
from tiresias.optimus.speed import SpeedModel

GPU_JOB = Demand({"gpu": 1, "cpu": 1}, {"cpu": 1})


def job(job_id, remaining=1000.0, speed=None, demand=GPU_JOB, **kw):
    speed = speed or SpeedModel(False, (1.0, 0.2, 0.01, 0.01)).speed
    return AllocJob(job_id, remaining, speed, demand, **kw)


def used(alloc, jobs):
    total = {}
    for j in jobs:
        w, p = alloc[j.job_id]
        for r, v in j.demand.workers.items():
            total[r] = total.get(r, 0) + w * v
        for r, v in j.demand.aggregators.items():
            total[r] = total.get(r, 0) + p * v
    return total


def test_a_job_whose_speed_does_not_grow_gets_nothing_extra():
    flat = job(1, speed=lambda p, w: 2.0)
    worker_bound = job(2, speed=lambda p, w: float(w) if p >= 1 else 0.0)      # aggregators do not help it
    alloc = allocate_marginal_gain([flat, worker_bound], {"gpu": 10, "cpu": 40})
    assert alloc[1] == (1, 1)
    assert alloc[2] == (9, 1)


def test_a_sync_job_alone_stops_where_its_speed_peaks():
    model = SpeedModel(True, (0.02, 0.1, 0.3, 0.05, 0.05), batch=256)
    alloc = allocate_marginal_gain([job(1, speed=model.speed)], {"gpu": 1000, "cpu": 1000})
    w, p = alloc[1]
    assert 1 < w < 1000
    f = model.speed(p, w)
    assert model.speed(p, w + 1) <= f and model.speed(p + 1, w) <= f     # no positive gain left


def test_diminishing_returns_spread_workers_over_jobs():
    # speed sqrt(w): each job's gain per worker falls, so two equal jobs share equally
    sqrt = lambda p, w: math.sqrt(w)                                     # noqa: E731
    alloc = allocate_marginal_gain([job(1, speed=sqrt, max_aggregators=1), job(2, speed=sqrt, max_aggregators=1)],
                                   {"gpu": 20, "cpu": 100})
    assert alloc[1] == alloc[2] == (10, 1)
    # a job with twice the remaining steps saves twice the time per worker: it gets more
    alloc = allocate_marginal_gain([job(1, 1000.0, sqrt, max_aggregators=1), job(2, 2000.0, sqrt, max_aggregators=1)],
                                   {"gpu": 20, "cpu": 100})
    assert alloc[2][0] > alloc[1][0] and alloc[1][0] + alloc[2][0] == 20


def test_a_resource_running_out_stops_the_allocation():
    linear = lambda p, w: float(min(w, 4 * p))                           # noqa: E731
    jobs = [job(i, speed=linear) for i in range(3)]
    alloc = allocate_marginal_gain(jobs, {"gpu": 100, "cpu": 12})
    total = used(alloc, jobs)
    assert total["cpu"] == 12 and total["gpu"] < 100                    # CPUs out, GPUs left idle
    assert all(alloc[j.job_id][0] >= 1 for j in jobs)


def test_gains_are_per_unit_of_the_dominant_resource():
    # the same speed-up; one job's worker takes 4 of the scarce GPUs, the other's 1 -> it wins
    sqrt = lambda p, w: math.sqrt(w)                                     # noqa: E731
    heavy = job(1, speed=sqrt, demand=Demand({"gpu": 4}, {"cpu": 1}), max_aggregators=1)
    light = job(2, speed=sqrt, demand=Demand({"gpu": 1}, {"cpu": 1}), max_aggregators=1)
    alloc = allocate_marginal_gain([heavy, light], {"gpu": 24, "cpu": 100})
    assert alloc[2][0] > 4 * alloc[1][0] / 2


def test_the_young_factor_lowers_a_young_jobs_share():
    sqrt = lambda p, w: math.sqrt(w)                                     # noqa: E731
    jobs = [job(1, speed=sqrt, max_aggregators=1), job(2, speed=sqrt, max_aggregators=1, young=True)]
    alloc = allocate_marginal_gain(jobs, {"gpu": 200, "cpu": 300})
    assert alloc[2][0] < alloc[1][0] and alloc[1][0] + alloc[2][0] == 200
    same = allocate_marginal_gain(jobs, {"gpu": 200, "cpu": 300}, young_factor=1.0)
    assert same[1] == same[2]
    harder = allocate_marginal_gain(jobs, {"gpu": 200, "cpu": 300}, young_factor=0.5)
    assert harder[2][0] < alloc[2][0]


def test_ties_go_to_the_lower_job_id_whatever_the_order():
    sqrt = lambda p, w: math.sqrt(w)                                     # noqa: E731
    jobs = [job(i, speed=sqrt, max_aggregators=1) for i in (7, 3, 5)]
    for order in (jobs, jobs[::-1]):
        alloc = allocate_marginal_gain(order, {"gpu": 8, "cpu": 100})
        assert alloc == {3: (3, 1), 5: (3, 1), 7: (2, 1)}


def test_minimums_first_in_order_and_a_job_that_does_not_fit_gets_nothing():
    big = job(1, min_workers=6)
    small = job(2, min_workers=2)
    late = job(3, min_workers=3)
    alloc = allocate_marginal_gain([small, big, late], {"gpu": 8, "cpu": 100})
    assert alloc[3] == (0, 0) and alloc[2][0] >= 2 and alloc[1][0] >= 6
    assert allocate_marginal_gain([job(1, min_workers=4, max_workers=2)], {"gpu": 8, "cpu": 8})[1][0] <= 2


def test_a_unit_that_uses_no_counted_resource_is_rejected():
    with pytest.raises(ValueError, match="uses none of the resources"):
        allocate_marginal_gain([job(1, demand=Demand({"gpu": 1}, {}))], {"gpu": 4, "cpu": 4})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(10, 1e5), st.floats(0.1, 3), st.floats(0, 2), st.floats(0, 0.2),
                          st.integers(1, 6), st.booleans()), min_size=1, max_size=6),
       st.integers(1, 30), st.integers(1, 60))
def test_capacity_bounds_and_no_positive_gain_that_fits_is_left(specs, gpus, cpus):
    jobs = [job(i, q, SpeedModel(False, (t0, t1, t2, 0.01)).speed, max_workers=mx, young=young)
            for i, (q, t0, t1, t2, mx, young) in enumerate(specs)]
    capacity = {"gpu": gpus, "cpu": cpus}
    alloc = allocate_marginal_gain(jobs, capacity)
    total = used(alloc, jobs)
    assert all(total.get(r, 0) <= capacity[r] for r in capacity)
    left = {r: capacity[r] - total.get(r, 0) for r in capacity}
    for j in jobs:
        w, p = alloc[j.job_id]
        assert w <= j.max_workers
        if w == 0:
            continue
        t = j.remaining / j.speed(p, w)
        if w < j.max_workers and left["gpu"] >= 1 and left["cpu"] >= 1:
            assert j.remaining / j.speed(p, w + 1) >= t - 1e-9
        if left["cpu"] >= 1:
            assert j.remaining / j.speed(p + 1, w) >= t - 1e-9


def test_the_package_stays_pure():
    import subprocess
    import sys
    code = ("import sys, tiresias.optimus.allocation, tiresias.optimus.placement, tiresias.optimus.baselines, "
            "tiresias.optimus.convergence, tiresias.optimus.speed; "
            "bad = [m for m in sys.modules if m.startswith(('tiresias.sim', 'tiresias.service', 'tiresias.driver'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
