"""Optimus' task placement (tiresias/optimus/placement.py, paper §4.2, Theorem 1, Fig. 10)."""
import copy

from hypothesis import given, settings, strategies as st

from tiresias.optimus.allocation import Demand
from tiresias.optimus.placement import even_split, place_jobs, transfer_time

SLOT = Demand({"slot": 1}, {"slot": 1})
GPU = Demand({"gpu": 1, "cpu": 1}, {"cpu": 1})


def test_fig10_transfer_times():
    # 3 servers of 3 slots, 2 ps + 4 workers; (node, workers, ps)
    a = [(0, 1, 1), (1, 1, 1), (2, 2, 0)]       # ps1, ps2: 3 each; workers 1, 1, 2, 2
    b = [(0, 1, 2), (1, 3, 0)]                  # both ps with one worker: 3 each
    c = [(0, 2, 1), (1, 2, 1)]
    assert transfer_time(a) == 3 and transfer_time(b) == 3 and transfer_time(c) == 2
    assert transfer_time(c, bandwidth=2.0, unit=3.0) == 3.0
    assert transfer_time([(0, 4, 2)]) == 0
    assert transfer_time([(0, 2, 1), (0, 2, 1)]) == 0          # entries of one node merge


def test_place_jobs_picks_the_fig10_optimum():
    free = [{"slot": 3}] * 3
    placed = place_jobs({1: (4, 2)}, {1: SLOT}, free)
    assert sorted(placed[1]) == [(0, 2, 1), (1, 2, 1)]
    assert transfer_time(placed[1]) == 2


def test_fewest_nodes_first_and_pure():
    free = [{"gpu": 4, "cpu": 8} for _ in range(4)]
    before = copy.deepcopy(free)
    placed = place_jobs({1: (4, 4), 2: (6, 3)}, {1: GPU, 2: GPU}, free)
    assert free == before
    assert len(placed[1]) == 1                                   # fits one node: one node
    assert sorted((w, p) for _, w, p in placed[2]) == [(3, 1), (3, 2)]   # two nodes, even
    assert {n for n, _, _ in placed[1]}.isdisjoint({n for n, _, _ in placed[2]})


def test_smallest_job_first_and_a_job_that_fits_nowhere_is_left_out():
    free = [{"gpu": 4, "cpu": 8}, {"gpu": 4, "cpu": 8}]
    placed = place_jobs({1: (6, 2), 2: (3, 1), 3: (0, 0)}, {1: GPU, 2: GPU, 3: GPU}, free)
    assert set(placed) == {2}                       # the small one first; the big one no longer fits
    assert place_jobs({1: (20, 1)}, {1: GPU}, free) == {}


def test_nodes_are_resorted_by_availability_after_each_job():
    free = [{"gpu": 4, "cpu": 8}, {"gpu": 4, "cpu": 8}, {"gpu": 2, "cpu": 4}]
    placed = place_jobs({1: (1, 1), 2: (2, 1), 3: (2, 2)}, {j: GPU for j in (1, 2, 3)}, free)
    assert placed[1] == [(0, 1, 1)]                 # the most available node, lowest index on a tie
    assert placed[2] == [(1, 2, 1)]                 # node 0 is less available now
    assert placed[3] == [(0, 2, 2)]                 # node 0 (3 GPUs, 6 CPUs left) is now ahead of node 1


def test_aggregators_move_to_other_nodes_when_colocation_does_not_fit():
    placed = place_jobs({1: (2, 1)}, {1: SLOT}, [{"slot": 1}] * 3)
    assert sorted(placed[1]) == [(0, 1, 0), (1, 1, 0), (2, 0, 1)]


def test_even_split():
    assert even_split(7, 3) == [3, 2, 2]
    assert even_split(2, 4) == [1, 1, 0, 0]
    assert sum(even_split(11, 5)) == 11


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8)), min_size=1, max_size=8))
def test_placements_fit_match_the_allocation_and_are_even(sizes, nodes):
    alloc = {i: s for i, s in enumerate(sizes)}
    free = [{"gpu": g, "cpu": c} for g, c in nodes]
    placed = place_jobs(alloc, {i: GPU for i in alloc}, free)
    use = [{"gpu": 0, "cpu": 0} for _ in free]
    for job_id, parts in placed.items():
        w, p = alloc[job_id]
        assert sum(x for _, x, _ in parts) == w and sum(y for _, _, y in parts) == p
        assert len({n for n, _, _ in parts}) == len(parts)
        for counts in ([x for _, x, _ in parts], [y for _, _, y in parts]):
            assert max(counts) - min(counts) <= 1
        for n, x, y in parts:
            use[n]["gpu"] += x
            use[n]["cpu"] += x + y
    for u, f in zip(use, free):
        assert u["gpu"] <= f["gpu"] and u["cpu"] <= f["cpu"]
    assert all(alloc[j] != (0, 0) for j in placed)
