"""Allocation policies in the one driver: rounds every interval, a change of GPU count is a stop
and a restart at the new count, a change of aggregator count alone keeps the job running, and
measured jobs report their loss points and speeds (fake clock: the driver's own)."""
from __future__ import annotations

import math

import pytest

from tiresias.cluster import ClusterSpec, parse_cluster
from tiresias.driver import Driver, DriverConfig
from tiresias.policies import make_policy
from tiresias.policies.base import JobState
from tiresias.policies.elastic import DRF, JobModel, Optimus, OptimusOracle
from tiresias.sim import simulate


def _rate(serial: float, per_gpu: float):
    """Steps/s of a job whose step is ``serial`` + ``per_gpu`` / w seconds (aggregators help
    a little), the same on any number of nodes."""
    return lambda w, p, nodes: 1.0 / (serial + per_gpu / w + 0.01 / p)


def _job(job_id: int, steps: float, lo: int = 1, hi: int = 4, submit: float = 0.0, rate=None) -> JobState:
    return JobState(job_id, lo, submit, steps, wait_since=submit, min_gpus=lo, max_gpus=hi,
                    rate=rate or _rate(0.1, 1.0), aggregators=1)


def test_cluster_spec_names_cpus_for_aggregators():
    assert parse_cluster("16x4").total_cpus == 64
    assert parse_cluster("16x4x8").total_cpus == 128
    with pytest.raises(ValueError, match="CPUS"):
        parse_cluster("16x4x0")


def test_make_policy_gives_allocation_policies_the_papers_interval():
    assert make_policy("optimus").interval == 600.0
    assert make_policy("drf", interval=60).interval == 60.0
    assert make_policy("las", continuous=True).interval == 1.0


def test_an_arrival_waits_for_the_next_round_and_rounds_come_every_interval():
    policy = OptimusOracle(interval=100.0)
    drv = Driver(policy, ClusterSpec(1, 4))
    drv.submit(_job(1, 1e6))
    first = drv.schedule()                       # the first round is due at once
    assert [j.job_id for j in first.started] == [1]
    drv.advance(10.0)
    drv.submit(_job(2, 1e6, submit=10.0))
    assert drv.schedule().started == []          # not a round: job 2 waits
    assert policy.next_change(drv.running.values(), 10.0) == 100.0
    drv.advance(100.0)
    again = drv.schedule()
    assert 2 in {j.job_id for j in again.started}


def test_the_oracle_resizes_by_stop_and_restart_and_never_oversubscribes():
    policy = OptimusOracle(interval=100.0)
    drv = Driver(policy, ClusterSpec(1, 4), DriverConfig(placement="count", overheads=True))
    drv.submit(_job(1, 1e6))
    drv.schedule()
    job1 = drv.jobs[1]
    assert job1.num_gpus == 4                    # alone, it grows while a GPU saves time
    drv.advance(100.0)
    drv.submit(_job(2, 1e3, submit=100.0))       # a short job arrives: eq. (9) favours it
    decision = drv.schedule()
    assert job1 in decision.stopped and job1 in decision.started    # resized: stop + restart
    assert 0 < job1.num_gpus < 4 and drv.jobs[2].running
    assert drv.used <= drv.capacity
    assert job1.preemptions == 1 and job1.stall > 0                  # the restart is charged
    assert math.isclose(job1.speed, job1.rate(job1.num_gpus, job1.aggregators, 1))


def test_an_aggregator_change_alone_keeps_the_job_running_at_its_new_speed():
    policy = OptimusOracle(interval=100.0)
    drv = Driver(policy, ClusterSpec(1, 2, 1))   # one CPU: one aggregator in all
    drv.submit(_job(1, 1e6, lo=2, hi=2))
    drv.schedule()
    job = drv.jobs[1]
    assert (job.num_gpus, job.aggregators) == (2, 1)
    drv.cluster = ClusterSpec(1, 2, 4)           # the node lends more CPUs
    drv.advance(100.0)
    decision = drv.schedule()
    assert decision.stopped == [] and decision.started == [] and decision.moved == [job]
    assert job.aggregators > 1 and job.preemptions == 0
    assert math.isclose(job.speed, job.rate(2, job.aggregators, 1))


def test_a_fixed_job_keeps_its_gpu_count_under_an_allocation_policy():
    drv = Driver(DRF(interval=50.0), ClusterSpec(2, 4))
    fixed = JobState(1, 3, 0.0, 1e5, aggregators=1)
    drv.submit(fixed)
    drv.submit(_job(2, 1e5, hi=8))
    drv.schedule()
    assert fixed.running and fixed.num_gpus == 3
    assert drv.jobs[2].num_gpus == 5             # DRF hands the rest to the elastic job


