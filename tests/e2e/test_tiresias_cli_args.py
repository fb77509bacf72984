"""``tiresias`` command-line findings: argument errors exit 2 with one line before anything
runs (``submit --gpus 0`` reaches no master, ``master --interval 0`` locks and writes no
state), ``master``'s usage shows no command it does not take, a trace with extra columns is
read (the columns named once on stderr), and ``compare`` reports progress as lines when
stderr is not a terminal."""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import socket
import subprocess
import sys

import pytest

import tiresias.cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACE_60 = ROOT.parent / "shared" / "data" / "tiresias" / "60_job.csv"
BIN = pathlib.Path(sys.executable).parent


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = tiresias.cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture
def dead_master(tmp_path) -> list[str]:
    """Client options naming a master nobody runs: a command that got that far exits 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("t\n")
    return ["--master", f"http://127.0.0.1:{port}", "--token-file", str(token)]


@pytest.mark.parametrize("argv, text", [
    (["submit", "--gpus", "0", "--", "true"], "argument --gpus: expected a number above 0, got '0'"),
    (["submit", "--gpus", "-2", "--", "true"], "argument --gpus: expected a number above 0"),
    (["submit", "--gpus", "1", "--autops-aggregators", "0", "--", "x.py"], "argument --autops-aggregators"),
    (["submit", "--gpus", "1", "--duration", "0", "--", "true"], "argument --duration"),
    (["submit", "--gpus", "1", "--memory", "0", "--", "true"], "size '0' must be at least one byte"),
    (["submit", "--gpus", "1"], "no command"),
    (["events", "--limit", "0"], "argument --limit"),
])
def test_client_argument_errors_exit_2_before_reaching_a_master(argv, text, dead_master):
    code, _, err = run_in_process(argv[:1] + dead_master + argv[1:])
    assert code == 2 and text in one_line(err)


def test_submit_gpus_0_from_the_console_script_is_exit_2(dead_master):
    proc = subprocess.run([str(BIN / "tiresias"), "submit", "--gpus", "0", *dead_master, "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert one_line(proc.stderr) == "tiresias submit: error: argument --gpus: expected a number above 0, got '0'"


@pytest.mark.parametrize("args, text", [
    (["--interval", "0"], "argument --interval"),
    (["--stop-grace", "-1"], "argument --stop-grace"),
    (["--queues", "0"], "argument --queues"),
    (["--queues", "3"], "--queues 3 needs 2 thresholds"),
    (["--thresholds", "x"], "--thresholds must be numbers separated by commas"),
    (["--queues", "3", "--thresholds", "10,5"], "positive and increasing"),
    (["--packlimit", "2"], "argument --packlimit: expected a number in [0, 1]"),
    (["--promote-knob", "0"], "argument --promote-knob"),
    (["--report-max-age", "0"], "argument --report-max-age"),
    (["--nodes", "lots"], "--nodes 'lots'"),
])
def test_master_argument_errors_exit_2_and_touch_no_state(args, text, tmp_path):
    state = tmp_path / "state"
    code, out, err = run_in_process(["master", "--state", str(state), "--bind", "127.0.0.1:0", *args])
    assert code == 2 and text in one_line(err) and "listening" not in out
    assert not state.exists()                         # no lock taken, nothing read or written


def test_master_usage_shows_no_command_it_does_not_take():
    proc = subprocess.run([str(BIN / "tiresias"), "master", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    usage = proc.stdout.split("\n\n", 1)[0]
    assert usage.splitlines() == ["usage: tiresias master [options]",
                                  "       tiresias master users {add,list,revoke} ..."]
    assert "MASTER_COMMAND" not in proc.stdout and "users" in proc.stdout.split("\n\n", 1)[1]
    code, _, err = run_in_process(["master", "foo"])     # a command it does not take: one line, 2
    assert code == 2 and "invalid choice: 'foo' (choose from 'users')" in one_line(err)


@pytest.fixture
def extra_column_trace(tmp_path) -> pathlib.Path:
    trace = tmp_path / "extra.csv"
    rows = "".join(f"{i},{i * 5},{1 + i % 2},{20 + i},team{i % 3},vgg16\n" for i in range(12))
    trace.write_text("job_id,submit_time,num_gpus,duration,user,model\n" + rows)
    return trace


def test_a_trace_with_an_extra_column_is_read_and_the_column_named_once(extra_column_trace):
    code, out, err = run_in_process(["simulate", "--trace", str(extra_column_trace), "--cluster", "1x4",
                                     "--no-progress", "--json", "-"])
    assert code == 0, err
    assert json.loads(out)["jobs"] == 12
    assert one_line(err) == (f"tiresias: ignored column 'user' of {extra_column_trace} "
                             "(not part of the generic format)")
    code, out, err = run_in_process(["compare", "--trace", str(extra_column_trace), "--cluster", "1x4",
                                     "--policies", "fifo,las", "--no-progress", "--json", "-"])
    assert code == 0, err
    assert [r["jobs"] for r in json.loads(out)] == [12, 12]
    assert one_line(err).startswith("tiresias: ignored column 'user' of ")     # once, not per policy


def test_compare_reports_progress_as_lines_when_stderr_is_not_a_terminal():
    proc = subprocess.run([str(BIN / "tiresias"), "compare", "--trace", str(TRACE_60), "--cluster", "2x4",
                           "--policies", "fifo,gandiva,las"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    for policy in ("fifo", "gandiva", "las"):
        ends = [line for line in lines if line.startswith(f"tiresias compare: {policy}: 60/60 jobs done, day ")]
        assert len(ends) == 1 and "finished in" in ends[0], proc.stderr
    quiet = subprocess.run([str(BIN / "tiresias"), "compare", "--trace", str(TRACE_60), "--cluster", "2x4",
                            "--policies", "fifo", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == ""
    single = subprocess.run([str(BIN / "tiresias"), "simulate", "--trace", str(TRACE_60), "--cluster", "2x4"],
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0 and single.stderr == ""       # simulate: progress on a terminal only


def test_progress_lines_while_a_run_goes_on():
    from tiresias.sim.progressbar import ProgressLines, progress_reporter
    out = io.StringIO()
    report = progress_reporter(ProgressLines("tiresias compare: las", every=0.0, out=out), 60)
    report(10, 3, 86400.0)
    report(60, 0, 2 * 86400.0, final=True)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("tiresias compare: las: 10/60 jobs done, day 1.0 simulated, 3 running (")
    assert lines[1].startswith("tiresias compare: las: 60/60 jobs done, day 2.0 simulated, finished in ")
    quiet = io.StringIO()
    report = progress_reporter(ProgressLines("x", every=3600.0, out=quiet), 5)
    report(1, 1, 10.0)                                # within the period: no line
    report(5, 0, 20.0, final=True)                    # the end always has one
    assert len(quiet.getvalue().splitlines()) == 1
