"""Optimus's PAA (autops/master/paa.py), MXNet's default split, Table 3's measures, and the
comparison bench's AutoPS plan and verdict (dlrt_bench/autops_paa.py)."""
import pytest
from hypothesis import given, settings, strategies as st

from autops.master.paa import assign_mxnet, assign_paa, measures
from dlrt_bench.autops_paa import autops_plan, blocks_of, compare, winner


def server_of(assignment, name):
    (server,) = {s for n, _, _, s in assignment if n == name}
    return server


def test_tiny_block_goes_to_fewest_requests_not_least_size():
    # avg 50, tiny < 2.5: a -> s0 (50, 1 request); b, c -> s1 (49, 2 requests); t: fewest requests
    out = assign_paa([("t", 1), ("c", 9), ("a", 50), ("b", 40)], 2, small_fraction=0.05)
    assert out == [("a", 0, 50, 0), ("b", 0, 40, 1), ("c", 0, 9, 1), ("t", 0, 1, 0)]


def test_mid_block_goes_to_the_best_fit():
    # avg 40: a -> s0 (room 10), b -> s1 (room 19); x (9) fits all three: the least room wins,
    # although s2 is both the least loaded and has the fewest requests
    blocks = [("a", 30), ("b", 21), ("x", 9)] + [(f"r{i}", 8) for i in range(7)] + [("q", 4)]
    out = assign_paa(blocks, 3)
    assert out[:3] == [("a", 0, 30, 0), ("b", 0, 21, 1), ("x", 0, 9, 0)]


def test_mid_block_that_fits_nowhere_goes_to_the_least_loaded():
    # avg 50: a -> s0 (room 1), b -> s1 (room 3); c (4) fits neither: s1 has fewer parameters
    # (requests tie, which would pick s0)
    out = assign_paa([("a", 49), ("b", 47), ("c", 4)], 2)
    assert server_of(out, "c") == 1


def test_block_over_avg_is_sliced_onto_the_least_loaded():
    out = assign_paa([("small", 70), ("big", 130)], 2)       # avg 100
    assert out == [("big", 0, 100, 0), ("big", 1, 30, 1), ("small", 0, 70, 1)]
    assert measures(out, 2) == {"size_imbalance": 0, "request_imbalance": 1, "total_requests": 3}


def test_slices_of_a_fractional_avg_are_whole_and_at_most_avg():
    out = assign_paa([("w", 100)], 3)                          # avg 33.3
    assert out == [("w", 0, 33, 0), ("w", 1, 33, 1), ("w", 2, 33, 2), ("w", 3, 1, 0)]


def test_paa_is_deterministic_and_ties_go_to_the_lowest_server():
    blocks = [(f"b{i}", 10) for i in range(6)]
    assert assign_paa(blocks, 3) == assign_paa(list(blocks), 3)
    assert assign_paa([("a", 10), ("b", 10)], 2) == [("a", 0, 10, 0), ("b", 0, 10, 1)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=40), st.integers(1, 16))
def test_paper_properties(sizes, servers):
    blocks = [(f"b{i}", s) for i, s in enumerate(sizes)]
    out = assign_paa(blocks, servers)
    avg = sum(sizes) / servers
    per_block = {}
    for name, index, size, server in out:
        assert 0 <= server < servers and size <= max(avg, 1)
        per_block.setdefault(name, []).append((index, size))
    # every block is covered exactly, its partitions numbered 0..n-1
    assert {n: sum(s for _, s in parts) for n, parts in per_block.items()} == dict(blocks)
    assert all([i for i, _ in parts] == list(range(len(parts))) for parts in per_block.values())
    if max(sizes) <= avg:
        # nothing sliced: one request per block, the minimum
        assert len(out) == len(blocks) and measures(out, servers)["total_requests"] == len(blocks)


def test_measures_count_empty_servers_and_reject_unknown_ones():
    out = [("a", 0, 5, 0), ("b", 0, 3, 0), ("c", 0, 2, 1)]
    assert measures(out, 3) == {"size_imbalance": 8, "request_imbalance": 2, "total_requests": 3}
    with pytest.raises(ValueError):
        measures(out, 1)


def test_mxnet_slices_big_blocks_evenly_and_places_small_ones_whole():
    out = assign_mxnet([("big", 10 ** 6 + 2), ("small", 999_999)], 4, seed=3)
    big = [(i, size, s) for n, i, size, s in out if n == "big"]
    assert [s for _, _, s in big] == [0, 1, 2, 3] and sum(size for _, size, _ in big) == 10 ** 6 + 2
    assert max(size for _, size, _ in big) - min(size for _, size, _ in big) == 1
    assert len([r for r in out if r[0] == "small"]) == 1
    assert assign_mxnet([(f"s{i}", 5) for i in range(50)], 4, seed=1) == \
        assign_mxnet([(f"s{i}", 5) for i in range(50)], 4, seed=1)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        assign_paa([("a", 1)], 0)
    with pytest.raises(ValueError):
        assign_paa([("a", -1)], 2)


def test_autops_plan_covers_every_tensor_on_the_given_aggregators():
    tensors = [("w", (1024, 1024), "float32"), ("b", (16,), "float32"), ("v", (3000,), "float32")]
    rows, partition, messages = autops_plan(tensors, 2)
    assert partition == 1 << 20                    # auto size: at least MIN_AUTO_PARTITION_BYTES
    assert {n: sum(s for m, _, s, _ in rows if m == n) for n, _, _ in tensors} == dict(blocks_of(tensors))
    assert sorted({s for *_, s in rows}) == [0, 1] and len([r for r in rows if r[0] == "w"]) == 4
    assert sum(messages) == 4 + len({s for n, _, _, s in rows if n in ("b", "v")})   # small keys batched


def test_winner_rule_orders_size_then_requests_then_request_imbalance():
    rows = {"mxnet": {"size_imbalance": 10, "total_requests": 5, "request_imbalance": 0},
            "paa": {"size_imbalance": 11, "total_requests": 2, "request_imbalance": 0},
            "autops": {"size_imbalance": 11, "total_requests": 2, "request_imbalance": 3}}
    assert winner(rows) == "mxnet"
    assert winner(rows, size_slack=1) == "paa"


def test_compare_gives_every_algorithm_the_measures():
    run = compare([("w", (600, 1000), "float32"), ("b", (1000,), "float32")], 4)
    assert set(run["algorithms"]) == {"mxnet", "paa", "autops"}
    assert run["algorithms"]["paa"]["total_requests"] == 5          # w in 4 partitions of avg, b whole
    assert run["winner"] in run["algorithms"] and run["params"] == 601_000
