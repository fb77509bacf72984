"""How the agent groups large keys' pushes of one burst (``autops.worker.coalesce``)."""
from __future__ import annotations

from autops.worker.coalesce import Coalescer

KIB = 1024


def test_a_burst_goes_in_groups_of_at_most_a_partition():
    c = Coalescer()
    sent = []
    for key, size in [("a", 100), ("b", 100), ("c", 56), ("d", 10), ("e", 200)]:
        sent += c.add("agg-0", key, size * KIB, key, 256 * KIB)
    assert sent == [["a", "b", "c"]], "a, b and c fill 256 KiB; d does not fit beside them"
    sent += [group for _, group in c.drain()]
    assert sent == [["a", "b", "c"], ["d", "e"]]
    assert not c and c.drain() == []


def test_a_push_of_a_whole_partition_goes_alone_and_after_the_open_group():
    c = Coalescer()
    assert c.add("agg-0", "a", 10, "a", 100) == []
    assert c.add("agg-0", "big", 100, "big", 100) == [["a"], ["big"]]
    assert not c


def test_a_key_waiting_already_closes_its_group_so_iterations_stay_in_order():
    c = Coalescer()
    assert c.add("agg-0", "k", 10, ("k", 1), 100) == []
    assert c.add("agg-0", "j", 10, ("j", 1), 100) == []
    assert c.add("agg-0", "k", 10, ("k", 2), 100) == [[("k", 1), ("j", 1)]]
    assert c.drain() == [("agg-0", [("k", 2)])]


def test_destinations_are_grouped_apart():
    c = Coalescer()
    c.add(("agg-0", "push_pull"), "a", 10, "a0", 100)
    c.add(("agg-1", "push_pull"), "a", 10, "a1", 100)
    c.add(("agg-0", "push"), "b", 10, "b0", 100)
    c.add(("agg-0", "push_pull"), "c", 10, "c0", 100)
    assert c.drain() == [(("agg-0", "push_pull"), ["a0", "c0"]), (("agg-1", "push_pull"), ["a1"]),
                         (("agg-0", "push"), ["b0"])]


def test_without_a_partition_size_nothing_is_grouped():
    c = Coalescer()
    assert c.add("agg-0", "a", 10, "a", 0) == [["a"]]
    assert not c
