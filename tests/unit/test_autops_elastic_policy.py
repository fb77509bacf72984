"""Pure policy of AutoPS elasticity: pack_job, recycle, cyclic execution slots, cluster choice
and scaling decisions (thesis §4.3.3.2-5), on plain data."""
import pytest

from autops.master.assignment import busy_fraction, job_demand, pack_job, recycle
from autops.aggregator.cycle import CyclicSchedule
from autops.master.scaling import admissible, allocate_now, choose_cluster, cluster_free_cpu, idle_to_release


def names(i):
    return f"new-{i}"


# --- pack_job ------------------------------------------------------------------------------
def test_pack_job_consolidates_a_job_that_fits_one_aggregator():
    table, opened = pack_job("J", 10.0, [("a", 3.0), ("b", 2.0), ("c", 1.0)], {}, names)
    assert opened == ["new-0"] and set(table.values()) == {"new-0"}


def test_pack_job_opens_a_second_aggregator_when_the_cycle_is_full():
    table, opened = pack_job("J", 10.0, [("a", 6.0), ("b", 5.0), ("c", 1.0)], {}, names)
    assert opened == ["new-0", "new-1"]
    assert table == {"a": "new-0", "b": "new-1", "c": "new-0"}     # c best-fits next to a (3 free < 5)


def test_pack_job_shares_with_compatible_jobs_and_not_with_incompatible_ones():
    aggs = {"x": {"J1": (6.0, 2.0)}, "y": {"J0": (5.0, 1.0)}}
    # Fig. 4.6: J2 (D = 12, e = 3) joins J1; it would cost the 1-in-5 job 17% on y
    table, opened = pack_job("J2", 12.0, [("t", 3.0)], aggs, names)
    assert table == {"t": "x"} and opened == []


def test_pack_job_without_new_allocations_returns_none_when_something_does_not_fit():
    assert pack_job("J", 10.0, [("a", 6.0), ("b", 6.0)], {"x": {}}, names, allow_new=False) is None
    assert pack_job("J", 10.0, [("a", 6.0)], {"x": {}}, names, allow_new=False) == ({"a": "x"}, [])


def test_pack_job_does_not_modify_its_input():
    aggs = {"x": {"J1": (6.0, 2.0)}}
    pack_job("J2", 12.0, [("t", 3.0)], aggs, names)
    assert aggs == {"x": {"J1": (6.0, 2.0)}}


def test_pack_job_refuses_a_name_collision():
    with pytest.raises(ValueError):
        pack_job("J", 10.0, [("a", 9.0), ("b", 9.0)], {"new-0": {"K": (10.0, 9.5)}}, names)


# --- recycle ------------------------------------------------------------------------------
def test_recycle_frees_the_least_loaded_aggregator_whose_tasks_fit_elsewhere():
    aggs = {"x": {"A": (10.0, 3.0)}, "y": {"B": (10.0, 2.0)}, "z": {"C": (10.0, 8.0)}}
    tasks = {"x": [("A", "a1", 3.0)], "y": [("B", "b1", 2.0)], "z": [("C", "c1", 8.0)]}
    plan = recycle(aggs, tasks, {"A": 10.0, "B": 10.0, "C": 10.0})
    # y (20% busy) goes first: onto z (2 free) best fit; then x (30%) does not fit anywhere
    assert plan == [("y", {"b1": "z"})]


def test_recycle_chains_while_it_succeeds_and_respects_the_loss_limit():
    aggs = {"x": {"A": (10.0, 1.0)}, "y": {"B": (10.0, 1.0)}, "z": {"C": (10.0, 2.0)}}
    tasks = {n: [(j, j.lower(), e)] for n, (j, (d, e)) in ((n, next(iter(v.items()))) for n, v in aggs.items())}
    plan = recycle(aggs, tasks, {"A": 10.0, "B": 10.0, "C": 10.0})
    assert [v for v, _ in plan] == ["x", "y"]            # both fold into z
    # a job whose iteration is 5 with one that is 12 would lose 17%: nothing moves
    aggs = {"x": {"A": (5.0, 1.0)}, "y": {"B": (12.0, 1.0)}}
    tasks = {"x": [("A", "a", 1.0)], "y": [("B", "b", 1.0)]}
    assert recycle(aggs, tasks, {"A": 5.0, "B": 12.0}) == []
    assert recycle(aggs, tasks, {"A": 5.0, "B": 12.0}, exclude=["x"]) == []


def test_busy_fraction_and_demand():
    assert busy_fraction({}) == 0.0
    assert busy_fraction({"J1": (6.0, 2.0), "J2": (12.0, 3.0)}) == pytest.approx(7 / 12)
    assert job_demand(2.0, [0.5, 0.5]) == 0.5


