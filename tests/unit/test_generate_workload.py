"""Tesserae's synthetic workloads (``tiresias.generate``) and ``tiresias workload``."""
from __future__ import annotations

import json
import math
from pathlib import Path
from collections import Counter

import pytest

from dlrt.trace import load_trace
from tiresias.generate import (GPU_PROBS, KINDS, SHOCKWAVE_CLASSES, SHOCKWAVE_HOURS, GeneratedJob, generate,
                               offered_load, write_trace)
from tiresias.load import offered_load as load_offered_load

# the job types of ../shared/data/colocation/blox_norm_speed.csv: (model, batch_size, gpus)
SINGLE = ("resnet50", "vgg19", "DCGAN", "PointNet")
TYPES = ([(m, b, g) for m in SINGLE for b in ("32", "64", "128") for g in (1, 2, 4)]
         + [("Bert-Large", "256/16", 2), ("Bert-Large", "256/32", 2), ("Bert-Large", "256/16", 4),
            ("Bert-Large", "256/64", 4), ("GPT2-Medium", "512/8", 2), ("GPT2-Medium", "512/16", 2),
            ("GPT2-Medium", "512/8", 4), ("GPT2-Medium", "512/32", 4)])
N = 20_000


@pytest.fixture(scope="module")
def many():
    return {kind: generate(kind, N, 80.0, 7, TYPES) for kind in KINDS}


# --- reproducibility --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_the_same_seed_gives_the_same_trace_and_another_seed_another(kind):
    a = generate(kind, 200, 80.0, 3, TYPES)
    assert a == generate(kind, 200, 80.0, 3, list(reversed(TYPES)))      # the order of the types does not matter
    b = generate(kind, 200, 80.0, 4, TYPES)
    assert [j.submit_time for j in a] != [j.submit_time for j in b]
    assert [j.duration for j in a] != [j.duration for j in b]
    assert [(j.model, j.batch_size) for j in a] != [(j.model, j.batch_size) for j in b]


@pytest.mark.parametrize("kind", KINDS)
def test_more_jobs_keep_the_first_ones(kind):
    short = generate(kind, 30, 80.0, 11, TYPES)
    assert generate(kind, 500, 80.0, 11, TYPES)[:30] == short
    assert generate(kind, 1, 80.0, 11, TYPES) == short[:1]


def test_jobs_are_numbered_in_submit_order_from_zero():
    jobs = generate("shockwave", 100, 80.0, 0, TYPES)
    assert [j.job_id for j in jobs] == list(range(100))
    assert jobs[0].submit_time == 0.0
    assert all(a.submit_time < b.submit_time for a, b in zip(jobs, jobs[1:]))


# --- distributions ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_gpu_counts_follow_the_kinds_probabilities(many, kind):
    counts = Counter(j.num_gpus for j in many[kind])
    assert set(counts) <= {1, 2, 4, 8}
    for gpus, p in GPU_PROBS[kind]:
        assert counts[gpus] / N == pytest.approx(p, abs=0.015), (kind, gpus)
    assert dict(GPU_PROBS["shockwave"]) == {1: 0.6, 2: 0.3, 4: 0.09, 8: 0.01}
    assert dict(GPU_PROBS["gavel"]) == {1: 0.7, 2: 0.1, 4: 0.15, 8: 0.05}


def test_shockwave_durations_are_grid_values_in_their_classes(many):
    grid = [round(3600 * h) for h in SHOCKWAVE_HOURS]
    assert len(grid) == 100 and grid[0] == 720 and grid[-1] == 18000 and len(set(grid)) == 100
    index = {s: i for i, s in enumerate(grid)}
    jobs = many["shockwave"]
    assert all(j.duration in index for j in jobs)
    classes = Counter(next(name for name, lo, hi, _ in SHOCKWAVE_CLASSES if lo <= index[j.duration] < hi)
                      for j in jobs)
    for name, want in (("small", 0.72), ("medium", 0.2), ("large", 0.05), ("extra-large", 0.03)):
        assert classes[name] / N == pytest.approx(want, abs=0.015), name
    assert [(lo, hi) for _, lo, hi, _ in SHOCKWAVE_CLASSES] == [(0, 20), (20, 50), (50, 90), (90, 100)]
    assert len({j.duration for j in jobs}) == 100       # every value of every class is drawn


