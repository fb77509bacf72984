"""Batch eviction and the daemon's release/preallocation counts (thesis §2.5), pure policy."""
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infiniswap import eviction

SLAB = 1 << 30


def test_sample_draws_e_plus_e_prime_distinct_slabs():
    mapped = [("dev", i) for i in range(100)]
    got = eviction.sample(mapped, 10, 5, random.Random(0))
    assert len(got) == 15 and len(set(got)) == 15 and set(got) <= set(mapped)
    assert got == eviction.sample(mapped, 10, 5, random.Random(0))      # seeded, reproducible


def test_sample_all_when_fewer_mapped():
    assert sorted(eviction.sample([3, 1, 2], 2, 2, random.Random(0))) == [1, 2, 3]
    assert eviction.sample([], 2, 2, random.Random(0)) == []


def test_sample_of_a_set_does_not_depend_on_hash_order():
    s = {f"slab-{i}" for i in range(50)}
    assert eviction.sample(s, 3, 2, random.Random(5)) == eviction.sample(sorted(s), 3, 2, random.Random(5))


def test_choose_evicts_the_e_least_active():
    # Fig. 2.9b: the daemon asks about 3 slabs to evict 2
    activities = {("d1", 0): 35.0, ("d2", 4): 2.5, ("d3", 1): 0.0}
    assert eviction.choose(activities, 2) == [("d3", 1), ("d2", 4)]


def test_choose_e_of_e_plus_e_prime():
    acts = {i: float(a) for i, a in enumerate([9, 1, 7, 3, 8, 2, 6])}
    assert eviction.choose(acts, 3) == [1, 5, 3]
    assert eviction.choose(acts, 0) == []
    assert sorted(eviction.choose(acts, 10)) == sorted(acts)           # fewer than E: all


def test_choose_ties_by_key_deterministic():
    acts = {"c": 1.0, "a": 1.0, "b": 1.0, "z": 0.5}
    assert eviction.choose(acts, 3) == ["z", "a", "b"]
    assert eviction.choose(dict(reversed(list(acts.items()))), 3) == ["z", "a", "b"]


def test_choose_rejects_nan_and_bad_e():
    with pytest.raises(ValueError, match="NaN"):
        eviction.choose({1: float("nan")}, 1)
    with pytest.raises(ValueError):
        eviction.choose({1: 0.0}, -1)
    with pytest.raises(ValueError):
        eviction.sample([1], 1, -1, random.Random(0))


def test_random_evict_draws_e_distinct():
    got = eviction.random_evict(range(20), 5, random.Random(1))
    assert len(set(got)) == 5 and all(0 <= s < 20 for s in got)
    assert sorted(eviction.random_evict([1, 2], 5, random.Random(1))) == [1, 2]


def test_formula_values_by_hand():
    assert eviction.p_lightly_batch(0.5, 1, 1) == pytest.approx(0.75)
    # p_b = 0.2, E = 2, E' = 1: C(3,2) .8^2 .2 + .8^3 = .384 + .512
    assert eviction.p_lightly_batch(0.2, 2, 1) == pytest.approx(0.896)
    assert eviction.p_lightly_random(0.5, 3) == pytest.approx(0.125)
    assert eviction.p_lightly_random(0.1, 10) == pytest.approx(0.9 ** 10)


def test_formula_edges():
    for p in (0.0, 0.3, 1.0):
        assert eviction.p_lightly_batch(p, 10, 0) == pytest.approx(eviction.p_lightly_random(p, 10))
    assert eviction.p_lightly_batch(0.0, 10, 10) == pytest.approx(1.0)
    assert eviction.p_lightly_batch(1.0, 10, 10) == 0.0
    assert eviction.p_lightly_random(0.7, 0) == 1.0
    with pytest.raises(ValueError):
        eviction.p_lightly_random(1.5, 1)


def test_batch_beats_random_and_grows_with_e_prime():
    for p in (0.1, 0.3, 0.5, 0.7, 0.9):
        vals = [eviction.p_lightly_batch(p, 10, e2) for e2 in (0, 1, 5, 10)]
        assert vals == sorted(vals)
        assert vals[0] == pytest.approx(eviction.p_lightly_random(p, 10))
    # Fig. 2.7's message: at moderate load (p_b = 0.3) E' = 10 finds 10 light slabs almost surely
    assert eviction.p_lightly_batch(0.3, 10, 10) > 0.98 > 0.03 > eviction.p_lightly_random(0.3, 10)


def test_monte_carlo_agrees_with_batch_formula():
    rng = random.Random(42)
    p_b, E, E2, trials = 0.3, 5, 3, 4000
    population = range(10_000)
    n_busy = round(p_b * len(population))           # slab s is busy iff s < n_busy
    ok = 0
    for _ in range(trials):
        picked = eviction.sample(population, E, E2, rng)
        acts = {s: (50.0 + rng.random() if s < n_busy else rng.random()) for s in picked}
        ok += all(s >= n_busy for s in eviction.choose(acts, E))
    f = eviction.p_lightly_batch(p_b, E, E2)
    se = math.sqrt(f * (1 - f) / trials)
    assert abs(ok / trials - f) < 4 * se + 0.005     # 0.005: finite population (hypergeometric)


def test_release_nothing_at_or_above_headroom():
    assert eviction.slabs_to_release(8 * SLAB, 8 * SLAB, SLAB, 3) == (0, 0)
    assert eviction.slabs_to_release(20 * SLAB, 8 * SLAB, SLAB, 3) == (0, 0)


def test_release_unmapped_first_then_evict_mapped():
    # 2.5 slabs short -> 3 slabs: 1 unmapped then 2 mapped
    assert eviction.slabs_to_release(int(5.5 * SLAB), 8 * SLAB, SLAB, 1) == (1, 2)
    assert eviction.slabs_to_release(int(5.5 * SLAB), 8 * SLAB, SLAB, 5) == (3, 0)
    assert eviction.slabs_to_release(7 * SLAB + 1, 8 * SLAB, SLAB, 0) == (0, 1)
    assert eviction.slabs_to_release(0, 8 * SLAB, SLAB, 2, mapped_count=3) == (2, 3)   # capped


def test_preallocate_keeps_headroom():
    assert eviction.slabs_to_preallocate(int(10.5 * SLAB), 8 * SLAB, SLAB) == 2
    assert eviction.slabs_to_preallocate(8 * SLAB, 8 * SLAB, SLAB) == 0
    assert eviction.slabs_to_preallocate(2 * SLAB, 8 * SLAB, SLAB) == 0
    assert eviction.slabs_to_preallocate(20 * SLAB, 8 * SLAB, SLAB, allocated=4, limit=6) == 2
    assert eviction.slabs_to_preallocate(20 * SLAB, 8 * SLAB, SLAB, allocated=9, limit=6) == 0


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 64 * SLAB), st.integers(0, 16 * SLAB), st.integers(1, 4 * SLAB), st.integers(0, 20))
def test_preallocate_and_release_never_chase_each_other(free, headroom, slab, unmapped):
    n = eviction.slabs_to_preallocate(free, headroom, slab)
    after = free - n * slab
    assert after >= min(free, headroom)
    if n:
        assert eviction.slabs_to_release(after, headroom, slab, n) == (0, 0)
    u, m = eviction.slabs_to_release(free, headroom, slab, unmapped)
    if u or m:
        assert n == 0
        assert free + (u + m) * slab >= headroom     # releasing them restores HeadRoom
        assert u == min(unmapped, u + m)