# --- cyclic execution (Fig. 4.6 and outliers) -----------------------------------------------
def test_fig_4_6_cycle_is_12_and_j1_owns_two_slots():
    s = CyclicSchedule({"J1": (6.0, 2.0), "J2": (12.0, 3.0)}, start=0.0)
    assert s.cycle == 12.0 and s.slots["J1"].runs == 2 and s.slots["J2"].runs == 1
    assert s.admit("J1", 0.5) == 0.5          # slot 0 of J1, due by 6
    assert s.admit("J2", 1.0) == 1.0
    assert s.admit("J1", 6.5) == 6.5          # slot 1 of J1, due by 12
    assert s.late == 0


def test_a_late_request_runs_when_the_slack_holds_it():
    s = CyclicSchedule({"J1": (6.0, 2.0), "J2": (12.0, 3.0)}, start=0.0)
    s.admit("J2", 0.0)
    # J1's first request misses its slot (due by 6): 12 - 7 = 5 left, nothing reserved for J2
    assert s.admit("J1", 7.0) == 7.0 and s.late == 1 and s.postponed == 0


def test_a_late_request_is_postponed_when_it_would_eat_other_jobs_slots():
    s = CyclicSchedule({"J1": (6.0, 2.0), "J2": (12.0, 3.0)}, start=0.0)
    # J1 arrives at 10.5 (slot 0 was due by 6): 1.5 left in the cycle, J2 still owns 3 -> next cycle
    assert s.admit("J1", 10.5) == 12.0
    assert s.postponed == 1
    # in the next cycle it took J1's first slot: the next on-time request gets slot 1
    assert s.admit("J1", 13.0) == 13.0
    assert s.slots["J1"].used[1] == 2
    # a third one in that cycle is over budget; J2 still owns its 3 units: 24 - 14 - 3 = 7 >= 2
    assert s.admit("J1", 14.0) == 14.0 and s.late == 2


def test_unknown_jobs_run_at_once_and_empty_schedules_are_refused():
    s = CyclicSchedule({"J1": (6.0, 2.0), "J2": (12.0, 3.0)}, start=0.0)
    assert s.admit("other", 3.0) == 3.0
    with pytest.raises(ValueError):
        CyclicSchedule({}, start=0.0)


# --- clusters and scaling ------------------------------------------------------------------
def test_cluster_forwarding_picks_the_best_fit_by_free_cpu():
    c0 = {"a": {"J": (10.0, 9.0)}}                      # 0.1 free + 3 empty slots
    c1 = {"b": {"K": (10.0, 2.0)}, "c": {}}             # 0.8 + 1 + 2 slots
    free = {"c0": cluster_free_cpu(c0, 4), "c1": cluster_free_cpu(c1, 4)}
    assert free["c0"] == pytest.approx(3.1) and free["c1"] == pytest.approx(3.8)
    assert choose_cluster(free, 0.5) == "c0"
    assert choose_cluster(free, 3.5) == "c1"
    assert choose_cluster(free, 5.0) is None            # open a new cluster
    assert choose_cluster({}, 0.1) is None


def test_hybrid_scaling_and_admission_decisions():
    assert allocate_now(2, 2) and not allocate_now(1, 2) and not allocate_now(0, 1)
    assert idle_to_release({"a": {}, "b": {"J": (1.0, 0.1)}, "c": {}}, spare=1) == ["a"]
    assert idle_to_release({"a": {}, "c": {}}, spare=0) == ["a", "c"]
    assert admissible(2, 4, 2) and not admissible(3, 4, 2) and admissible(100, None, 50)


# --- recycle: properties over random pools ------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

from autops.master.assignment import final_moves, free_time, loss  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from([4.0, 5.0, 8.0, 10.0, 12.0]),
                                   st.floats(0.1, 3.0)), min_size=1, max_size=3),
                min_size=2, max_size=6))
def test_recycle_never_strands_a_task_on_a_freed_aggregator(pool):
    aggs, tasks, durations = {}, {}, {}
    for i, members in enumerate(pool):
        name = f"agg{i}"
        aggs[name], tasks[name] = {}, []
        for j, (d, e) in enumerate(members):
            job = f"J{i}-{j}"                       # the same task name in every job: ids must not collide
            durations[job] = d
            aggs[name][job] = (d, e)
            tasks[name].append((job, (job, "fc.weight"), e))
    plan = recycle(aggs, tasks, durations)
    freed = {victim for victim, _ in plan}
    placed = {t: a for a, items in tasks.items() for _, t, _ in items}
    placed.update(final_moves(plan))
    assert not freed & set(placed.values())
    # aggregators that received tasks stay within their cycle and the loss limit
    cost = {t: e for items in tasks.values() for _, t, e in items}
    final: dict = {}
    for (job, name), agg in placed.items():
        d, e = final.setdefault(agg, {}).get(job, (durations[job], 0.0))
        final[agg][job] = (d, e + cost[(job, name)])
    for agg in set(final_moves(plan).values()):
        jobs = final[agg]
        cycle = max(d for d, _ in jobs.values())
        assert free_time(cycle, jobs) >= -1e-9
        assert all(loss(d, cycle) < 0.1 for d, _ in jobs.values())
