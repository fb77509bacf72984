"""Packing by maximum-weight matching (Tesserae Algorithm 4) and Gavel's greedy rule."""
import itertools
import random

import pytest

from tiresias.packing.matching import Candidate, edge, pack, pack_greedy, total_weight

# normalised speeds of (row kind, column kind) sharing GPUs; symmetric lookups below
TABLE = {
    ("A", "C"): (0.9, 0.5), ("A", "D"): (0.8, 0.8),
    ("B", "C"): (0.6, 0.7), ("B", "D"): (0.5, 0.4),
    ("A", "E"): (0.0, 0.0),                      # does not fit in GPU memory
}


def speeds(a, b):
    if (a, b) in TABLE:
        return TABLE[a, b]
    if (b, a) in TABLE:
        sb, sa = TABLE[b, a]
        return sa, sb
    return None


def c(job_id, kind, gpus=1, share=True):
    return Candidate(job_id, gpus, kind, share)


def brute_force(placed, pending):
    """The best total weight over every matching (small instances)."""
    best = 0.0
    for k in range(min(len(placed), len(pending)) + 1):
        for left in itertools.combinations(placed, k):
            for right in itertools.permutations(pending, k):
                w, ok = 0.0, True
                for a, b in zip(left, right):
                    e = edge(a, b, speeds)
                    if e is None:
                        ok = False
                        break
                    w += e[0] + e[1]
                if ok:
                    best = max(best, w)
    return best


def test_matching_beats_greedy_on_a_worked_example():
    # placed jobs 1 (A) and 2 (B); pending 3 (C) then 4 (D), in priority order. Greedy gives
    # C its best partner A (1.4) and leaves D with B (0.9: no gain, no edge): total 1.4.
    # The matching packs C with B (1.3) and D with A (1.6): total 2.9.
    placed, pending = [c(1, "A"), c(2, "B")], [c(3, "C"), c(4, "D")]
    greedy = pack_greedy(placed, pending, speeds)
    assert [(p.placed, p.pending) for p in greedy] == [(1, 3)]
    assert total_weight(greedy) == pytest.approx(1.4)
    best = pack(placed, pending, speeds)
    assert [(p.placed, p.pending) for p in best] == [(1, 4), (2, 3)]
    assert total_weight(best) == pytest.approx(2.9)
    assert best[0].placed_speed == 0.8 and best[1].pending_speed == 0.7


def test_no_edge_across_gpu_counts_or_for_jobs_that_must_not_share():
    assert edge(c(1, "A", gpus=2), c(2, "D", gpus=1), speeds) is None
    assert edge(c(1, "A"), c(2, "D", share=False), speeds) is None
    assert edge(c(1, "A", share=False), c(2, "D"), speeds) is None
    assert edge(c(1, "A"), c(2, "E"), speeds) is None           # out of memory (0.0)
    assert edge(c(1, "B"), c(2, "D"), speeds) is None           # 0.9: no better than alone
    assert edge(c(1, "A"), c(2, "Z"), speeds) is None           # unknown pair
    assert edge(c(1, "D"), c(2, "A"), speeds) == (0.8, 0.8)
    assert pack([c(1, "A", gpus=2)], [c(2, "D", gpus=1)], speeds) == []
    assert pack([c(1, "A")], [c(2, "D", share=False)], speeds) == []


def test_pairs_of_each_gpu_count_are_matched_apart():
    placed = [c(1, "A", 2), c(2, "B", 1)]
    pending = [c(3, "D", 2), c(4, "C", 1), c(5, "C", 2)]
    pairs = {(p.placed, p.pending) for p in pack(placed, pending, speeds)}
    assert pairs == {(1, 3), (2, 4)}


@pytest.mark.parametrize("seed", range(30))
def test_matching_is_maximum_weight(seed):
    rng = random.Random(seed)
    kinds = "ABCDE"
    placed = [c(i, rng.choice(kinds), rng.choice((1, 2)), rng.random() > 0.1) for i in range(rng.randint(0, 4))]
    pending = [c(10 + i, rng.choice(kinds), rng.choice((1, 2)), rng.random() > 0.1) for i in range(rng.randint(0, 4))]
    pairs = pack(placed, pending, speeds)
    assert total_weight(pairs) == pytest.approx(brute_force(placed, pending))
    assert len({p.placed for p in pairs}) == len(pairs) == len({p.pending for p in pairs})
    greedy = pack_greedy(placed, pending, speeds)
    assert total_weight(greedy) <= total_weight(pairs) + 1e-9
