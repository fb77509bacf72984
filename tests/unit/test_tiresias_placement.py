"""Placement (PACKLIMIT consolidation, fragmentation), Tesserae matching, overhead models in the engine."""
from dataclasses import dataclass

import pytest

from tiresias import overheads as ovh
from tiresias import placement as plc
from tiresias.cluster import ClusterSpec
from tiresias.policies.baselines import FIFO
from tiresias.policies.las import DiscretizedLAS
from tiresias.sim import SimConfig, simulate


@dataclass
class J:
    job_id: int
    submit_time: float
    num_gpus: int
    duration: float
    model: str | None = None
    skew: float | None = None


def test_best_fit_on_one_node_when_it_fits():
    assert plc.place([4, 2, 3], 2, consolidate=False, gpus_per_node=4) == [(1, 2)]
    assert plc.place([4, 2, 3], 3, consolidate=True, gpus_per_node=4) == [(2, 3)]


def test_consolidated_job_needs_the_fewest_nodes_or_waits():
    # 8 GPUs on 4-GPU nodes: two whole nodes; with only holes free it cannot be consolidated
    assert sorted(plc.place([4, 1, 4, 2], 8, consolidate=True, gpus_per_node=4)) == [(0, 4), (2, 4)]
    assert plc.place([3, 3, 2], 8, consolidate=True, gpus_per_node=4) is None
    # a low-skew job takes the smallest holes first and leaves whole nodes free
    alloc = plc.place([4, 1, 4, 2, 3], 6, consolidate=False, gpus_per_node=4)
    assert alloc == [(1, 1), (3, 2), (4, 3)]
    assert plc.place([1, 1], 3, consolidate=False, gpus_per_node=4) is None


def test_needs_consolidation_by_packlimit_and_table_skew():
    from tiresias.cluster import skew_of
    assert plc.needs_consolidation(skew_of("vgg19", None), plc.DEFAULT_PACKLIMIT)
    assert not plc.needs_consolidation(skew_of("resnet50", None), plc.DEFAULT_PACKLIMIT)


def test_tesserae_relabeling_avoids_migrations_a_naive_plan_would_make():
    # the new plan is the old one with nodes 0 and 1 swapped: renaming moves nothing
    old = {1: [(0, 2)], 2: [(0, 2)], 3: [(1, 4)]}
    new = {1: [(1, 2)], 2: [(1, 2)], 3: [(0, 4)]}
    relabel, moved, naive = plc.migration_plan(old, new, nodes=2)
    assert relabel == [1, 0] and moved == 0 and naive == 3


def test_tesserae_relabeling_moves_only_what_must_move():
    # job 3 must join job 1's node in the new plan; at best one job moves
    old = {1: [(0, 2)], 2: [(1, 2)], 3: [(2, 2)]}
    new = {1: [(2, 2)], 3: [(2, 2)], 2: [(0, 2)]}
    relabel, moved, naive = plc.migration_plan(old, new, nodes=3)
    assert moved == 1 and naive == 2
    assert relabel[2] in (0, 2)   # new node 2 (jobs 1, 3) keeps job 1 or job 3 in place


def test_repack_places_consolidated_jobs_first():
    plan = plc.repack([(1, 2, False), (2, 4, True), (3, 2, False)], nodes=2, gpus_per_node=4)
    assert plan[2] == [(0, 4)] and sum(g for _, g in plan[1] + plan[3]) == 4
    assert plc.repack([(1, 4, True), (2, 4, True), (3, 1, False)], nodes=2, gpus_per_node=4) is None


def test_overhead_model_magnitudes():
    assert ovh.pause_seconds("vgg19", 8) == pytest.approx(1.0 + 548.1 / 1200)
    assert ovh.resume_seconds("vgg19", 8) == pytest.approx(5.0 + 548.1 / 1200 + 4.0)
    assert ovh.resume_seconds("unknown-model", 1) == pytest.approx(5.0 + 230 / 1200 + 0.5)
    assert ovh.placement_speed(0.715, consolidated=False) == pytest.approx(1 - 0.55 * 0.715)
    assert ovh.placement_speed(0.715, consolidated=True) == 1.0


def test_preemption_overhead_is_charged_on_resume():
    # 1 GPU; A (long) runs, B arrives and preempts it after A is demoted; A resumes later and pays
    trace = [J(0, 0, 1, 100, model="vgg19"), J(1, 10, 1, 5, model="vgg19")]
    cluster = ClusterSpec(1, 1)
    plain = simulate(trace, cluster, DiscretizedLAS(thresholds=[5.0]), config=SimConfig("tiresias"))
    charged = simulate(trace, cluster, DiscretizedLAS(thresholds=[5.0]),
                       config=SimConfig("tiresias", overheads=True))
    a_plain = next(j for j in plain.jobs if j.job_id == 0)
    a_charged = next(j for j in charged.jobs if j.job_id == 0)
    assert a_plain.preemptions == a_charged.preemptions == 1
    cost = ovh.preemption_cost("vgg19", 1)
    assert a_charged.end_time == pytest.approx(a_plain.end_time + cost)
    assert charged.overhead_seconds == pytest.approx(cost)


