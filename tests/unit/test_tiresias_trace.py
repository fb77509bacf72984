"""Tests for tiresias.trace (trace loading/validation: dlrt.trace's reader, plus the model
cycling of ``--models cycle``) and tiresias.cluster (shape, skew)."""
from __future__ import annotations

import collections
import pathlib
import re

import pytest

from tiresias.cluster import MODEL_SKEW, ClusterSpec, parse_cluster, skew_of
import dlrt.trace
from tiresias.trace import CYCLE_MODELS, LoadReport, TraceError, TraceJob, detect_format, load_trace, with_models

DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data"
PHILLY = DATA / "traces" / "philly.csv"
JOB60 = DATA / "tiresias" / "60_job.csv"
N32G4 = DATA / "tiresias" / "n32g4.csv"

def needs_data(test):
    """The shared data sits beside the project (also in CI); a missing file must fail, not skip."""
    return test

GENERIC_HEADER = "job_id,submit_time,num_gpus,duration,model,skew\n"


@pytest.fixture(scope="module")
def philly() -> LoadReport:
    return load_trace(PHILLY)


def write(tmp_path: pathlib.Path, text: str, name: str = "t.csv") -> pathlib.Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------- real files

@needs_data
def test_philly_loads_sorted_with_source_counts():
    rep = load_trace(PHILLY)
    assert rep.format == "philly"
    assert rep.skipped == 0 and rep.problems == []
    assert len(rep.jobs) == 82_247
    assert rep.jobs[0].submit_time == 0.0
    subs = [j.submit_time for j in rep.jobs]
    assert subs == sorted(subs)
    assert [j.job_id for j in rep.jobs] == list(range(len(rep.jobs)))
    counts = collections.Counter(j.num_gpus for j in rep.jobs)
    assert dict(counts) == {1: 76627, 2: 1818, 4: 1870, 8: 1643, 12: 7, 16: 199, 24: 7,
                            32: 67, 64: 6, 128: 3}
    assert all(j.model is None and j.skew is None and j.duration > 0 for j in rep.jobs)
    assert min(j.duration for j in rep.jobs) == 1.0
    # span of the trace: 2017-09-04 .. 2017-12-22 (< 110 days)
    assert 100 * 86400 < subs[-1] < 110 * 86400


@needs_data
def test_philly_first_row_time_is_utc_offset(philly):
    rep = philly
    by_line = {j.source_line: j for j in rep.jobs}
    # line 2: 2017-10-09 07:01:55 ; line 3: 2017-10-09 06:13:03 -> 2932 s apart
    assert by_line[2].submit_time - by_line[3].submit_time == pytest.approx(2932.0)
    assert by_line[2].duration == 66.0 and by_line[2].num_gpus == 1


@needs_data
def test_philly_limit_and_max_gpus(philly):
    rep = load_trace(PHILLY, limit=100)
    assert len(rep.jobs) == 100 and rep.jobs[0].submit_time == 0.0
    full = philly
    assert [(j.num_gpus, j.duration) for j in rep.jobs] == \
        [(j.num_gpus, j.duration) for j in full.jobs[:100]]
    rep = load_trace(PHILLY, max_gpus=32)
    assert rep.skipped == 6 + 3
    assert len(rep.jobs) == 82_247 - 9
    assert all(re.match(r".*philly\.csv:\d+: num_gpus (64|128) exceeds max_gpus 32$", p)
               for p in rep.problems)


@needs_data
def test_tiresias_60_job():
    rep = load_trace(JOB60)
    assert rep.format == "tiresias" and rep.skipped == 0
    assert len(rep.jobs) == 60
    j0 = rep.jobs[0]
    assert j0 == TraceJob(0, 0.0, 1, 164.0, "vgg19", None, 2)
    assert rep.jobs[1].model == "vgg11" and rep.jobs[1].num_gpus == 8
    assert rep.jobs[1].submit_time == 30.0 and rep.jobs[1].duration == 147.0
    subs = [j.submit_time for j in rep.jobs]
    assert subs == sorted(subs)
    assert collections.Counter(j.num_gpus for j in rep.jobs) == {1: 30, 2: 10, 4: 10, 8: 10}
    models = collections.Counter(j.model for j in rep.jobs)
    assert len(models) == 10 and set(models.values()) == {6}
    # every model in the trace has a skew in the table
    assert all(j.model in MODEL_SKEW for j in rep.jobs)


