"""The DRF and Tetris allocators of Optimus' evaluation (tiresias/optimus/baselines.py, §6.1)."""
import math

import pytest

from tiresias.optimus.allocation import AllocJob, Demand
from tiresias.optimus.baselines import allocate_drf, allocate_tetris
from tiresias.optimus.speed import SpeedModel

GPU = Demand({"gpu": 1, "cpu": 1}, {"cpu": 1})
FLAT = lambda p, w: 1.0          # noqa: E731  (the baselines ignore what extra workers bring)
SQRT = lambda p, w: math.sqrt(w)   # noqa: E731


def job(job_id, remaining=1000.0, speed=FLAT, demand=GPU, **kw):
    return AllocJob(job_id, remaining, speed, demand, **kw)


@pytest.mark.parametrize("allocate", [allocate_drf, allocate_tetris])
def test_work_conserving_with_one_to_one_bundles(allocate):
    jobs = [job(1), job(2, max_workers=3), job(3)]
    alloc = allocate(jobs, {"gpu": 12, "cpu": 24})
    assert all(w == p for w, p in alloc.values())                  # ratio 1:1
    assert alloc[2][0] <= 3
    assert sum(w for w, _ in alloc.values()) == 12                # every GPU handed out, speed or not


@pytest.mark.parametrize("allocate", [allocate_drf, allocate_tetris])
def test_ratio_and_limits(allocate):
    alloc = allocate([job(1, max_workers=5, min_workers=2)], {"gpu": 100, "cpu": 100}, ratio=2)
    assert alloc[1] == (5, 3)
    assert allocate([job(1, max_aggregators=1)], {"gpu": 4, "cpu": 100})[1] == (4, 1)
    assert allocate([job(1, min_workers=5)], {"gpu": 4, "cpu": 100})[1] == (0, 0)
    with pytest.raises(ValueError):
        allocate([job(1)], {"gpu": 4, "cpu": 4}, ratio=0)


def test_drf_equalises_dominant_shares():
    cpu_heavy = job(1, demand=Demand({"gpu": 1, "cpu": 4}, {"cpu": 1}))
    gpu_heavy = job(2, demand=Demand({"gpu": 1, "cpu": 1}, {"cpu": 1}))
    alloc = allocate_drf([cpu_heavy, gpu_heavy], {"gpu": 30, "cpu": 60})
    # job 1's dominant share is CPU (5/60 a bundle), job 2's GPU (1/30 = 2/60 a bundle)
    share_1 = alloc[1][0] * 5 / 60
    share_2 = max(alloc[2][0] / 30, alloc[2][0] * 2 / 60)
    assert abs(share_1 - share_2) <= 5 / 60
    assert alloc[2][0] > alloc[1][0]


def test_drf_ties_by_job_id():
    alloc = allocate_drf([job(9), job(4), job(6)], {"gpu": 7, "cpu": 100})
    assert alloc == {4: (3, 3), 6: (2, 2), 9: (2, 2)}


def test_tetris_prefers_the_job_with_the_least_remaining_work():
    short = job(1, remaining=100.0, speed=SQRT)
    long = job(2, remaining=100000.0, speed=SQRT)
    alloc = allocate_tetris([long, short], {"gpu": 10, "cpu": 20})
    assert alloc[1][0] > alloc[2][0]
    drf = allocate_drf([long, short], {"gpu": 10, "cpu": 20})
    assert drf[1] == drf[2]                                       # DRF ignores job size


def test_tetris_packs_by_alignment_with_what_is_free():
    # equal remaining work and dominant share, room for one: the bundle that also uses the idle
    # GPUs aligns better with what is free (less fragmentation) and wins, though its id is larger
    cpu_only = job(1, demand=Demand({"cpu": 0.5}, {"cpu": 0.5}), max_workers=1)
    with_gpu = job(2, demand=Demand({"gpu": 1}, {"cpu": 1}), max_workers=1)
    alloc = allocate_tetris([cpu_only, with_gpu], {"gpu": 10, "cpu": 1.5})
    assert alloc == {1: (0, 0), 2: (1, 1)}


def test_tetris_gives_unknown_speed_jobs_the_leftovers_only():
    stalled = job(1, speed=lambda p, w: 0.0)
    ok = job(2, speed=SQRT, max_workers=3)
    alloc = allocate_tetris([stalled, ok], {"gpu": 5, "cpu": 10})
    assert alloc[2] == (3, 3) and alloc[1] == (2, 2)


def test_baselines_take_real_speed_models():
    jobs = [job(i, 1000.0 * (i + 1), SpeedModel(True, (0.01, 0.2, 0.3, 0.01, 0.01), 64).speed) for i in range(4)]
    for allocate in (allocate_drf, allocate_tetris):
        alloc = allocate(jobs, {"gpu": 16, "cpu": 32})
        assert sum(w for w, _ in alloc.values()) == 16
