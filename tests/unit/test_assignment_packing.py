"""Pseudocode 3 (thesis §4.3.3.2) on the thesis' toy cases (Fig. 4.6)."""
import pytest

from autops.master.assignment import effective_iteration, free_time, loss, pack_task, runs_per_cycle


def test_fig_4_6_packing_j1_and_j2_gives_cycle_12_and_j1_runs_twice():
    # J1: D = 6, e = 2 alone on agg-0; J2: D = 12, e = 3 arrives
    aggs = {"agg-0": {"J1": (6.0, 2.0)}}
    assert pack_task("J2", 12.0, 3.0, aggs) == "agg-0"
    assert runs_per_cycle(6.0, 12.0) == 2 and effective_iteration(6.0, 12.0) == 6.0
    assert free_time(12.0, {"J1": (6.0, 2.0), "J2": (12.0, 3.0)}) == 12 - 2 * 2 - 3


def test_a_task_that_would_lose_17_percent_is_refused_at_loss_limit_0_1():
    # a 1-in-5 task (e = 1, D = 5): with J2 (D = 12) the cycle becomes 12, it runs twice,
    # its iteration becomes 6: (6 - 5) / 6 = 17% >= 10%
    assert loss(5.0, 12.0) == pytest.approx(1 / 6)
    assert pack_task("J2", 12.0, 3.0, {"agg-0": {"J0": (5.0, 1.0)}}) is None
    assert pack_task("J2", 12.0, 3.0, {"agg-0": {"J0": (5.0, 1.0)}}, loss_limit=0.2) == "agg-0"


def test_best_fit_and_new_aggregator_when_nothing_has_room():
    aggs = {"a": {"J1": (10.0, 7.0)}, "b": {"J3": (10.0, 4.0)}}
    assert pack_task("J2", 10.0, 2.0, aggs) == "a"          # 3 free beats 6 free
    assert pack_task("J2", 10.0, 5.0, aggs) == "b"          # only b holds 5
    assert pack_task("J2", 10.0, 7.0, aggs) is None         # nobody holds 7: a new aggregator
    assert pack_task("J2", 10.0, 1.0, {}) is None