# ---------------------------------------------------------------- generic format

def test_generic_loads_sorts_and_shifts(tmp_path):
    p = write(tmp_path, GENERIC_HEADER +
              "7,100,2,50,vgg16,\n"
              "3,40,1,10,,0.25\n"
              "9,100,4,20.5,resnet50,0.1\n"
              "\n"
              "1,40,8,5,alexnet,1\n")
    rep = load_trace(p)
    assert isinstance(rep, LoadReport)
    assert rep.format == "generic" and rep.skipped == 0
    assert rep.jobs == [
        TraceJob(0, 0.0, 1, 10.0, None, 0.25, 3),
        TraceJob(1, 0.0, 8, 5.0, "alexnet", 1.0, 6),     # tie keeps file order
        TraceJob(2, 60.0, 2, 50.0, "vgg16", None, 2),
        TraceJob(3, 60.0, 4, 20.5, "resnet50", 0.1, 4),
    ]
    assert load_trace(p, limit=2).jobs == rep.jobs[:2]
    assert load_trace(p, limit=0).jobs == []


def test_generic_minimal_columns_any_order(tmp_path):
    p = write(tmp_path, " Duration , NUM_GPUS,submit_time,job_id\n30,2,5,0\n")
    rep = load_trace(p)
    assert rep.jobs == [TraceJob(0, 0.0, 2, 30.0, None, None, 2)]


def test_header_only_is_a_trace_without_a_valid_job(tmp_path):
    p = write(tmp_path, GENERIC_HEADER)
    with pytest.raises(dlrt.trace.NoValidJob, match=re.escape(f"no valid job in {p}: no rows after the header")):
        load_trace(p)


# ---------------------------------------------------------------- bad rows

BAD_ROWS = [
    ("missing field", "1,0,1\n", r"missing field"),
    ("empty field", "1,0,,10,,\n", r"missing field 'num_gpus'"),
    ("zero duration", "1,0,1,0,,\n", r"duration must be > 0"),
    ("negative duration", "1,0,1,-5,,\n", r"duration must be > 0"),
    ("zero gpus", "1,0,0,10,,\n", r"num_gpus must be >= 1"),
    ("too many gpus", "1,0,16,10,,\n", r"num_gpus 16 exceeds max_gpus 8"),
    ("garbage number", "1,0,1,abc,,\n", r"duration is not a number: 'abc'"),
    ("garbage gpus", "1,0,1.5,10,,\n", r"num_gpus is not an integer"),
    ("nan duration", "1,0,1,nan,,\n", r"duration is not finite"),
    ("negative submit", "1,-3,1,10,,\n", r"negative submit time"),
    ("bad skew", "1,0,1,10,vgg16,1.5\n", r"skew must be in \[0, 1\]"),
    ("garbage skew", "1,0,1,10,vgg16,high\n", r"skew is not a number"),
    ("too many fields", "1,0,1,10,vgg16,0.5,extra\n", r"too many fields"),
]


