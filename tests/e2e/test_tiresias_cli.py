"""`tiresias simulate` / `compare` on the original simulator's 60-job trace, and the command-line
convention (``dlrt.cli``) for every ``tiresias`` command."""
from __future__ import annotations

import csv
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
BIN = pathlib.Path(sys.executable).parent


def run(*args):
    return subprocess.run([str(BIN / "tiresias"), *args], capture_output=True, text=True, timeout=300)


def test_simulate_writes_the_contracted_json_and_jobs_csv(tmp_path):
    out, jobs = tmp_path / "r.json", tmp_path / "jobs.csv"
    proc = run("simulate", "--trace", str(DATA / "tiresias" / "60_job.csv"), "--cluster", "2x4",
               "--policy", "las", "--json", str(out), "--jobs-csv", str(jobs))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""                  # --json FILE: the file only
    summary = json.loads(out.read_text())
    for key in ("policy", "jobs", "avg_jct", "median_jct", "p95_jct", "avg_queue_delay", "median_queue_delay",
                "p95_queue_delay", "makespan", "preemptions", "gpu_utilization", "sim_wall_seconds"):
        assert key in summary
    assert summary["jobs"] == 60 and 0 < summary["gpu_utilization"] <= 1
    rows = list(csv.DictReader(jobs.open()))
    assert len(rows) == 60
    assert all(float(r["jct"]) >= float(r["queue_delay"]) >= 0 for r in rows)


