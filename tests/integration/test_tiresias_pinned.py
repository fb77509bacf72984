"""The simulator's pinned figures (``bench/results/``) replayed by their own commands: every
count exact, every float within 1e-9. The quick files run here (the 60-job trace, the first
20,000 Philly jobs with and without ``--migrate``); the whole-trace ones take minutes and are
replayed by ``make check-pinned`` (``bench/tiresias_pinned.py``)."""
from __future__ import annotations

import pytest

from dlrt_bench.tiresias_pinned import differences, replay, select

QUICK = ["60job", "philly20k"]


@pytest.mark.parametrize("pinned", select(QUICK), ids=lambda p: p.name)
def test_pinned_simulator_figures_replay_unchanged(pinned):
    row = replay(pinned)
    assert row["differences"] == [], "\n".join(row["differences"][:20])


def test_the_comparison_sees_a_changed_count_and_skips_wall_times():
    pinned = {"avg_jct": 1.0, "events": 10, "sim_wall_seconds": 3.0, "rows": [{"preemptions": 4}]}
    assert differences(pinned, {**pinned, "sim_wall_seconds": 9.0}) == []
    assert differences(pinned, {**pinned, "avg_jct": 1.0 + 1e-12}) == []
    assert differences(pinned, {**pinned, "events": 11}) == ["/events: 10 pinned, 11 now"]
    assert differences(pinned, {**pinned, "rows": [{"preemptions": 5}]}) == ["/rows[0]/preemptions: 4 pinned, 5 now"]
    assert differences(pinned, {**pinned, "avg_jct": 1.001}) != []