def test_unconsolidated_skewed_job_runs_slower():
    trace = [J(0, 0, 2, 1000, model="resnet50"), J(1, 0, 2, 1000, model="resnet50"),
             J(2, 1, 4, 100, model="vgg19")]
    cluster = ClusterSpec(2, 4)
    spread = simulate(trace, cluster, FIFO(), config=SimConfig("spread", slowdown=True))
    vgg = next(j for j in spread.jobs if j.job_id == 2)
    # the two resnet jobs take node 0 whole (best fit), so vgg fits on node 1: consolidated
    assert vgg.end_time == pytest.approx(101)
    trace = [J(0, 0, 3, 1000, model="resnet50"), J(1, 0, 3, 1000, model="resnet50"),
             J(2, 1, 2, 100, model="vgg19")]
    spread = simulate(trace, cluster, FIFO(), config=SimConfig("spread", slowdown=True))
    vgg = next(j for j in spread.jobs if j.job_id == 2)
    assert vgg.end_time == pytest.approx(1 + 100 / ovh.placement_speed(0.715, False))
    # the same job under tiresias placement must be consolidated: it waits for a whole node
    packed = simulate(trace, cluster, FIFO(), config=SimConfig("tiresias", slowdown=True))
    vgg = next(j for j in packed.jobs if j.job_id == 2)
    assert vgg.first_start == pytest.approx(1000) and vgg.end_time == pytest.approx(1100)
    assert packed.placement_waits > 0


def test_migration_unblocks_a_consolidated_job():
    # 3 nodes x 4: A(2) -> node 0, B(3) -> node 1, C(3) -> node 2 leave holes of 2, 1, 1; a
    # 4-GPU vgg job fits by count but not on one node. Without migration it waits for a job to
    # end; with it the running jobs are repacked and renamed so that only A moves.
    trace = [J(0, 0, 2, 1000, model="resnet50"), J(1, 0, 3, 1000, model="resnet50"),
             J(2, 0, 3, 1000, model="resnet50"), J(3, 2, 4, 50, model="vgg19")]
    cluster = ClusterSpec(3, 4)
    waited = simulate(trace, cluster, FIFO(), config=SimConfig("tiresias"))
    moved = simulate(trace, cluster, FIFO(), config=SimConfig("tiresias", migrate=True, overheads=True))
    assert next(j for j in waited.jobs if j.job_id == 3).first_start == pytest.approx(1000)
    assert next(j for j in moved.jobs if j.job_id == 3).first_start == pytest.approx(2)
    assert moved.repacks == 1 and moved.migrations == 1
    a = next(j for j in moved.jobs if j.job_id == 0)
    assert a.migrations == 1 and a.overhead == pytest.approx(ovh.preemption_cost("resnet50", 2))
    assert a.end_time == pytest.approx(1000 + a.overhead)      # 2 s, the stall, then the other 998 s


def test_no_node_over_allocated_on_a_random_trace():
    import random
    rng = random.Random(5)
    models = ["vgg19", "resnet50", "alexnet", "googlenet", None]
    trace = [J(i, rng.uniform(0, 2000), rng.choice([1, 1, 2, 4, 8, 16]), rng.uniform(10, 900),
               model=rng.choice(models)) for i in range(300)]
    for mode, migrate in (("tiresias", False), ("tiresias", True), ("consolidate", False), ("spread", False)):
        res = simulate(trace, ClusterSpec(4, 8), DiscretizedLAS(), config=SimConfig(mode, overheads=True,
                                                                                       slowdown=True, migrate=migrate))
        assert all(j.end_time is not None and j.end_time - j.submit_time >= j.duration - 1e-6 for j in res.jobs)


def test_most_free_takes_from_the_node_with_the_most_free_gpus_first():
    # Pollux's simulator's placement: worst fit, spilling to the next most-free node
    assert plc.place_most_free([1, 3, 2, 3], 2) == [(1, 2)]          # ties: the lowest index
    assert plc.place_most_free([1, 3, 2, 0], 5) == [(1, 3), (2, 2)]
    assert plc.place_most_free([1, 0, 1], 3) is None
    with pytest.raises(ValueError):
        plc.place_most_free([4], 0)


def test_most_free_placement_in_the_driver_spreads_where_best_fit_would_not():
    from tiresias.driver import Driver, DriverConfig
    from tiresias.policies.base import JobState

    def placed(mode):
        drv = Driver(FIFO(), ClusterSpec(2, 4), DriverConfig(mode), start=0.0)
        for job_id, gpus in ((0, 1), (1, 2)):
            drv.submit(JobState(job_id, gpus, 0.0, 100.0, wait_since=0.0))
        drv.schedule()
        return {job_id: drv.allocation(job_id) for job_id in (0, 1)}

    assert placed("spread") == {0: [(0, 1)], 1: [(0, 2)]}          # best fit: node 1 stays whole
    assert placed("most-free") == {0: [(1, 1)], 1: [(0, 2)]}       # worst fit, as Pollux's simulator
    with pytest.raises(ValueError):
        DriverConfig("nowhere")
