"""dlrt_bench.migrate_noise: the no-migration pause statistic rebuilt from a stored
``autops bench migrate`` row, and how often a run without a pause would meet the goals."""
from __future__ import annotations

import json

import pytest

from dlrt_bench.migrate_noise import assess, figures, quiet_pauses, read_rows, summarize


def stored_row(comm_ms: list[float], moves: list[dict], mode: str = "sum", **extra) -> dict:
    """A row as ``autops bench migrate`` writes it, with what these functions read."""
    return {"benchmark": "migrate", "mode": mode, "site": "emulated", "comm_ms": [comm_ms, comm_ms],
            "per_repeat": moves, "pause_ms_per_repeat": [m.pop("pause_ms") for m in moves],
            "params": {"skip": 2, "gap": 4}, **extra}


def test_the_quiet_statistic_is_rebuilt_from_the_iterations_of_each_move():
    comm = [200.0] * 20
    comm[4] = 250.0                  # iteration 5: noise before the move
    comm[13] = 230.0                 # iteration 14: noise after it
    comm[9] = 400.0                  # iteration 10: the switch (not quiet)
    # the call came in iteration 8 (7 done), the move was done in iteration 9 (8 done), its
    # keys switched in iteration 10: the window is 8..10, the quiet stretches 4..7 and 11..14
    row = stored_row(comm, [{"iteration_at_call": 7, "iteration_at_done": 8, "switch_iterations": [10, 10],
                             "pause_ms": 200.0}])
    assert sorted(quiet_pauses(row)) == pytest.approx([0.0] * 6 + [30.0, 50.0])


def test_a_row_that_kept_its_quiet_values_is_taken_as_it_is_and_one_without_switches_is_skipped():
    row = stored_row([200.0] * 12, [{"iteration_at_call": 5, "iteration_at_done": 6, "switch_iterations": [7, 7],
                                     "pause_ms": 5.0}], quiet_pause_ms=[1.0, 2.0])
    assert quiet_pauses(row, "worker") == [1.0, 2.0]
    old = stored_row([200.0] * 12, [{"iteration_at_call": 5, "iteration_at_done": 6, "switch_iterations": None,
                                     "pause_ms": 5.0}])
    assert quiet_pauses(old) is None and assess(old) is None
    no_quiet = stored_row([200.0] * 12, [{"iteration_at_call": 5, "iteration_at_done": 6, "switch_iterations": [7, 7],
                                          "pause_ms": 5.0}], quiet_pause_ms=[])
    assert assess(no_quiet, "worker") is None
    assert assess({"benchmark": "pushpull"}) is None


def test_a_row_from_before_the_jobs_baseline_has_its_job_figures_rebuilt():
    # rank 0 waits 40 ms for rank 1 in every iteration; the switch (iteration 10) costs 10
    early, late = [240.0] * 20, [200.0] * 20
    early[9], late[9] = 250.0, 210.0
    row = {"benchmark": "migrate", "mode": "sum", "site": "emulated", "comm_ms": [early, late],
           "per_repeat": [{"iteration_at_call": 7, "iteration_at_done": 8, "switch_iterations": [10, 10]}],
           "pause_ms_per_repeat": [30.0], "quiet_pause_ms": [20.0] * 8, "params": {"skip": 2, "gap": 4}}
    assert figures(row, "worker") == ([30.0], [20.0] * 8)            # as stored
    pause, quiet = figures(row, "job")
    assert pause == [pytest.approx(10.0)] and quiet == pytest.approx([0.0] * 8)
    job, worker = assess(row, "job"), assess(row, "worker")
    assert job["met"]["all"] and not worker["met"]["median_pause_le_20ms"]
    assert job["quiet_median"] == pytest.approx(0.0) and worker["quiet_median"] == pytest.approx(20.0)


def test_a_row_with_the_jobs_baseline_is_read_as_stored_under_both():
    row = stored_row([200.0] * 12, [{"iteration_at_call": 5, "iteration_at_done": 6, "switch_iterations": [7, 7],
                                     "pause_ms": 5.0}], pause_baseline="job", quiet_pause_ms=[1.0, 2.0],
                     pause_vs_worker_ms_per_repeat=[25.0], quiet_pause_vs_worker_ms=[21.0, 22.0])
    assert figures(row, "job") == ([5.0], [1.0, 2.0])
    assert figures(row, "worker") == ([25.0], [21.0, 22.0])