def test_what_optimus_knows_comes_from_reports():
    m = JobModel(batch=256, cap_steps=1000)
    assert m.young and m.remaining_steps() == 1000 and m.speed_model() is None
    for k, loss in ((100, 1.0), (200, 0.6), (300, 0.45), (400, 0.38)):
        m.losses[k] = loss
        m.step = k
    assert not m.young and 0 <= m.remaining_steps() <= 600
    m.speeds[(1, 1)] = 2.0
    m.speeds[(1, 2)] = 3.5
    m.speeds[(2, 4)] = 6.0
    assert m.speed_model() is not None and m.speed_model().speed(2, 4) > m.speed_model().speed(1, 1)


def test_measured_jobs_report_loss_points_and_learning_policies_pay_for_profiling():
    from tiresias.apps import load_applications, load_workload
    from tiresias.sim.measured import MeasuredWorkload
    apps = load_applications()
    workload = load_workload("../shared/data/pollux/workloads/workload-1.csv")[:6]
    results = {}
    for policy in (Optimus(interval=60.0), OptimusOracle(interval=60.0)):
        measured = MeasuredWorkload(workload, apps, elastic=True, gpus_per_node=4)
        seen: list[tuple[int, float]] = []
        observe_loss = policy.observe_loss
        policy.observe_loss = lambda job_id, step, loss: (seen.append((job_id, step)), observe_loss(job_id, step, loss))
        result = simulate(measured.trace, ClusterSpec(4, 4), policy, config=DriverConfig(placement="tiresias"),
                          make_job=measured.make_job, observe=measured.observe)
        assert all(j.end_time is not None for j in result.jobs)
        results[policy.name] = result
        by_job = {}
        for job_id, step in seen:                  # each job's points in step order, none past its end
            assert step > by_job.get(job_id, -1.0)
            by_job[job_id] = step
        assert set(by_job) == {w.job_id for w in workload}
    learned = sum(j.overhead for j in results["optimus"].jobs)
    oracle = sum(j.overhead for j in results["optimus-oracle"].jobs)
    assert learned > oracle                       # the pre-runs are in the JCT


def test_compare_runs_a_workload_under_every_allocation_policy(capsys):
    from tiresias.cli import main
    import json
    rc = main(["compare", "--workload", "../shared/data/pollux/workloads/workload-1.csv", "--cluster", "16x4",
               "--policies", "optimus,optimus-oracle,drf,tetris,fifo,las", "--limit", "12", "--no-progress",
               "--json", "-"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["optimus", "optimus-oracle", "drf", "tetris", "fifo", "las"]
    assert all(r["avg_jct"] > 0 and r["makespan"] > 0 for r in rows)


def test_a_trace_or_a_workload_not_both(capsys):
    from tiresias.cli import main
    assert main(["simulate", "--cluster", "16x4", "--policy", "las"]) == 2
    assert "one of --trace FILE or --workload FILE" in capsys.readouterr().err


def test_live_a_resized_job_restarts_once_its_last_run_has_drained():
    policy = OptimusOracle(interval=100.0)
    drv = Driver(policy, ClusterSpec(1, 4), DriverConfig(placement="tiresias", defer_release=True))
    drv.submit(_job(1, 1e6))
    first = drv.schedule()
    assert [j.num_gpus for j in first.started] == [4]
    drv.advance(100.0)
    drv.submit(_job(2, 1e3, submit=100.0))
    round_ = drv.schedule()
    assert [j.job_id for j in round_.stopped] == [1] and round_.started == []    # job 1's GPUs drain
    drv.advance(101.0)
    assert drv.schedule().started == []          # not a round, still draining: nothing yet
    drv.released(drv.jobs[1])                    # its processes are gone
    drv.advance(102.0)
    later = drv.schedule()                       # not a round: the round's targets start now
    assert sorted(j.job_id for j in later.started) == [1, 2]
    assert drv.jobs[1].num_gpus + drv.jobs[2].num_gpus <= 4 and drv.jobs[1].num_gpus < 4
    drv.advance(103.0)
    assert drv.schedule().started == []          # nothing left to start


def test_pollux_like_settings_decide_at_ticks_and_charge_every_start():
    from types import SimpleNamespace as Job
    from tiresias.sim import SimConfig
    trace = [Job(job_id=i, submit_time=t, num_gpus=1, duration=100.0) for i, t in enumerate((5.0, 61.0, 130.0))]
    plain = simulate(trace, 4, make_policy("fifo"), record=True)
    ticks = simulate(trace, 4, make_policy("fifo"), record=True,
                     config=SimConfig(overheads=True, start_cost=30.0, decide_every=60.0))
    starts = {job_id: t for t, job_id, kind in ticks.timeline if kind == "start"}
    assert starts == {0: 60.0, 1: 120.0, 2: 180.0}                 # at the next tick, not at arrival
    assert {j.job_id: j.end_time for j in ticks.jobs} == {0: 190.0, 1: 250.0, 2: 310.0}   # + 30 s each
    assert {j.job_id: j.end_time for j in plain.jobs} == {0: 105.0, 1: 161.0, 2: 230.0}
    with pytest.raises(ValueError, match="decide_every"):
        SimConfig(decide_every=0.0)
