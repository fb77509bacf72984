"""Tests for tiresias.gittins: hand-computed Gittins indices, vectorized == scalar,
closed-form properties, the beyond-history fallback and CSV loading."""
from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiresias.gittins import ServiceDistribution

YARN_1000 = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "tiresias" / "yarn-gput1000.csv"


def brute_index(samples, a: float, q: float, edge: str = "difference") -> float:
    """Direct, O(n) reading of the paper's ratio (no prefix sums, no search). In floating
    point a sample on the window's edge can be done by ``s - a <= Δ`` and not by
    ``s <= a + Δ``, or the other way (``a = 0.999, Δ = 0.001, s = 1.0``): ``edge`` picks the
    test of the code compared with -- ``"sum"`` for ``index`` (its window ``a < s <= a +
    Δ``), ``"difference"`` where ``Δ`` is itself ``s_k - a`` (``sup_index``)."""
    s = np.asarray(samples, dtype=np.float64)
    alive = s[s > a]
    if alive.size == 0:
        return 1.0 / q if math.isfinite(q) else 1.0 / max(a, float(s.max()))
    done = alive <= a + q if edge == "sum" else alive - a <= q
    p = np.mean(done)
    e = np.mean(np.where(done, alive - a, q))
    return float(p / e)


# ------------------------------------------------------------- hand values
SMALL = [1.0, 2.0, 3.0, 10.0]


@pytest.mark.parametrize(
    "a, q, expected",
    [
        # G(0, 2): S > 0 = {1,2,3,10}, n_gt = 4; done in (0,2] = {1,2} -> P = 2/4
        #   E = ((1-0) + (2-0) + 2*#{3,10}) / 4 = (1 + 2 + 4) / 4 = 7/4 -> G = (1/2)/(7/4) = 2/7
        (0.0, 2.0, 2.0 / 7.0),
        # G(1, 2): S > 1 = {2,3,10}, n_gt = 3; done in (1,3] = {2,3} -> P = 2/3
        #   E = ((2-1) + (3-1) + 2*#{10}) / 3 = (1 + 2 + 2) / 3 = 5/3 -> G = (2/3)/(5/3) = 2/5
        (1.0, 2.0, 2.0 / 5.0),
        # G(2, 8): S > 2 = {3,10}, n_gt = 2; done in (2,10] = {3,10} -> P = 1
        #   E = ((3-2) + (10-2)) / 2 = 9/2 -> G = 2/9
        (2.0, 8.0, 2.0 / 9.0),
        # G(5, 5): S > 5 = {10}; done in (5,10] = {10} (right end inclusive) -> P = 1
        #   E = (10-5) / 1 = 5 -> G = 1/5
        (5.0, 5.0, 1.0 / 5.0),
        # G(5, 4): S > 5 = {10}; nothing in (5,9] -> P = 0 -> G = 0 (E = 4)
        (5.0, 4.0, 0.0),
        # G(0, inf) = 1 / E[S] = 4 / 16
        (0.0, math.inf, 0.25),
        # G(2.5, inf): S > 2.5 = {3,10}; E[S - 2.5 | S > 2.5] = (0.5 + 7.5)/2 = 4 -> 1/4
        (2.5, math.inf, 0.25),
    ],
)
def test_hand_computed(a, q, expected):
    d = ServiceDistribution(SMALL)
    assert d.index(a, q) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert d.indices(np.array([a]), q)[0] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert brute_index(SMALL, a, q) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_hand_computed_sup():
    # Paper's sup over Δ for samples {4, 8, 12} (each 1/3), a = 0:
    #   Δ=4: P=1/3, E=(4+4+4)/3=4 -> 1/12; Δ=8: P=2/3, E=(4+8+8)/3=20/3 -> 1/10;
    #   Δ=12: P=1, E=8 -> 1/8.  sup = 1/8.
    d = ServiceDistribution([4, 8, 12])
    assert d.sup_index(0.0) == pytest.approx(1 / 8)
    # a = 4: alive {8,12}; Δ=4: P=1/2, E=(4+4)/2=4 -> 1/8; Δ=8: P=1, E=6 -> 1/6.  sup = 1/6.
    assert d.sup_index(4.0) == pytest.approx(1 / 6)
    # Ratio on a fine Δ grid never exceeds the sup, and the sup is reached.
    grid = np.linspace(1e-3, 20, 4001)
    vals = d.indices(np.full_like(grid, 4.0), grid)
    assert vals.max() <= d.sup_index(4.0) * (1 + 1e-12)
    assert vals.max() == pytest.approx(1 / 6)