def test_runs_are_summed_per_site_and_mode_against_what_no_pause_would_meet():
    quiet_low = [0.0, 5.0]           # a run of this noise meets every goal without a pause
    quiet_high = [0.0, 100.0]        # 1/16 of its four-move runs stay under 60 ms
    moves = lambda: [{"iteration_at_call": 5, "iteration_at_done": 6,  # noqa: E731
                      "switch_iterations": [7, 7], "pause_ms": p} for p in (10.0, 10.0, 70.0, 0.0)]
    rows = [stored_row([200.0] * 12, moves(), quiet_pause_ms=quiet_low),
            stored_row([200.0] * 12, moves(), quiet_pause_ms=quiet_high)]
    got = summarize(a for a in (assess(r, "worker") for r in rows) if a is not None)
    assert len(got) == 1 and got[0]["site"] == "emulated" and got[0]["mode"] == "sum" and got[0]["runs"] == 2
    assert got[0]["baseline"] == "worker"
    longest = got[0]["goals"]["max_pause_le_60ms"]
    assert longest["met"] == 0                                  # 70 ms in both
    assert longest["share_range"] == [pytest.approx(1 / 16, abs=0.01), 1.0]
    assert longest["expected_without_pause"] == 1.1                  # 1 + 1/16, to a tenth
    assert got[0]["goals"]["median_pause_le_20ms"]["met"] == 2
    assert got[0]["goals"]["all"]["met"] == 0


def test_result_files_are_read_as_json_lines_or_one_list(tmp_path):
    lines, listed = tmp_path / "a.json", tmp_path / "b.json"
    lines.write_text('{"x": 1}\n\n{"x": 2}\n')
    listed.write_text(json.dumps([{"x": 3}]))
    assert [r["x"] for r in read_rows([lines, listed])] == [1, 2, 3]


def test_the_iterations_around_each_switch_are_pooled_against_the_same_baseline():
    from dlrt_bench.migrate_noise import around_switch
    comm = [200.0] * 40
    comm[13] = 290.0                 # iteration 14: the old owners' last before the switch in 15
    comm[14] = 230.0                 # iteration 15: the switch
    comm[29] = 260.0                 # iteration 30: the second move's switch
    first = {"iteration_at_call": 11, "iteration_at_done": 15, "switch_iterations": [15, 15], "pause_ms": 30.0}
    later = {"iteration_at_call": 26, "iteration_at_done": 30, "switch_iterations": [30, 30], "pause_ms": 60.0}
    spanning = {"iteration_at_call": 33, "iteration_at_done": 36, "switch_iterations": [35, 36], "pause_ms": 0.0}
    row = stored_row(comm, [first, later, spanning])
    got = {g["move"]: g for g in around_switch([row, {"benchmark": "packing"}])}
    assert set(got) == {"first", "later"}           # a switch over two iterations is left out
    assert got["first"]["moves"] == got["later"]["moves"] == 1
    first_offsets = got["first"]["offsets"]
    assert first_offsets[-1]["median_ms"] == pytest.approx(90.0) and first_offsets[0]["median_ms"] == pytest.approx(30.0)
    assert first_offsets[-1]["share_over_60ms"] == 1.0 and first_offsets[0]["share_over_60ms"] == 0.0
    assert first_offsets[-2]["median_ms"] == pytest.approx(0.0)
    assert got["later"]["offsets"][0]["mean_ms"] == pytest.approx(60.0)
    assert sorted(first_offsets) == list(range(-5, 5))


def test_moves_are_pooled_against_the_stretches_without_a_migration_per_neighbour():
    from dlrt_bench.migrate_noise import against_noise
    noise = [float(x) for x in range(-40, 41, 4)]           # 21 values, median 0
    move = lambda ms: {"iteration_at_call": 5, "iteration_at_done": 6,  # noqa: E731
                       "switch_iterations": [7, 7], "pause_ms": ms}

    def run(pauses: list[float], other: str) -> dict:
        return stored_row([200.0] * 12, [move(p) for p in pauses], pause_baseline="job", quiet_pause_ms=noise,
                          params={"skip": 2, "gap": 4, "other": other})

    alone = [run(noise[i::3], "none") for i in range(3)]             # the moves drawn from the noise itself
    beside = [run([q + 50.0 for q in noise[i::3]], "resnet50") for i in range(3)]   # each move adds 50 ms
    got = {g["other"]: g for g in against_noise([*alone, *beside, {"benchmark": "packing"}])}
    assert set(got) == {"none", "resnet50"}
    assert got["none"]["runs"] == 3 and got["none"]["moves"] == 21 and got["none"]["quiet"] == 63
    assert got["none"]["shift_ms"] == pytest.approx(0.0) and got["none"]["p_value"] > 0.9
    assert got["none"]["share_over_60ms"] == got["none"]["quiet_share_over_60ms"] == 0.0
    assert got["resnet50"]["shift_ms"] == pytest.approx(50.0) and got["resnet50"]["p_value"] < 0.001
    assert got["resnet50"]["median_ms"] == pytest.approx(50.0) and got["resnet50"]["quiet_median_ms"] == 0.0
    assert got["resnet50"]["share_over_60ms"] == pytest.approx(8 / 21, abs=1e-3)     # 12 .. 40 plus 50
