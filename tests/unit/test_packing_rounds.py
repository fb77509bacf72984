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
    plan = plan_round(jobs, 2, 2, speeds, previous=previous, keep_in_place=False)
    assert plan.migrated == [] and plan.naive == [7, 8]       # planned on node 0, renamed to node 1
    assert plan.gpus() == {7: frozenset({(1, 0)}), 8: frozenset({(1, 1)})}
    kept = plan_round(jobs, 2, 2, speeds, previous=previous)  # by default they keep their GPUs
    assert kept.migrated == kept.naive == [] and kept.gpus() == plan.gpus()


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


# --- live: stops drain before their GPUs are reused; a migration is a stop and a restart ------

def _live(per_node=1, nodes=1, policy=None):
    from tiresias.policies.baselines import SRTF
    config = DriverConfig(placement="tiresias", packing="tesserae", decide_every=360.0, defer_release=True)
    return Driver(policy or SRTF(), ClusterSpec(nodes, per_node), config, sharing=KindSharing())


def test_live_round_packs_two_jobs_on_one_gpu_and_names_it():
    drv = _live()
    a, c = JobState(1, 1, 0.0, 1000.0, model="A"), JobState(2, 1, 0.0, 2000.0, model="C")
    drv.submit(a)
    drv.submit(c)
    decision = drv.schedule()
    assert {j.job_id for j in decision.started} == {1, 2}
    assert drv.gpu_ids(1) == drv.gpu_ids(2) == [(0, [0])]
    assert drv.used == 1 and drv.allocation(1) == [(0, 1)]


def test_live_a_planned_job_waits_for_the_stopped_run_on_its_gpu():
    drv = _live()
    long = JobState(1, 1, 0.0, 5000.0, model="X")          # X shares with nobody
    drv.submit(long)
    assert drv.schedule().started == [long]
    drv.advance(100.0)
    short = JobState(2, 1, 100.0, 10.0, model="X")
    drv.submit(short)
    assert drv.schedule().started == []                    # not a round yet: nothing moves
    drv.advance(360.0)
    decision = drv.schedule()                              # the round: SRTF puts the short job first
    assert decision.stopped == [long] and decision.started == []
    assert "released" in drv.reasons[2]
    drv.advance(361.0)
    assert drv.schedule().started == []                    # its GPU still drains
    drv.released(long)
    drv.advance(362.0)
    assert drv.schedule().started == [short] and drv.gpu_ids(2) == [(0, [0])]
    assert drv.used == 1


def test_live_a_migration_stops_the_run_and_restarts_it_on_the_new_gpus(monkeypatch):
    from tiresias import driver as drv_module
    from tiresias.packing.rounds import RoundPlan
    drv = _live(per_node=2)
    job = JobState(1, 1, 0.0, 5000.0, model="X")
    drv.submit(job)
    drv.schedule()
    assert drv.gpu_ids(1) == [(0, [0])]
    moved = RoundPlan([[frozenset(), frozenset({1})]], placed=[1], migrated=[1], naive=[1])
    monkeypatch.setattr(drv_module, "plan_round", lambda *a, **k: moved)
    drv.advance(360.0)
    decision = drv.schedule()
    assert decision.stopped == [job] and decision.started == []   # its run exits first
    assert job.migrations == 1 and drv.nodes.migrations == 1 and not job.running
    assert drv.gpu_ids(1) == [(0, [1])] and "released" in drv.reasons[1]
    drv.released(job)
    drv.advance(361.0)
    assert drv.schedule().started == [job]                       # restarted on GPU 1
    assert drv.used == 1 and drv.nodes.free == [1]


def test_live_a_cancelled_planned_job_leaves_the_plan():
    drv = _live()
    long = JobState(1, 1, 0.0, 5000.0, model="X")
    drv.submit(long)
    drv.schedule()
    drv.advance(360.0)
    short = JobState(2, 1, 100.0, 10.0, model="X")
    drv.submit(short)
    drv.schedule()                                          # the long one stops; the short one waits
    drv.withdraw(short)                                     # cancelled while it waited
    drv.released(long)
    assert 2 not in drv.slots.gpus and drv.schedule().started == []


# --- sharing under an allocation policy (simulator): the jobs it leaves out share GPUs ---------

def _first_fit():
    from tiresias.policies.elastic import AllocationPolicy

    class FirstFit(AllocationPolicy):
        """Rounds every 100 s: jobs in id order get their GPU count while GPUs last."""
        name = "first-fit"

        def __init__(self):
            super().__init__(interval=100.0)

        def allocations(self, now, capacity, per_node, keep):
            if now < self.next_round:
                return None
            self.next_round = now + self.interval
            out, free = dict(keep), capacity["gpu"]
            for job in sorted(self.active.values(), key=lambda j: j.job_id):
                if job.job_id not in keep and job.num_gpus <= free:
                    out[job.job_id] = (job.num_gpus, 1)
                    free -= job.num_gpus
            return out
    return FirstFit()


def test_an_allocation_round_packs_the_jobs_it_left_out():
    config = DriverConfig(placement="tiresias", packing="tesserae", decide_every=100.0)
    drv = Driver(_first_fit(), ClusterSpec(1, 1), config, sharing=KindSharing())
    a, c, x = (JobState(1, 1, 0.0, 1e4, model="A"), JobState(2, 1, 0.0, 1e4, model="C"),
               JobState(3, 1, 0.0, 1e4, model="X"))
    for job in (a, c, x):
        drv.submit(job)
    decision = drv.schedule()
    assert [j.job_id for j in decision.started] == [1, 2]        # a allocated, c packed on a's GPU
    assert (a.speed, c.speed) == (0.9, 0.8) and drv.used == 1 and not x.running
    drv.advance(50.0)
    assert drv.finish(c) == [a] and a.speed == 1.0 and drv.used == 1
    assert a.executed == pytest.approx(45.0)
    drv.advance(100.0)
    decision = drv.schedule()                                    # the next round: x shares nobody
    assert decision.started == [] and not x.running
    drv.advance(150.0)
    assert drv.finish(a) == [] and drv.used == 0


def test_a_host_that_ends_leaves_its_gpus_to_its_guest():
    config = DriverConfig(placement="tiresias", packing="gavel", decide_every=100.0)
    drv = Driver(_first_fit(), ClusterSpec(1, 1), config, sharing=KindSharing())
    a, c = JobState(1, 1, 0.0, 1e4, model="A"), JobState(2, 1, 0.0, 1e4, model="C")
    drv.submit(a)
    drv.submit(c)
    drv.schedule()
    drv.advance(10.0)
    assert drv.finish(a) == [c] and c.speed == 1.0 and drv.used == 1
    assert drv.nodes.alloc[2] == [(0, 1)] and drv.nodes.free == [0]
    drv.advance(100.0)
    decision = drv.schedule()                                    # c now holds the GPU as its own
    assert decision.stopped == [] and c.running and drv.used == 1