@pytest.mark.parametrize("name,row,reason", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_skip(tmp_path, name, row, reason):
    p = write(tmp_path, GENERIC_HEADER + "0,0,2,10,vgg19,\n" + row + "2,5,1,20,,\n")
    rep = load_trace(p, max_gpus=8, on_bad="skip")
    assert rep.skipped == 1
    assert len(rep.problems) == 1
    assert rep.problems[0].startswith(f"{p}:3: ")
    assert re.search(reason, rep.problems[0])
    assert [j.source_line for j in rep.jobs] == [2, 4]
    assert [j.job_id for j in rep.jobs] == [0, 1]


@pytest.mark.parametrize("name,row,reason", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_reject(tmp_path, name, row, reason):
    p = write(tmp_path, GENERIC_HEADER + "0,0,2,10,vgg19,\n" + row + "2,5,1,20,,\n")
    with pytest.raises(TraceError) as ei:
        load_trace(p, max_gpus=8, on_bad="reject")
    msg = str(ei.value)
    assert msg.startswith(f"{p}:3: ")
    assert re.search(reason, msg)


def test_skip_lists_every_problem(tmp_path):
    p = write(tmp_path, GENERIC_HEADER + "0,0,1,0,,\n1,0,1,x,,\n2,0,1,5,,\n3,0,0,5,,\n")
    rep = load_trace(p)
    assert rep.skipped == 3
    assert [q.split(": ")[0] for q in rep.problems] == [f"{p}:2", f"{p}:3", f"{p}:5"]
    assert len(rep.jobs) == 1 and rep.jobs[0].source_line == 4


def test_bad_rows_in_philly_and_tiresias_formats(tmp_path):
    p = write(tmp_path, "timestamp,duration,num_gpus,gpu_time,cluster\n"
                        "2017-10-09 07:01:55,66.0,1,66.0,a\n"
                        "yesterday,66.0,1,66.0,a\n"
                        "2017-10-09 07:00:00,-1,1,66.0,a\n"
                        "2017-10-09 07:00:00,5,x,66.0,a\n", "philly.csv")
    rep = load_trace(p)
    assert rep.format == "philly" and len(rep.jobs) == 1 and rep.skipped == 3
    assert "timestamp is not a timestamp" in rep.problems[0]
    assert "duration must be > 0" in rep.problems[1]
    assert "num_gpus is not an integer" in rep.problems[2]
    p = write(tmp_path, "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
                        "0,1,10,5,vgg19,0,1\n1,2,20,5,vgg11,30,1\n", "tir.csv")
    rep = load_trace(p)
    assert rep.skipped == 1 and rep.jobs == [TraceJob(0, 0.0, 2, 30.0, "vgg11", None, 3)]
    with pytest.raises(TraceError, match=re.escape(f"{p}:2: duration must be > 0")):
        load_trace(p, on_bad="reject")


# ---------------------------------------------------------------- whole-file errors

def test_detect_format():
    assert detect_format(["timestamp", "duration", "num_gpus", "gpu_time", "cluster"]) == "philly"
    assert detect_format("job_id,num_gpu,submit_time,iterations,model_name,duration,interval"
                         .split(",")) == "tiresias"
    assert detect_format(["job_id", "submit_time", "num_gpus", "duration"]) == "generic"
    assert detect_format(["job_id", "submit_time", "num_gpus", "duration", "skew"]) == "generic"
    with pytest.raises(TraceError, match="accepted headers.*philly.*tiresias.*generic"):
        detect_format(["a", "b"])
    # an extra column: the format whose columns are all there (the reader ignores the rest)
    assert detect_format(["job_id", "submit_time", "num_gpus", "duration", "colour"]) == "generic"
    with pytest.raises(TraceError, match="names column\\(s\\) duration twice"):
        detect_format(["job_id", "submit_time", "num_gpus", "duration", "duration"])
    with pytest.raises(TraceError, match="accepted headers"):       # a required column missing
        detect_format(["job_id", "submit_time", "num_gpus", "colour"])


def test_extra_columns_are_ignored_and_reported(tmp_path):
    p = write(tmp_path, "User,job_id,submit_time,num_gpus,duration,skew,Queue\n"
                        "alice,0,10,2,30,0.5,q1\nbob,1,0,1,20,,q2\n")
    rep = load_trace(p)
    assert rep.format == "generic" and rep.ignored_columns == ["user", "queue"]
    assert rep.jobs == [TraceJob(0, 0.0, 1, 20.0, None, None, 3), TraceJob(1, 10.0, 2, 30.0, None, 0.5, 2)]
    assert dlrt.trace.ignored_message(rep, p) == (f"ignored columns 'user', 'queue' of {p} "
                                                  "(not part of the generic format)")
    assert load_trace(p, fmt="generic").ignored_columns == ["user", "queue"]      # forced: the same
    clean = load_trace(write(tmp_path, GENERIC_HEADER + "0,0,1,5,,\n", "clean.csv"))
    assert clean.ignored_columns == [] and dlrt.trace.ignored_message(clean, p) == ""
    # philly with a job id: philly holds all but one column, generic is missing submit_time
    p = write(tmp_path, "timestamp,duration,num_gpus,gpu_time,cluster,job_id\n"
                        "2017-10-03 00:00:00,60,1,60,c1,7\n", "philly.csv")
    rep = load_trace(p)
    assert rep.format == "philly" and rep.ignored_columns == ["job_id"] and len(rep.jobs) == 1


def test_a_header_that_fits_two_formats_equally_needs_the_format_named(tmp_path):
    header = "timestamp,duration,num_gpus,gpu_time,cluster,job_id,submit_time"
    assert detect_format(header.split(",")) == "philly"               # 2 extra columns against 3
    header += ",model"                                                # 3 against 3
    with pytest.raises(TraceError, match="fits both the generic and the philly format"):
        detect_format(header.split(","))
    p = write(tmp_path, header + "\n2017-10-03 00:00:00,60,1,60,c1,7,5,vgg16\n")
    with pytest.raises(TraceError, match=f"{re.escape(str(p))}:1: .*fits both"):
        load_trace(p)
    assert load_trace(p, fmt="philly").ignored_columns == ["job_id", "submit_time", "model"]
    generic = load_trace(p, fmt="generic")
    assert generic.ignored_columns == ["timestamp", "gpu_time", "cluster"] and generic.jobs[0].model == "vgg16"


def test_unknown_header(tmp_path):
    p = write(tmp_path, "foo,bar\n1,2\n")
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    assert str(ei.value).startswith(f"{p}:1: ")
    assert "job_id,submit_time,num_gpus,duration" in str(ei.value)


def test_forced_format_must_match(tmp_path):
    p = write(tmp_path, GENERIC_HEADER + "0,0,1,5,,\n")
    assert load_trace(p, fmt="generic").format == "generic"
    with pytest.raises(TraceError, match="not a philly header"):
        load_trace(p, fmt="philly")
    with pytest.raises(ValueError):
        load_trace(p, fmt="yarn")


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such trace file") as ei:
        load_trace(tmp_path / "nope.csv")
    assert "nope.csv" in str(ei.value)


def test_directory_and_empty_and_binary(tmp_path):
    with pytest.raises(TraceError, match="directory"):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match="empty"):
        load_trace(write(tmp_path, ""))
    with pytest.raises(TraceError, match="empty"):
        load_trace(write(tmp_path, "\n\n", "blank.csv"))
    p = tmp_path / "bin.csv"
    p.write_bytes(b"job_id,submit_time,num_gpus,duration\n\xff\xfe\x00garbage\n")
    with pytest.raises(TraceError, match="bin.csv"):
        load_trace(p)


def test_argument_checks(tmp_path):
    p = write(tmp_path, GENERIC_HEADER + "0,0,1,5,,\n")
    with pytest.raises(ValueError):
        load_trace(p, on_bad="ignore")
    with pytest.raises(ValueError):
        load_trace(p, limit=-1)
    with pytest.raises(ValueError):
        load_trace(p, max_gpus=0)


def test_tracejob_is_frozen():
    j = TraceJob(0, 0.0, 1, 1.0)
    with pytest.raises(Exception):
        j.num_gpus = 2  # type: ignore[misc]
    assert j.model is None and j.skew is None and j.source_line == 0


# ---------------------------------------------------------------- cluster

def test_parse_cluster_shapes():
    assert parse_cluster("48x8") == ClusterSpec(48, 8)
    assert parse_cluster("48x8").total_gpus == 384
    assert parse_cluster("2x4") == ClusterSpec(2, 4)
    assert parse_cluster(" 2X4 ").total_gpus == 8


@pytest.mark.skipif(not N32G4.exists(), reason="shared data not present")
def test_parse_cluster_spec_files():
    spec = parse_cluster(str(N32G4))
    assert spec == ClusterSpec(32, 4) and spec.total_gpus == 128
    assert parse_cluster(N32G4.parent / "n160g8.csv") == ClusterSpec(160, 8)
    assert parse_cluster(str(N32G4.parent / "cluster_spec.csv")).total_gpus == 64


@pytest.mark.parametrize("text", ["", "48", "x8", "48x", "0x8", "4x0", "-1x8", "4x8x2x1", "4x8x0",
                                  "4.5x8", "abc", "/no/such/spec.csv"])
def test_parse_cluster_bad(text):
    with pytest.raises(ValueError, match="NODESxGPUS"):
        parse_cluster(text)


def test_parse_cluster_bad_spec_file(tmp_path):
    bad = write(tmp_path, "num_switch,num_node_p_switch\n1,2\n", "a.csv")
    with pytest.raises(ValueError, match="num_gpu_p_node"):
        parse_cluster(str(bad))
    bad = write(tmp_path, "num_switch,num_node_p_switch,num_gpu_p_node\n1,x,4\n", "b.csv")
    with pytest.raises(ValueError, match="not an integer"):
        parse_cluster(str(bad))
    with pytest.raises(ValueError, match="empty"):
        parse_cluster(str(write(tmp_path, "", "c.csv")))
    with pytest.raises(ValueError):
        ClusterSpec(0, 4)


# ---------------------------------------------------------------- skew

def test_model_skew_table():
    # Table 3.3 of the thesis
    assert MODEL_SKEW["vgg19"] == pytest.approx(0.715)
    assert MODEL_SKEW["vgg11"] == pytest.approx(0.773)
    assert MODEL_SKEW["inception4"] == pytest.approx(0.036)
    assert MODEL_SKEW["googlenet"] == pytest.approx(0.146)
    for m in ("vgg16", "alexnet", "resnet152", "resnet101", "resnet50", "inception3",
              "bert-base", "bert-large"):
        assert 0.0 < MODEL_SKEW[m] < 1.0


def test_skew_of_precedence():
    assert skew_of("vgg19", 0.3) == 0.3            # trace value first
    assert skew_of("vgg19", 0.0) == 0.0            # even zero
    assert skew_of("vgg19", None) == MODEL_SKEW["vgg19"]
    assert skew_of("VGG-19", None) == MODEL_SKEW["vgg19"]
    assert skew_of("ResNet_50", None) == MODEL_SKEW["resnet50"]
    assert skew_of("inception_v3", None) == MODEL_SKEW["inception3"]
    assert skew_of("BERT-Large", None) == MODEL_SKEW["bert-large"]
    assert skew_of("mystery", None) == 0.0
    assert skew_of("mystery", None, default=0.5) == 0.5
    assert skew_of(None, None, default=0.2) == 0.2
    assert skew_of(None, 0.7, default=0.2) == 0.7
    with pytest.raises(ValueError):
        skew_of("vgg19", 1.5)


def test_tiresias_reads_traces_with_the_shared_reader():
    assert load_trace is dlrt.trace.load_trace and TraceJob is dlrt.trace.TraceJob
    assert issubclass(TraceError, ValueError)           # a bad trace is bad user input (exit status 2)


def test_with_models_cycles_table_3_3_over_jobs_without_a_model():
    jobs = [TraceJob(i, float(i), 1, 10.0, model="bert" if i == 1 else None) for i in range(12)]
    out = with_models(jobs)
    assert [j.model for j in out] == [CYCLE_MODELS[0], "bert", *CYCLE_MODELS[2:], CYCLE_MODELS[0], CYCLE_MODELS[1]]
    assert [j.job_id for j in out] == list(range(12)) and jobs[0].model is None    # new records
    assert [j.model for j in with_models(jobs[:2], ("a", "b", "c"))] == ["a", "bert"]
