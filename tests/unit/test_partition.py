import math

import pytest
from hypothesis import given, settings, strategies as st

from autops.master.assignment import bytes_per_aggregator, spread_by_bytes
from autops.wire.partition import (DEFAULT_PARTITION_BYTES, MIN_AUTO_PARTITION_BYTES, auto_partition_bytes,
                                   plan_keys, validate_tensor)

MiB = 1 << 20


def test_large_tensor_split_into_near_equal_partitions():
    keys = plan_keys([("w", (1000, 1100), "float32")], partition_bytes=1 << 20)   # 4.4 MB
    assert [k.key for k in keys] == [f"w#p{i}" for i in range(5)]
    sizes = [k.numel for k in keys]
    assert sum(sizes) == 1_100_000 and max(sizes) - min(sizes) <= 1
    assert all(k.nbytes <= 1 << 20 for k in keys)
    assert [k.offset for k in keys] == [sum(sizes[:i]) for i in range(5)]


def test_small_tensors_marked_for_batching_and_mid_sized_kept_whole():
    keys = {k.key: k for k in plan_keys([("bias", (10,), "float32"), ("mid", (64, 1024), "float32"),
                                         ("exact", (16384,), "float32")])}
    assert keys["bias"].small and not keys["mid"].small
    assert not keys["exact"].small          # 64 KiB exactly is not "under 64 KiB"
    assert keys["mid"].key == "mid" and keys["mid"].numel == 65536


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3_000_000)), min_size=1, max_size=8),
       st.integers(1 << 10, 4 << 20))
def test_partitions_cover_each_tensor_exactly(shapes, part):
    tensors = [(f"t{i}", s, "float32") for i, s in enumerate(shapes)]
    keys = plan_keys(tensors, partition_bytes=part)
    for name, shape, _ in tensors:
        mine = [k for k in keys if k.tensor == name]
        assert sum(k.numel for k in mine) == math.prod(shape)
        pos = 0
        for k in mine:
            assert k.offset == pos and k.nbytes <= max(part, 4)
            pos += k.numel


@pytest.mark.parametrize("model, aggregators, expected", [
    (64 * MiB, 4, 2 * MiB),        # flat64m on W=A=4: 8 partitions of 2 MiB per aggregator
    (64 * MiB, 2, 4 * MiB),        # on two aggregators 4 MiB already gives each 8
    (102_228_128, 4, 2 * MiB),     # resnet50 (97.5 MiB / 32 = 3.05 MiB: the power of two below)
    (548_317_152, 4, 4 * MiB),     # vgg19: never above 4 MiB
    (3 * MiB, 2, MIN_AUTO_PARTITION_BYTES),    # a small model: never below 1 MiB
    (0, 0, MIN_AUTO_PARTITION_BYTES),          # nothing declared yet, no aggregator yet
])
def test_auto_partition_gives_each_aggregator_eight_partitions_within_bounds(model, aggregators, expected):
    assert auto_partition_bytes(model, aggregators) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 40), st.integers(0, 64))
def test_auto_partition_is_a_power_of_two_in_range_and_fills_at_most_an_eighth(model, aggregators):
    part = auto_partition_bytes(model, aggregators)
    assert MIN_AUTO_PARTITION_BYTES <= part <= DEFAULT_PARTITION_BYTES and part & (part - 1) == 0
    if part > MIN_AUTO_PARTITION_BYTES:     # not held up by the floor: each aggregator gets 8 or more
        assert model // part >= 8 * max(1, aggregators)
    if part < DEFAULT_PARTITION_BYTES:      # not held down by the ceiling: twice the size would give fewer
        assert model // (2 * part) < 8 * max(1, aggregators)


@pytest.mark.parametrize("bad", [("", (1,), "float32"), ("a#b", (1,), "float32"), ("a", (-1,), "float32"),
                                 ("a", (2,), "complex64"), ("a", "2", "float32")])
def test_bad_tensor_declarations_rejected(bad):
    with pytest.raises(ValueError):
        validate_tensor(*bad)


def test_spread_largest_first_onto_least_loaded():
    keys = [("a", 70), ("b", 50), ("c", 40), ("d", 30), ("e", 10)]
    table = spread_by_bytes(keys, ["x", "y"])
    # a->x(70) b->y(50) c->y(90) d->x(100) e->y(100)
    assert table == {"a": "x", "b": "y", "c": "y", "d": "x", "e": "y"}
    assert bytes_per_aggregator(table, dict(keys)) == {"x": 100, "y": 100}


def test_spread_respects_existing_load_and_needs_aggregators():
    assert spread_by_bytes([("k", 5)], ["x", "y"], {"x": 10}) == {"k": "y"}
    with pytest.raises(ValueError):
        spread_by_bytes([("k", 5)], [])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=60), st.integers(1, 6))
def test_spread_is_within_the_lpt_bound(sizes, n):
    keys = [(f"k{i}", s) for i, s in enumerate(sizes)]
    aggs = [f"a{i}" for i in range(n)]
    loads = bytes_per_aggregator(spread_by_bytes(keys, aggs), dict(keys))
    total = sum(sizes)
    # greedy LPT: the fullest aggregator exceeds the average by at most the largest key
    assert max(loads.values()) <= total / n + max(sizes)
    assert set(loads) <= set(aggs)
