"""A job's progress reports: ``tiresias.job.report`` buffers and appends lines, the master
reads them in bounded chunks (``JobProgress``) whatever the job wrote, and shows them."""
from __future__ import annotations

import os

import pytest

from tiresias import job as tjob
from tiresias.job import ProgressWriter
from tiresias.service.jobprogress import MAX_LINE, JobProgress

from test_tiresias_master import make, spec


def test_lines_cut_across_chunks_are_put_together():
    p = JobProgress()
    data = b"100.0 10 2.5\n101.0 20 2.0\n102.0 30 1.5\n"
    for i in range(0, len(data), 7):                 # chunks that cut lines anywhere
        p.feed(data[i:i + 7])
    assert p.points == [(10.0, 2.5), (20.0, 2.0), (30.0, 1.5)]
    assert (p.step, p.loss, p.offset, p.malformed) == (30.0, 1.5, len(data), 0)
    assert p.steps_per_s() == pytest.approx(10.0)
    assert p.take_new_points() == p.points and p.take_new_points() == []


def test_what_a_job_may_write_is_counted_and_skipped():
    p = JobProgress()
    p.feed(b"garbage\n1 2 3 4\n5 nan 1\n6 -1 1\n7 8 inf\n" + b"9" * (MAX_LINE + 1) + b" 1\n10 11 0.5\n")
    assert p.points == [(11.0, 0.5)] and p.malformed == 6
    p.feed(b"1" * (MAX_LINE + 5))                    # no newline for too long
    assert p.malformed == 7
    p.feed(b"\n12 13 0.25\n")
    assert p.step == 13.0


def test_points_are_thinned_not_unbounded_and_a_resumed_run_restarts_the_speed():
    p = JobProgress(max_points=8)
    p.feed("".join(f"{t} {t * 10} {1 / (t + 1)}\n" for t in range(20)).encode())
    assert len(p.points) <= 8 and p.points[0][0] == 0.0 and p.points[-1][0] >= 150.0
    p.feed(b"100 50 0.3\n")                          # back to an earlier step (a checkpoint)
    assert p.steps_per_s() is None
    p.feed(b"102 70 0.29\n")
    assert p.steps_per_s() == pytest.approx(10.0)


def test_the_writer_buffers_flushes_and_stops_at_its_limit(tmp_path):
    path = tmp_path / "progress"
    w = ProgressWriter(str(path), every=3600.0, limit=60)
    w.add(1, 0.5)
    w.add(2.5)
    assert not path.exists()                         # buffered
    w.flush()
    lines = path.read_text().splitlines()
    assert [line.split()[1:] for line in lines] == [["1", "0.5"], ["2.5"]]
    w.add(3, float("nan"))                           # a diverged step is not reported
    for step in range(4, 20):
        w.add(step, 0.1)
    w.flush()
    assert path.read_text() == "\n".join(lines) + "\n"          # past the limit: dropped
    with pytest.raises(ValueError, match="step"):
        w.add(-1)
    ProgressWriter(None).add(1, 1.0)                 # outside Tiresias: nothing


def test_report_writes_only_on_rank_0(tmp_path, monkeypatch):
    path = tmp_path / "p"
    monkeypatch.setenv(tjob.ENV_PROGRESS_FILE, str(path))
    monkeypatch.setattr(tjob, "_progress", None)
    monkeypatch.setenv("RANK", "1")
    tjob.report(1, 0.5)
    tjob._progress.flush()
    assert not path.exists()
    monkeypatch.setattr(tjob, "_progress", None)
    monkeypatch.setenv("RANK", "0")
    tjob.report(1, 0.5)
    tjob._progress.flush()
    assert path.read_text().split()[1:] == ["1", "0.5"]


def test_the_master_shows_what_a_running_job_reported(tmp_path):
    m, clock, ex = make(tmp_path)
    j = m.submit(spec(1))["id"]
    m.tick()
    progress_file = ex.launched[0].env["TIRESIAS_PROGRESS_FILE"]
    assert "progress" not in m.job(j)
    with open(progress_file, "w") as f:
        f.write("1000.0 100 2.0\n1010.0 200 1.0\nnot a line\n1020.0 300")
    clock.t += 1
    m.tick()
    shown = m.job(j)["progress"]
    assert shown["step"] == 200.0 and shown["loss"] == 1.0 and shown["loss_points"] == 2
    assert shown["steps_per_s"] == pytest.approx(10.0) and shown["malformed_lines"] == 1
    with open(progress_file, "a") as f:
        f.write(" 0.5\n")                            # the cut line completed
    clock.t += 1
    m.tick()
    assert m.job(j)["progress"]["step"] == 300.0


def test_a_symlink_planted_for_the_progress_file_is_not_followed(tmp_path):
    m, clock, ex = make(tmp_path)
    j = m.submit(spec(1))["id"]
    m.tick()
    secret = tmp_path / "secret"
    secret.write_text("1 2 3\n")
    os.symlink(secret, ex.launched[0].env["TIRESIAS_PROGRESS_FILE"])
    clock.t += 1
    m.tick()
    assert "progress" not in m.job(j)


def test_a_gpu_range_is_kept_and_each_run_names_its_gpus_and_aggregators(tmp_path):
    m, clock, ex = make(tmp_path, executor=__import__("test_tiresias_master").FakeExecutor(2, 4))
    j = m.submit(spec(4, min_gpus=1))["id"]
    assert m.job(j)["min_gpus"] == 1 and m.states[j].min_gpus == 1 and m.states[j].max_gpus == 4
    m.tick()                                        # 2D-LAS is not elastic: the job runs at its most
    runs = m.job(j)["runs"]
    assert [(r["run"], r["gpus"], r["aggregators"]) for r in runs] == [(1, 4, None)]
    fixed = m.submit(spec(2))["id"]
    assert m.job(fixed)["min_gpus"] is None and m.states[fixed].max_gpus is None
    for bad in (0, 5, "1", True):
        with pytest.raises(Exception, match="min_gpus"):
            m.submit(spec(4, min_gpus=bad))


def test_submit_parses_a_gpu_range():
    import argparse
    from tiresias.service.cli import gpu_range
    assert gpu_range("4") == (4, 4) and gpu_range("1-8") == (1, 8)
    for bad in ("0", "8-1", "a-b", "1-", "-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_range(bad)