# -------------------------------------------------- scalar vs. vectorized
_samples = st.lists(
    st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=60
)


@settings(max_examples=200, deadline=None)
@given(
    samples=_samples,
    attained=st.lists(st.floats(min_value=0, max_value=2e6, allow_nan=False), min_size=1, max_size=20),
    quantum=st.floats(min_value=1e-3, max_value=2e6, allow_nan=False, allow_infinity=False)
    | st.just(math.inf),
)
@example(samples=[1.0], attained=[0.999], quantum=0.001)      # a sample on the window's edge
def test_index_and_indices_agree(samples, attained, quantum):
    d = ServiceDistribution(samples)
    vec = d.indices(np.array(attained), quantum)
    assert vec.shape == (len(attained),)
    assert np.all(np.isfinite(vec)) and np.all(vec >= 0)
    for a, g in zip(attained, vec):
        assert d.index(a, quantum) == g  # same code path -> bit-identical
        ref = brute_index(samples, a, quantum, edge="sum")
        assert g == pytest.approx(ref, rel=1e-6, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    samples=_samples,
    pairs=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=2e6, allow_nan=False),
            st.floats(min_value=1e-3, max_value=2e6, allow_nan=False),
        ),
        min_size=1,
        max_size=20,
    ),
)
def test_indices_elementwise_quantum(samples, pairs):
    d = ServiceDistribution(samples)
    a = np.array([p[0] for p in pairs])
    q = np.array([p[1] for p in pairs])
    vec = d.indices(a, q)
    for ai, qi, g in zip(a, q, vec):
        assert d.index(float(ai), float(qi)) == g


def test_indices_broadcast_shape():
    d = ServiceDistribution(SMALL)
    out = d.indices(np.zeros((3, 1)), np.array([1.0, 2.0]))
    assert out.shape == (3, 2)
    assert out[0, 1] == pytest.approx(2 / 7)


