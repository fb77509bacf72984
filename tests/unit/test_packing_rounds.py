"""Tesserae's round (Algorithm 1) and GPU sharing in the shared driver, on hand-made tables."""
import pytest

from tiresias.cluster import ClusterSpec
from tiresias.driver import Driver, DriverConfig
from tiresias.packing.rounds import RoundJob, plan_round
from tiresias.packing.slots import GpuSlots
from tiresias.policies.base import JobState
from tiresias.policies.baselines import FIFO

TABLE = {("A", "B"): (0.7, 0.6), ("A", "C"): (0.9, 0.8), ("B", "C"): (0.5, 0.4), ("A", "A"): (0.6, 0.6)}


def speeds(a, b):
    if (a, b) in TABLE:
        return TABLE[a, b]
    if (b, a) in TABLE:
        return TABLE[b, a][::-1]
    return None


class KindSharing:
    """Sharing by a job's model name (the test's kinds)."""

    def kind(self, job):
        return job.model

    def pair(self, a, b):
        return None if a is None or b is None else speeds(a, b)


def test_round_places_by_priority_then_packs_the_pending_by_matching():
    jobs = [RoundJob(1, 1, "A"), RoundJob(2, 1, "B"), RoundJob(3, 1, "C"), RoundJob(4, 2, "A")]
    plan = plan_round(jobs, nodes=1, per_node=2, speeds=speeds)
    assert plan.placed == [1, 2]                 # 4 (2 GPUs) finds none left: pending
    assert [(p.placed, p.pending) for p in plan.pairs] == [(1, 3)]     # A+C 1.7 beats B+C 0.9
    assert plan.waiting == [4]
    assert plan.plan == [[frozenset({1, 3}), frozenset({2})]]
    assert plan.speeds() == {1: 0.9, 3: 0.8}


def test_round_without_packing_and_a_job_that_must_not_share():
    jobs = [RoundJob(1, 1, "A"), RoundJob(2, 1, "C", may_share=False)]
    assert plan_round(jobs, 1, 1, speeds).pairs == []
    assert plan_round(jobs, 1, 1, speeds, packing=None).waiting == [2]


def test_round_renames_onto_the_previous_plan_instead_of_moving_jobs():
    previous = [[frozenset(), frozenset()], [frozenset({7}), frozenset({8})]]
    jobs = [RoundJob(7, 1, "A"), RoundJob(8, 1, "B")]
    plan = plan_round(jobs, 2, 2, speeds, previous=previous)
    assert plan.migrated == [] and plan.naive == [7, 8]       # planned on node 0, renamed to node 1
    assert plan.gpus() == {7: frozenset({(1, 0)}), 8: frozenset({(1, 1)})}


def test_gavel_keeps_a_job_on_its_gpus_when_they_are_free():
    previous = [[frozenset(), frozenset({5})]]
    plan = plan_round([RoundJob(5, 1, "A"), RoundJob(6, 1, "B")], 1, 2, speeds, previous=previous, packing="gavel")
    assert plan.gpus()[5] == frozenset({(0, 1)}) and plan.migrated == []
    with pytest.raises(ValueError, match="packing"):
        plan_round([], 1, 1, speeds, packing="lucid")


def test_gpu_slots_release_returns_the_partner():
    slots = GpuSlots(1, 2)
    slots.set([[frozenset({1, 3}), frozenset({2})]], {1: 3, 3: 1})
    assert slots.busy() == 2 and slots.allocation(1) == [(0, 1)]
    assert slots.release(3) == 1
    assert slots.partner == {} and slots.busy() == 2
    assert slots.release(2) is None and slots.busy() == 1


def _driver(per_node=2, nodes=1, packing="tesserae"):
    config = DriverConfig(placement="tiresias", packing=packing, decide_every=360.0)
    return Driver(FIFO(), ClusterSpec(nodes, per_node), config, sharing=KindSharing())


def test_driver_runs_packed_jobs_at_their_packed_speed_and_a_partner_alone_after():
    drv = _driver()
    jobs = [JobState(i, 1, 0.0, 1000.0, model=m) for i, m in ((1, "A"), (2, "B"), (3, "C"))]
    for job in jobs:
        drv.submit(job)
    decision = drv.schedule()
    assert sorted(j.job_id for j in decision.started) == [1, 2, 3]
    assert (jobs[0].speed, jobs[1].speed, jobs[2].speed) == (0.9, 1.0, 0.8)
    assert drv.used == 2                          # GPUs busy, a shared one counted once
    drv.advance(100.0)
    alone = drv.finish(jobs[2])                    # job 3 leaves: job 1 runs alone from now on
    assert alone == [jobs[0]] and jobs[0].speed == 1.0
    assert jobs[0].executed == pytest.approx(90.0)     # settled at the packed speed first
    assert drv.finish(jobs[1]) == []


def test_driver_round_stops_jobs_left_out_and_counts_migrations():
    drv = _driver(per_node=1, nodes=2)
    a, b = JobState(1, 1, 0.0, 1e6, model="X"), JobState(2, 1, 0.0, 1e6, model="X")
    drv.submit(a)
    drv.schedule()
    assert drv.slots.gpus[1] == frozenset({(0, 0)})
    drv.advance(360.0)
    drv.submit(b)
    decision = drv.schedule()                      # no pair for X: b gets the other node
    assert decision.started == [b] and decision.stopped == []
    assert drv.nodes.migrations == 0 and a.migrations == 0
    c = JobState(3, 2, 0.0, 1e6, model="X")
    drv.advance(720.0)
    drv.submit(c)
    assert drv.schedule().stopped == []            # FIFO: c (2 GPUs) waits behind a and b


def test_packing_config_needs_rounds_and_node_placement():
    with pytest.raises(ValueError, match="round length"):
        DriverConfig(placement="tiresias", packing="tesserae")
    with pytest.raises(ValueError, match="node placement"):
        DriverConfig(placement="count", packing="tesserae", decide_every=360.0)
    with pytest.raises(ValueError, match="packing must be"):
        DriverConfig(placement="tiresias", packing="lucid", decide_every=360.0)
