"""``autops.master.assignment.rebalance``: a job's keys moved onto another set of aggregators (its
aggregator count changed by the scheduler) with few moves and bytes balanced."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from autops.master.assignment import rebalance


def _loads(table, sizes):
    out = {}
    for k, a in table.items():
        out[a] = out.get(a, 0) + sizes[k]
    return out


def test_rebalance_onto_more_aggregators_moves_only_what_balances():
    sizes = {"a": 40, "b": 30, "c": 20, "d": 10}
    table = {k: "agg-1" for k in sizes}
    out = rebalance(table, sizes, ["agg-1", "agg-2"])
    assert _loads(out, sizes) == {"agg-1": 50, "agg-2": 50}
    assert sum(out[k] != table[k] for k in sizes) == 2          # a (40) then d (10) move


def test_rebalance_onto_fewer_keeps_the_keys_of_the_kept_aggregators():
    sizes = {"a": 10, "b": 10, "c": 10}
    table = {"a": "agg-1", "b": "agg-2", "c": "agg-3"}
    out = rebalance(table, sizes, ["agg-1", "agg-2"])
    assert out["a"] == "agg-1" and out["b"] == "agg-2" and out["c"] in ("agg-1", "agg-2")
    with pytest.raises(ValueError):
        rebalance(table, sizes, [])


def test_rebalance_of_a_balanced_table_moves_nothing():
    sizes = {"a": 5, "b": 5}
    table = {"a": "x", "b": "y"}
    assert rebalance(table, sizes, ["x", "y"]) == table


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 4), st.integers(1, 6))
def test_rebalance_is_within_the_largest_key_of_balanced(sizes_list, before, after):
    sizes = {f"k{i}": s for i, s in enumerate(sizes_list)}
    table = {k: f"agg-{i % before}" for i, k in enumerate(sizes)}
    targets = [f"agg-{i}" for i in range(after)]
    out = rebalance(table, sizes, targets)
    assert set(out) == set(sizes) and set(out.values()) <= set(targets)
    loads = {a: 0 for a in targets} | _loads(out, sizes)
    # no key of the heaviest is smaller than its gap to the lightest: the gap is at most the largest key
    assert max(loads.values()) - min(loads.values()) <= max(sizes.values())
    # a second pass over the same targets moves nothing (it stopped at a fixed point)
    assert rebalance(out, sizes, targets) == out
