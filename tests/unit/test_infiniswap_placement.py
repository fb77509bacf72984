"""Power of two choices with M_new before M_old (thesis §2.4.2), pure placement policy."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infiniswap import placement
from infiniswap.placement import DaemonView as D

SLAB = 1 << 30


def views():
    return [D("a", 5 * SLAB), D("b", 3 * SLAB), D("c", 9 * SLAB, has_my_slab=True),
            D("d", 7 * SLAB), D("e", 50 * SLAB, reachable=False)]


def test_split_excludes_unreachable_and_keeps_order():
    assert placement.split(views()) == (["a", "b", "d"], ["c"])
    assert placement.split(views(), exclude=["a"]) == (["b", "d"], ["c"])


def test_candidates_are_two_from_m_new_never_m_old():
    seen = set()
    for seed in range(200):
        got = placement.candidates(views(), random.Random(seed))
        assert len(got) == 2 and len(set(got)) == 2
        assert set(got) <= {"a", "b", "d"}
        seen.update(got)
    assert seen == {"a", "b", "d"}                      # every M_new daemon gets queried sometimes


def test_single_m_new_candidate_is_queried_alone():
    vs = [D("only", SLAB), D("old1", 10 * SLAB, True), D("old2", 10 * SLAB, True)]
    assert placement.candidates(vs, random.Random(0)) == ["only"]


def test_m_old_used_when_m_new_empty():
    vs = [D("x", SLAB, True), D("y", SLAB, True), D("z", SLAB, True)]
    got = placement.candidates(vs, random.Random(1))
    assert len(got) == 2 and set(got) <= {"x", "y", "z"}
    assert placement.candidates([D("x", SLAB, True)], random.Random(1)) == ["x"]


def test_no_reachable_daemon_gives_no_candidates():
    assert placement.candidates([D("x", SLAB, reachable=False)], random.Random(0)) == []
    assert placement.candidates([], random.Random(0)) == []
    assert placement.place([], SLAB, random.Random(0)) is None


def test_exclude_gives_the_next_stage():
    vs = [D("n1", 0), D("n2", 0), D("o1", 4 * SLAB, True), D("o2", 2 * SLAB, True)]
    first = placement.candidates(vs, random.Random(0))
    assert sorted(first) == ["n1", "n2"]
    assert sorted(placement.candidates(vs, random.Random(0), exclude=first)) == ["o1", "o2"]


def test_choose_the_freer_of_the_queried():
    assert placement.choose({"a": 5 * SLAB, "b": 3 * SLAB}, SLAB) == "a"
    assert placement.choose([("a", 2 * SLAB), ("b", 3 * SLAB)], SLAB) == "b"


def test_choose_ties_by_address_independent_of_order():
    assert placement.choose({"b": 4 * SLAB, "a": 4 * SLAB}, SLAB) == "a"
    assert placement.choose([("a", 4 * SLAB), ("b", 4 * SLAB)], SLAB) == "a"


def test_choose_none_fits_gives_none_and_exact_fit_counts():
    assert placement.choose({"a": SLAB - 1, "b": 0}, SLAB) is None
    assert placement.choose({}, SLAB) is None
    assert placement.choose({"a": SLAB, "b": SLAB - 1}, SLAB) == "a"
    with pytest.raises(ValueError):
        placement.choose({"a": 1}, 0)


def test_place_queries_two_and_takes_the_freer():
    free = {"a": 5 * SLAB, "b": 3 * SLAB, "d": 7 * SLAB}
    asked = []

    def query(addrs):
        asked.append(list(addrs))
        return {x: free[x] for x in addrs}

    got = placement.place_with(["a", "b", "d"], ["c"], query, SLAB, random.Random(3))
    assert len(asked) == 1 and len(asked[0]) == 2
    assert got == max(asked[0], key=lambda x: free[x])


def test_m_new_preferred_over_freer_m_old():
    vs = [D("new", 2 * SLAB), D("old", 100 * SLAB, has_my_slab=True)]
    for seed in range(20):
        assert placement.place(vs, SLAB, random.Random(seed)) == "new"
    # without the split, the freer daemon wins whatever holds this device's slabs
    assert placement.power_of_two_without_split(vs, SLAB, random.Random(0)) == "old"


def test_falls_back_to_m_old_when_m_new_candidates_are_full():
    vs = [D("n1", 0), D("n2", SLAB - 1), D("o1", 3 * SLAB, True), D("o2", 2 * SLAB, True)]
    assert placement.place(vs, SLAB, random.Random(0)) == "o1"


def test_none_fits_anywhere_gives_none():
    vs = [D("n1", 0), D("n2", 10), D("o1", SLAB - 1, True), D("u", 9 * SLAB, reachable=False)]
    assert placement.place(vs, SLAB, random.Random(0)) is None
    assert placement.power_of_two_without_split(vs, SLAB, random.Random(0)) is None
    assert placement.random_choice(vs, SLAB, random.Random(0)) is None


def test_same_seed_same_choice():
    vs = [D(f"m{i}", (i % 7 + 1) * SLAB) for i in range(50)]
    a = [placement.place(vs, SLAB, random.Random(s)) for s in range(30)]
    b = [placement.place(vs, SLAB, random.Random(s)) for s in range(30)]
    assert a == b


def test_random_choice_is_uniform_over_daemons_that_fit():
    vs = [D("full", 0), D("a", SLAB), D("b", 9 * SLAB, True), D("gone", 9 * SLAB, reachable=False)]
    counts = {}
    rng = random.Random(7)
    for _ in range(3000):
        x = placement.random_choice(vs, SLAB, rng)
        counts[x] = counts.get(x, 0) + 1
    assert set(counts) == {"a", "b"}
    assert abs(counts["a"] - 1500) < 200                 # ~ uniform, ignores free memory


def test_random_choice_attempts_bound_the_queries():
    asked = []

    def query(addrs):
        asked.extend(addrs)
        return {x: 0 for x in addrs}

    assert placement.random_choice_with(list(range(10)), query, SLAB, random.Random(0), attempts=2) is None
    assert len(asked) == 2
    with pytest.raises(ValueError):
        placement.random_choice_with([1], query, SLAB, random.Random(0), attempts=0)


def test_k_must_be_positive():
    with pytest.raises(ValueError):
        placement.candidates(views(), random.Random(0), k=0)


view_lists = st.lists(st.tuples(st.integers(0, 4), st.booleans(), st.booleans()), max_size=8)


@settings(max_examples=300, deadline=None)
@given(view_lists, st.integers(0, 2**32))
def test_place_property(rows, seed):
    vs = [D(f"m{i}", free * SLAB, old, reachable) for i, (free, old, reachable) in enumerate(rows)]
    got = placement.place(vs, SLAB, random.Random(seed))
    ok = {v.addr: v for v in vs if v.reachable and v.free_bytes >= SLAB}
    if got is not None:
        assert got in ok                                 # reachable and can hold a slab
    if not ok:
        assert got is None
    m_new = [v for v in vs if v.reachable and not v.has_my_slab]
    m_old = [v for v in vs if v.reachable and v.has_my_slab]
    if len(m_new) <= 2 and len(m_old) <= 2:              # everything is queried: the result is exact
        fit_new = [v for v in m_new if v.free_bytes >= SLAB]
        fit_old = [v for v in m_old if v.free_bytes >= SLAB]
        pool = fit_new or fit_old
        expect = min(pool, key=lambda v: (-v.free_bytes, v.addr)).addr if pool else None
        assert got == expect
