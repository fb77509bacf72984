"""The progress guarantee (tiresias.progress): a resumed job runs long enough to make progress,
in the simulator and in the live driver; a run in which no job progresses stops with a clear
error; every policy ends on every trace the tests use, with and without the cost models."""
from __future__ import annotations

import pathlib
import random
from dataclasses import dataclass

import pytest

from tiresias import overheads as ovh
from tiresias.cluster import ClusterSpec
from tiresias.driver import Driver, DriverConfig
from tiresias.policies import POLICIES, make_policy
from tiresias.policies.base import JobState
from tiresias.policies.las import ContinuousLAS, DiscretizedLAS
from tiresias.progress import StallError, check_guard, protected_until
from tiresias.sim import SimConfig, simulate
from tiresias.trace import load_trace

DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass
class J:
    job_id: int
    submit_time: float
    num_gpus: int
    duration: float


FIG_3_7 = [J(1, 0, 2, 2), J(2, 0, 1, 8), J(3, 0, 2, 6)]       # the three-job example, on 2 GPUs
CHARGED = SimConfig("count", overheads=True)                      # pause + resume charged


def test_the_rule_and_its_settings():
    assert protected_until(10.0, 8.0) == 26.0                     # default factor 2: s + 2r
    assert protected_until(10.0, 8.0, min_run_factor=0.5, min_run=30.0) == 40.0
    assert protected_until(10.0, 0.0) == 10.0                     # no cost, no min run: no guard
    for bad in ((-1.0, 0.0), (1.0, -1.0), (float("inf"), 0.0), (float("nan"), 0.0)):
        with pytest.raises(ValueError):
            check_guard(*bad)
    with pytest.raises(ValueError, match="min_run_factor"):
        SimConfig("count", min_run_factor=-1.0)


def test_three_job_example_ends_and_no_resumed_job_is_stopped_before_twice_its_resume_cost():
    res = simulate(FIG_3_7, 2, ContinuousLAS(interval=1.0), config=CHARGED, record=True, max_events=10_000)
    assert all(j.end_time is not None for j in res.jobs) and res.preemptions > 0
    gpus = {j.job_id: j.num_gpus for j in FIG_3_7}
    last_start: dict[int, tuple[float, bool]] = {}
    for t, jid, what in res.timeline:
        if what == "start":
            last_start[jid] = (t, jid in last_start)               # (when, a resume?)
        elif what == "stop":
            s, resumed = last_start[jid]
            if resumed:
                assert t >= s + 2 * ovh.preemption_cost(None, gpus[jid]) - 1e-9


def test_without_the_guarantee_the_stall_detector_stops_the_run():
    # factor 0: the resumed job is preempted again while it still pays its resume, for ever
    with pytest.raises(StallError, match="no job made progress for 60[0-9] s"):
        simulate(FIG_3_7, 2, ContinuousLAS(interval=1.0), config=SimConfig("count", overheads=True,
                                                                             min_run_factor=0.0),
                 stall_limit=600.0, max_events=100_000)


def test_without_overheads_the_guarantee_changes_nothing():
    rng = random.Random(5)
    trace = [J(i, rng.uniform(0, 300), rng.choice([1, 1, 2, 4]), rng.uniform(1, 200)) for i in range(80)]
    runs = [simulate(trace, 8, ContinuousLAS(interval=5.0), record=True,
                     config=SimConfig("count", min_run_factor=k)).timeline for k in (0.0, 2.0, 50.0)]
    assert runs[0] == runs[1] == runs[2]


LIVE = DriverConfig("tiresias", defer_release=True)


def test_live_driver_keeps_a_resumed_job_until_its_protection_ends_then_preempts_it():
    drv = Driver(DiscretizedLAS(thresholds=[4.0]), ClusterSpec(1, 2), LIVE)
    a = JobState(1, 2, 0.0)
    drv.submit(a)
    drv.schedule()                                    # a starts (a first start: no resume cost)
    drv.advance(2.0)                                  # a reaches 4 GPU-s: Q2
    drv.submit(JobState(2, 2, 2.0, wait_since=2.0))
    assert [j.job_id for j in drv.schedule().stopped] == [1]
    drv.advance(3.0)
    drv.released(a)
    assert [j.job_id for j in drv.schedule().started] == [2]
    drv.advance(5.0)                                  # b in Q2 too: a (first started at 0) goes first
    assert [j.job_id for j in drv.schedule().stopped] == [2]
    drv.advance(6.0)
    drv.released(drv.jobs[2])
    assert [j.job_id for j in drv.schedule().started] == [1]          # a resumes at 6
    guard = 6.0 + 2 * ovh.preemption_cost(None, 2)
    assert a.protected_until == pytest.approx(guard)
    drv.advance(7.0)
    drv.submit(JobState(3, 2, 7.0, wait_since=7.0))  # Q1: it would preempt a at once
    d = drv.schedule()
    assert d.stopped == [] and d.started == [] and a.running
    assert drv.next_change() == pytest.approx(guard)  # the master wakes when a may be preempted
    drv.advance(guard)
    assert [j.job_id for j in drv.schedule().stopped] == [1]


def test_master_hands_its_guarantee_settings_to_the_driver(tmp_path):
    from test_tiresias_master import make
    m, _, _ = make(tmp_path, min_run_factor=3.0, min_run=10.0)
    assert (m.driver.config.min_run_factor, m.driver.config.min_run) == (3.0, 10.0)
    m.close()


# --- every policy ends on every trace of the tests -----------------------------------------------

def _random_trace():
    rng = random.Random(3)
    return [J(i, rng.uniform(0, 500), rng.choice([1, 1, 1, 2, 4, 8]), rng.uniform(1, 300)) for i in range(200)]


TRACES = {   # name: (jobs, cluster, continuous interval)
    "fig-3.7": (lambda: FIG_3_7, ClusterSpec(1, 2), 1.0),
    "random-200": (_random_trace, ClusterSpec(2, 8), 1.0),
    "60-job": (lambda: load_trace(DATA / "tiresias" / "60_job.csv").jobs, ClusterSpec(2, 4), 1.0),
    "philly-200": (lambda: load_trace(DATA / "traces" / "philly.csv", max_gpus=128, limit=200).jobs,
                   ClusterSpec(16, 8), 3600.0),
}
CONFIGS = {"original": SimConfig("count", overheads=False, slowdown=False),
           "costs": SimConfig("tiresias", overheads=True, slowdown=True)}
VARIANTS = [(name, False) for name in POLICIES] + [("las", True), ("gittins", True)]


@pytest.mark.parametrize("trace", sorted(TRACES))
def test_every_policy_ends_with_and_without_overheads(trace):
    make_jobs, cluster, interval = TRACES[trace]
    jobs = make_jobs()
    history = [j.num_gpus * j.duration for j in jobs]
    for config_name, config in CONFIGS.items():
        target = cluster if config.placement != "count" else cluster.total_gpus
        for name, continuous in VARIANTS:
            policy = make_policy(name, continuous=continuous, interval=interval, history=history, cluster=cluster)
            res = simulate(jobs, target, policy, config=config, max_events=200_000)
            assert sum(j.end_time is not None for j in res.jobs) == len(jobs), (config_name, name, continuous)