# ------------------------------------------------------------- properties
@settings(max_examples=200, deadline=None)
@given(samples=_samples, extra=st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_full_quantum_from_zero_is_inverse_mean(samples, extra):
    d = ServiceDistribution(samples)
    q = max(samples) + extra
    assert d.index(0.0, q) == pytest.approx(1.0 / np.mean(samples), rel=1e-9)
    assert d.index(0.0, math.inf) == pytest.approx(1.0 / np.mean(samples), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(samples=_samples, a=st.floats(min_value=0, max_value=2e6, allow_nan=False))
@example(samples=[262145.912753386], a=1.1152176864270587)   # a + (s - a) < s in floating point
def test_sup_matches_brute_force(samples, a):
    d = ServiceDistribution(samples)
    s = np.sort(np.asarray(samples))
    alive = np.unique(s[s > a])
    if alive.size == 0:
        assert d.sup_index(a) == pytest.approx(1.0 / max(a, s[-1]))
        return
    best = max(brute_index(samples, a, float(x - a)) for x in alive if x - a > 0)
    assert d.sup_index(a) == pytest.approx(best, rel=1e-6)
    # sup dominates every fixed quantum
    for q in (1e-3, 1.0, 10.0, 1e3, 1e6, math.inf):
        assert d.index(a, q) <= d.sup_index(a) * (1 + 1e-9)


# --------------------------------------------------------------- fallback
@pytest.mark.parametrize("a", [10.0, 11.0, 1e9])
@pytest.mark.parametrize("q", [1e-6, 1.0, 5.0, 1e12, math.inf])
def test_fallback_beyond_history_finite_positive(a, q):
    d = ServiceDistribution(SMALL)
    g = d.index(a, q)
    assert math.isfinite(g) and g > 0
    v = d.indices(np.array([a, 0.0]), q)
    assert np.all(np.isfinite(v)) and v[0] == g
    assert d.sup_index(a) > 0 and math.isfinite(d.sup_index(a))
    if math.isfinite(q):
        assert g == pytest.approx(1.0 / q)  # documented: P = 1, E = quantum
    else:
        assert g == pytest.approx(1.0 / a)  # documented: E = attained


def test_no_nan_near_samples():
    # a just below a large sample with a tiny quantum: cancellation must not give NaN/negatives.
    d = ServiceDistribution([1.0, 53294624.0, 53294625.0])
    a = np.nextafter(53294624.0, 0)
    g = d.indices(np.array([a, 53294624.0]), np.array([1e-9, 1e-9]))
    assert np.all(np.isfinite(g)) and np.all(g >= 0)


@pytest.mark.parametrize("seed", range(20))
def test_full_precision_an_ulp_below_samples(seed):
    # Several samples an ulp above `attained`: E is ~1e-10 while the window sum is ~1e6;
    # the compensated prefix sums keep full relative precision.
    rng = np.random.default_rng(seed)
    base = float(rng.uniform(1, 1e6))
    s = np.concatenate([rng.uniform(1e-3, 1e6, size=30), [base] * 5, [np.nextafter(base, 2e6)] * 3])
    d = ServiceDistribution(s)
    a = float(np.nextafter(base, 0))
    for q in (1e-9, 1.0, 1e3, math.inf):
        assert d.index(a, q) == pytest.approx(brute_index(s, a, q), rel=1e-12)


# ------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", [[], [0.0], [1.0, -2.0], [1.0, float("nan")], [float("inf")]])
def test_bad_samples(bad):
    with pytest.raises(ValueError):
        ServiceDistribution(bad)


@pytest.mark.parametrize("a, q", [(-1.0, 1.0), (float("nan"), 1.0), (1.0, 0.0), (1.0, -1.0), (1.0, float("nan"))])
def test_bad_arguments(a, q):
    d = ServiceDistribution(SMALL)
    with pytest.raises(ValueError):
        d.index(a, q)
    with pytest.raises(ValueError):
        d.indices(np.array([a]), q)


def test_accepts_generator_and_array():
    a = ServiceDistribution(x for x in SMALL)
    b = ServiceDistribution(np.array(SMALL[::-1]))
    assert len(a) == len(b) == 4
    assert a.index(1.0, 2.0) == b.index(1.0, 2.0)
    assert a.mean == pytest.approx(4.0) and a.max == 10.0


# -------------------------------------------------------------------- CSV
def test_from_csv_yarn1000():
    assert YARN_1000.is_file(), YARN_1000
    lines = [ln for ln in YARN_1000.read_text().splitlines()[1:] if ln.strip()]
    d = ServiceDistribution.from_csv(YARN_1000)
    assert len(d) == len(lines) == 1001
    vals = np.array([float(x) for x in lines])
    assert d.mean == pytest.approx(vals.mean())
    assert d.samples[0] == vals.min() and d.max == vals.max()
    assert math.isfinite(d.index(0.0, 3600.0)) and d.index(0.0, 3600.0) > 0


def test_from_csv_crlf_and_blank_lines(tmp_path):
    f = tmp_path / "ok.csv"
    f.write_bytes(b"duration\r\n5\r\n\r\n7.5\r\n")
    d = ServiceDistribution.from_csv(str(f))
    assert list(d.samples) == [5.0, 7.5]


@pytest.mark.parametrize(
    "content, lineno",
    [
        ("duration\n10\nabc\n", 3),
        ("duration\n10\n20\n0\n", 4),
        ("duration\n-5\n", 2),
        ("duration\n1,2\n", 2),
        ("duration\n3\nnan\n", 3),
        ("duration\n3\n4\n5\ninf\n", 5),
    ],
)
def test_from_csv_bad_line(tmp_path, content, lineno):
    f = tmp_path / "bad.csv"
    f.write_text(content)
    with pytest.raises(ValueError, match=rf"bad\.csv:{lineno}\b"):
        ServiceDistribution.from_csv(f)


@pytest.mark.parametrize("content", ["", "duration\n", "duration\n\n\n"])
def test_from_csv_empty(tmp_path, content):
    f = tmp_path / "empty.csv"
    f.write_text(content)
    with pytest.raises(ValueError, match=r"empty\.csv"):
        ServiceDistribution.from_csv(f)