def table(stdout: str) -> tuple[list[str], dict[str, str]]:
    """compare's text: the lines above the table (offered load, queues) and its rows by policy."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    return lines[:head + 1], {line.split()[0]: line for line in lines[head + 1:]}


def test_compare_prints_a_table_normalized_by_las():
    proc = run("compare", "--trace", str(DATA / "tiresias" / "60_job.csv"), "--cluster", "2x4",
               "--policies", "fifo,srtf,gittins,las")
    assert proc.returncode == 0, proc.stderr
    above, rows = table(proc.stdout)
    assert set(rows) == {"fifo", "srtf", "gittins", "las"}
    assert "1.00x" in rows["las"] and "avg/las" in above[-1]
    # the regime next to the figures: 60 jobs asking 1.87x the 8 GPUs over 1779 s; the queues
    assert above[0].startswith("offered load 1.87 of 8 GPUs") and "K=2, thresholds 3,200 GPU-s" in above[1]


def test_bad_rows_reported_not_a_traceback(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time,num_gpus,duration\n1,0,1,10\n2,5,1,-3\n3,6,64,10\n")
    proc = run("simulate", "--trace", str(trace), "--cluster", "2x4", "--policy", "fifo")
    assert proc.returncode == 0 and "skipped 2 bad rows" in proc.stderr and f"{trace}:3:" in proc.stderr
    proc = run("simulate", "--trace", str(trace), "--cluster", "2x4", "--policy", "fifo", "--on-bad", "reject")
    assert proc.returncode == 2 and f"{trace}:3:" in proc.stderr and "Traceback" not in proc.stderr


def test_plots_and_normalized_json(tmp_path):
    trace = str(DATA / "tiresias" / "60_job.csv")
    png, cdf, out = tmp_path / "run.png", tmp_path / "cdf.png", tmp_path / "cmp.json"
    proc = run("simulate", "--trace", trace, "--cluster", "2x4", "--policy", "gittins", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = run("compare", "--trace", trace, "--cluster", "2x4", "--policies", "fifo,las", "--migrate",
               "--json", str(out), "--plot", str(cdf))
    assert proc.returncode == 0, proc.stderr
    assert cdf.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert rows["las"]["avg_jct_vs_las"] == 1.0 and rows["fifo"]["avg_jct_vs_las"] > 1.0
    assert rows["las"]["placement"] == "tiresias"
    for key in ("migrations", "migrations_saved", "overhead_seconds", "placement_waits"):
        assert key in rows["las"]


def test_original_mode_matches_gpu_counting_and_overheads_cost_time(tmp_path):
    trace = str(DATA / "tiresias" / "60_job.csv")
    orig, charged = tmp_path / "o.json", tmp_path / "c.json"
    assert run("simulate", "--trace", trace, "--cluster", "2x4", "--policy", "gittins", "--original",
               "--json", str(orig)).returncode == 0
    assert run("simulate", "--trace", trace, "--cluster", "2x4", "--policy", "gittins", "--placement", "count",
               "--no-slowdown", "--json", str(charged)).returncode == 0
    o, c = json.loads(orig.read_text()), json.loads(charged.read_text())
    assert o["placement"] == "count" and o["overhead_seconds"] == 0
    assert c["preemptions"] > 0 and c["overhead_seconds"] > 0


def test_unknown_policy_is_one_clear_message():
    proc = run("compare", "--trace", str(DATA / "tiresias" / "60_job.csv"), "--cluster", "2x4",
               "--policies", "fifo,lottery")
    assert proc.returncode == 2 and "unknown policy 'lottery'" in proc.stderr and "Traceback" not in proc.stderr


def test_json_dash_prints_only_json_and_log_level_comes_after_the_command(tmp_path):
    trace = str(DATA / "tiresias" / "60_job.csv")
    proc = run("compare", "--trace", trace, "--cluster", "2x4", "--policies", "fifo,las", "--log-level", "error",
               "--json", "-")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)                       # no table around it
    assert [r["policy"] for r in rows] == ["fifo", "las"]
    proc = run("simulate", "--trace", trace, "--cluster", "2x4", "--policy", "las", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["jobs"] == 60         # printed once


@pytest.mark.parametrize("args, text", [
    (["simulate", "--trace", "T", "--cluster", "2x4", "--log-level", "loud"], "invalid choice: 'LOUD'"),
    (["simulate", "--trace", "/nonexistent.csv", "--cluster", "2x4"], "no such trace file"),
    (["compare", "--trace", "T", "--cluster", "lots"], "cluster 'lots'"),
    (["jobs", "--json"], "--json: expected one argument"),
    (["master", "--bind", "127.0.0.1:http"], "bad address"),
    (["master", "--autops-master", "nowhere"], "bad address 'nowhere'"),
])
def test_usage_errors_exit_2_without_a_traceback(args, text):
    trace = str(DATA / "tiresias" / "60_job.csv")
    proc = run(*[trace if a == "T" else a for a in args])
    assert proc.returncode == 2, proc.stderr
    assert text in proc.stderr and "Traceback" not in proc.stderr


def test_no_command_lists_the_commands_and_exits_2():
    proc = run()
    assert proc.returncode == 2 and proc.stderr == ""
    for command in ("simulate", "compare", "master", "submit", "jobs"):
        assert command in proc.stdout


def test_help_shows_defaults():
    proc = run("master", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "(default: 127.0.0.1:8470)" in text and "(default: INFO)" in text


def test_compare_without_las_names_the_policy_it_normalizes_by(tmp_path):
    out = tmp_path / "cmp.json"
    proc = run("compare", "--trace", str(DATA / "tiresias" / "60_job.csv"), "--cluster", "2x4",
               "--policies", "fifo,srtf", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    above, rows = table(proc.stdout)
    assert "avg/srtf" in above[-1] and "las" not in above[-1] and "1.00x" in rows["srtf"]
    data = {r["policy"]: r for r in json.loads(out.read_text())}
    assert {r["normalized_by"] for r in data.values()} == {"srtf"}
    assert data["srtf"]["avg_jct_vs_srtf"] == 1.0 and data["fifo"]["avg_jct_vs_srtf"] > 1.0
    assert "avg_jct_vs_las" not in data["fifo"]
    assert data["fifo"]["offered_load"]["gpus"] == 8 and data["fifo"]["offered_load"]["overall"] > 1.8


def test_empty_policy_list_is_one_line_exit_2():
    proc = run("compare", "--trace", str(DATA / "tiresias" / "60_job.csv"), "--cluster", "2x4", "--policies", " ,")
    assert proc.returncode == 2 and "no policy given" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_trace_without_a_valid_job_is_exit_1_with_the_reasons(tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("job_id,submit_time,num_gpus,duration\n1,0,1,-3\n")
    proc = run("compare", "--trace", str(trace), "--cluster", "2x4")
    assert proc.returncode == 1 and "no valid job" in proc.stderr and "Traceback" not in proc.stderr


def test_continuous_las_with_overheads_ends_and_queues_auto_is_reported(tmp_path):
    # the three-job example of Fig. 3.7 on 2 GPUs: priorities every second, overheads charged;
    # without the progress guarantee this run never ended
    trace = tmp_path / "three.csv"
    trace.write_text("job_id,submit_time,num_gpus,duration\n1,0,2,2\n2,0,1,8\n3,0,2,6\n")
    proc = run("simulate", "--trace", str(trace), "--cluster", "1x2", "--policy", "las", "--continuous",
               "--interval", "1", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["jobs"] == 3
    proc = run("simulate", "--trace", str(trace), "--cluster", "1x2", "--policy", "las", "--continuous",
               "--interval", "1", "--min-run-factor", "0", "--stall-limit", "600")
    assert proc.returncode == 1 and "no job made progress" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("simulate", "--trace", str(DATA / "tiresias" / "60_job.csv"), "--cluster", "2x4", "--policy",
               "las", "--queues", "auto", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["queues"]["auto"] and summary["queues"]["queues"] == len(summary["queues"]["thresholds"]) + 1
    assert summary["offered_load"]["overall"] == pytest.approx(1.8707, abs=1e-4)


def test_simulate_help_states_the_progress_guarantee():
    proc = run("simulate", "--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "s + max(MIN_RUN, FACTOR x r)" in text and "(default: 2.0)" in text
    assert "--stall-limit" in text and "'auto'" in text