def test_gavel_durations_are_ten_to_the_x_minutes(many):
    minutes = [j.duration / 60.0 for j in many["gavel"]]
    assert all(10 ** 1.5 <= m <= 10 ** 4 for m in minutes)
    assert sum(m >= 1000 for m in minutes) / N == pytest.approx(0.2, abs=0.015)
    logs = [math.log10(m) for m in minutes]
    low = [x for x in logs if x < 3]
    assert sum(low) / len(low) == pytest.approx(2.25, abs=0.02)          # uniform in [1.5, 3]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rate", [80.0, 30.0])
def test_arrivals_are_poisson_at_the_rate(kind, rate):
    jobs = generate(kind, N, rate, 5, TYPES)
    gaps = [b.submit_time - a.submit_time for a, b in zip(jobs, jobs[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(3600.0 / rate, rel=0.03)
    # exponential: the share of gaps below the mean is 1 - 1/e
    assert sum(g < 3600.0 / rate for g in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.015)


# --- models -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_single_gpu_jobs_get_single_gpu_models_and_8_gpu_jobs_the_largest_count(many, kind):
    measured = set(TYPES)
    for j in many[kind]:
        at = j.num_gpus if j.num_gpus < 8 else 4            # the table's largest count <= 8 is 4
        assert (j.model, j.batch_size, at) in measured, j
    one = {j.model for j in many[kind] if j.num_gpus == 1}
    assert one == set(SINGLE)
    assert {j.model for j in many[kind] if j.num_gpus == 8} == set(SINGLE) | {"Bert-Large", "GPT2-Medium"}
    assert {j.batch_size for j in many[kind] if j.model == "GPT2-Medium"} == {"512/8", "512/16", "512/32"}


def test_models_are_drawn_uniformly_then_batch_sizes():
    jobs = generate("shockwave", N, 80.0, 1, TYPES)
    one = Counter(j.model for j in jobs if j.num_gpus == 1)
    total = sum(one.values())
    assert all(c / total == pytest.approx(0.25, abs=0.02) for c in one.values())
    bert2 = Counter(j.batch_size for j in jobs if j.model == "Bert-Large" and j.num_gpus == 2)
    assert set(bert2) == {"256/16", "256/32"} and bert2["256/16"] / sum(bert2.values()) == pytest.approx(0.5, abs=0.08)


def test_a_count_the_table_has_is_used_else_the_largest_below():
    table = [("small", "32", 1), ("mid", "64", 4), ("big", "1024", 8)]
    jobs = generate("gavel", 3000, 80.0, 2, table)
    want = {1: {"small"}, 2: {"small"}, 4: {"mid"}, 8: {"big"}}
    got: dict[int, set[str]] = {}
    for j in jobs:
        got.setdefault(j.num_gpus, set()).add(j.model)
    assert got == want


# --- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("args, match", [
    (("nope", 10, 80.0, 0, TYPES), "unknown workload kind 'nope'"),
    (("shockwave", 0, 80.0, 0, TYPES), "jobs must be an integer >= 1"),
    (("shockwave", 10, 0.0, 0, TYPES), "rate must be"),
    (("shockwave", 10, -5.0, 0, TYPES), "rate must be"),
    (("shockwave", 10, float("inf"), 0, TYPES), "rate must be"),
    (("shockwave", 10, 80.0, 0, []), "non-empty"),
    (("shockwave", 10, 80.0, 0, [("Bert-Large", "256/16", 2)]), "no 1-GPU job type"),
    (("shockwave", 10, 80.0, 0, [("m", "32", 0)]), "GPUs must be an integer >= 1"),
    (("shockwave", 10, 80.0, 0, [("m", 32, 1)]), "model .* and a batch size"),
    (("shockwave", 10, 80.0, 0, [(" ", "32", 1)]), "model .* and a batch size"),
    (("shockwave", 10, 80.0, 0, [("m", "32")]), r"must be \(model, batch_size, gpus\)"),
])
def test_bad_inputs_are_one_line_value_errors(args, match):
    with pytest.raises(ValueError, match=match) as err:
        generate(*args)
    assert "\n" not in str(err.value)


# --- trace file -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_written_trace_loads_as_generic_with_models_and_batch_sizes(tmp_path, kind):
    jobs = generate(kind, 300, 80.0, 9, TYPES)
    path = tmp_path / "t.csv"
    write_trace(jobs, path)
    assert path.read_text().splitlines()[0] == "job_id,submit_time,num_gpus,duration,model,batch_size"
    report = load_trace(path)
    assert report.format == "generic" and report.skipped == 0 and not report.ignored_columns
    assert len(report.jobs) == len(jobs)
    for g, t in zip(jobs, report.jobs):
        assert (t.job_id, t.num_gpus, t.duration, t.model, t.batch_size) == \
            (g.job_id, g.num_gpus, g.duration, g.model, g.batch_size)
        assert t.submit_time == g.submit_time - jobs[0].submit_time


def test_a_type_without_a_batch_size_reads_back_as_none(tmp_path):
    jobs = generate("gavel", 40, 80.0, 0, [("A3C", "", 1), ("ResNet-18", "16", 1)])
    assert {j.batch_size for j in jobs} == {"", "16"}
    write_trace(jobs, tmp_path / "t.csv")
    back = {(t.model, t.batch_size) for t in load_trace(tmp_path / "t.csv").jobs}
    assert back == {("A3C", None), ("ResNet-18", "16")}


def test_offered_load_is_tiresias_loads_overall():
    jobs = [GeneratedJob(0, 0.0, 2, 3600.0, "m", "32"), GeneratedJob(1, 1800.0, 4, 900.0, "m", "32"),
            GeneratedJob(2, 3600.0, 1, 100.0, "m", "32")]
    assert offered_load(jobs, 4) == pytest.approx((7200 + 3600 + 100) / (4 * 3600))
    assert offered_load(jobs, 4) == load_offered_load(jobs, 4).overall
    assert offered_load(jobs[:1], 4) is None                    # one submission: no window


# --- the command ------------------------------------------------------------------------------

@pytest.fixture
def tcli():
    from tiresias import cli      # the command needs the simulator; the generator tests do not
    return cli


needs_table = pytest.mark.skipif(
    not (Path(__file__).resolve().parents[3] / "shared" / "data" / "colocation" / "blox_norm_speed.csv").is_file(),
    reason="no co-location table in ../shared/data")


def test_the_default_colocation_file_is_under_the_shared_data(tcli):
    shared = tcli.PROJECT_ROOT.parent / "shared"
    assert tcli.DEFAULT_COLOCATION == shared / "data" / "colocation" / "blox_norm_speed.csv"
    assert (tcli.PROJECT_ROOT / "tiresias" / "cli.py").is_file()


@needs_table
def test_workload_writes_a_trace_simulate_runs(tmp_path, capsys, tcli):
    out = tmp_path / "sub" / "t.csv"
    argv = ["workload", "--jobs", "50", "--seed", "3", "--out", str(out)]
    assert tcli.main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("50 jobs asking ") and f"on 80 GPUs -> {out}" in line and "\n" not in line
    report = load_trace(out)
    assert len(report.jobs) == 50 and all(j.model and j.batch_size for j in report.jobs)
    load = offered_load(report.jobs, 80)
    assert f"offered load {load:.2f} on 80 GPUs" in line

    summary = tmp_path / "sim.json"
    assert tcli.main(["simulate", "--trace", str(out), "--cluster", "10x8", "--json", str(summary),
                      "--no-progress"]) == 0
    assert json.loads(summary.read_text())["jobs"] == 50


@needs_table
def test_workload_json_summary(tmp_path, capsys, tcli):
    argv = ["workload", "--kind", "gavel", "--jobs", "20", "--rate", "40", "--gpus", "16",
            "--out", str(tmp_path / "t.csv"), "--json", "-"]
    assert tcli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kind"] == "gavel" and got["jobs"] == 20 and got["gpus"] == 16 and got["rate"] == 40.0
    assert got["gpus_asked"] == sum(j.num_gpus for j in load_trace(tmp_path / "t.csv").jobs)


@pytest.mark.parametrize("bad, says", [
    (["--rate", "0"], "--rate"), (["--rate", "x"], "--rate"), (["--jobs", "0"], "--jobs"),
    (["--kind", "philly"], "--kind"), (["--gpus", "-1"], "--gpus"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, bad, says, tcli):
    with pytest.raises(SystemExit) as done:
        tcli.main(["workload", "--out", str(tmp_path / "t.csv"), *bad])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tiresias workload: error:") and says in err
    assert not (tmp_path / "t.csv").exists()


def test_a_missing_colocation_file_is_a_usage_error(tmp_path, capsys, tcli):
    assert tcli.main(["workload", "--colocation", str(tmp_path / "none.csv"), "--out", str(tmp_path / "t.csv")]) == 2
    err = capsys.readouterr().err
    assert err == f"tiresias workload: error: --colocation {tmp_path / 'none.csv'}: no such file\n"
