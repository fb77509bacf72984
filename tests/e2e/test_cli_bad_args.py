"""Every subcommand of ``autops``, ``infiniswap`` and ``tiresias`` given malformed arguments:
exit status 1 or 2, one line on stderr, never a traceback (DESIGN §6).

The commands are found by walking the argparse tree each CLI's ``main`` builds (its parser
is caught at its first ``parse_known_args``, before anything runs), with the commands that
parse their own options (``autops bench NAME``, ``infiniswap simulate`` / ``bench`` /
``device stop``) walked through their modules' ``main``. Each command is run in-process
with: an unknown option, ``--log-level foo``, a value each typed option or positional
refuses (a bad number, a bad address, a bad size ...), an unknown choice, and -- for the
commands that read a trace -- a missing trace file, a header-only trace and a trace whose
every row is bad. Malformed arguments only: no service is started with valid ones. A few
runtime failures (a dead peer, a port in use) and the console scripts run as well.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import pathlib
import socket
import subprocess
import sys
import time
from typing import Callable, Iterator
from unittest import mock

import pytest

import autops.cli
import dlrt.main
from autops.master.simulate import public, simulate
import infiniswap.cli
import tiresias.cli

BIN = pathlib.Path(sys.executable).parent
TRACE_HEADER = "job_id,submit_time,num_gpus,duration\n"
REJECTED_CANDIDATES = ("abc", "-1", "0", "", "nan")
# values for the required options of the commands that read a trace (the trace cases need
# everything else valid); a new required option there must be added here
VALID = {"--cluster": "2x4"}


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _parser_of(main: Callable, argv: list[str]) -> argparse.ArgumentParser:
    """The parser ``main(argv)`` builds, caught when it starts parsing (nothing runs)."""
    def catch(self, args=None, namespace=None):
        raise _Caught(self)
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", catch):
        try:
            main(argv)
        except _Caught as caught:
            return caught.parser
    raise AssertionError(f"{main.__module__}.main({argv}) did not parse its arguments")


def _module_main(module: str) -> Callable:
    return importlib.import_module(module).main


# (command words, main, words main needs to reach that parser, modules of forwarded commands)
ROOTS = [
    (["autops"], autops.cli.main, [], {("bench", name): m for name, (m, _) in autops.cli.BENCHMARKS.items()}),
    (["infiniswap"], infiniswap.cli.main, [], {(name,): m for name, (m, _) in infiniswap.cli.FORWARDED.items()}),
    (["tiresias"], tiresias.cli.main, [], {}),
    (["dlrt"], dlrt.main.main, ["testbed", "cluster"], {}),   # these groups' commands load only when named
]
SPECIAL = [(["infiniswap", "device", "stop"], infiniswap.cli.main, ["device", "stop"])]   # its own parser


def _leaves(parser: argparse.ArgumentParser, words: list[str]) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, parser
        return
    for name, sub in subs[0].choices.items():
        yield from _leaves(sub, words + [name])


def commands() -> list[tuple[list[str], Callable, argparse.ArgumentParser]]:
    """(argv words naming the command, the CLI's main, the command's parser) for every command."""
    found = []
    for words, main, reach, forwarded in ROOTS:
        for path, parser in _leaves(_parser_of(main, reach), []):
            if tuple(path) in forwarded:
                parser = _parser_of(_module_main(forwarded[tuple(path)]), [])
            elif not parser._actions:
                raise AssertionError(f"{' '.join(words + path)} has no options: a forwarded command "
                                     "missing from ROOTS?")
            found.append((path, main, parser))
    for words, main, reach in SPECIAL:
        found.append((reach, main, _parser_of(main, reach)))
    return found


COMMANDS = commands()


def _rejected(action: argparse.Action) -> str | None:
    """A value the action's type refuses, or None when it takes any string."""
    for value in REJECTED_CANDIDATES:
        try:
            action.type(value)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            return value
    return None


def bad_argument_cases() -> Iterator:
    for path, main, parser in COMMANDS:
        name = " ".join(path)
        yield pytest.param(main, path + ["--no-such-option"], 2, id=f"{name}: unknown option")
        yield pytest.param(main, path + ["--log-level", "foo"], 2, id=f"{name}: --log-level foo")
        for action in parser._actions:
            if action.nargs == 0 or action.nargs == argparse.REMAINDER or action.help == argparse.SUPPRESS \
                    and not action.option_strings:
                continue
            flag = list(action.option_strings[-1:])
            if action.choices is not None:
                yield pytest.param(main, path + flag + ["no-such-choice"], 2,
                                   id=f"{name} {flag[0] if flag else action.dest}: unknown choice")
            elif action.type is not None:
                value = _rejected(action)
                if value is not None:
                    yield pytest.param(main, path + flag + [value], 2,
                                       id=f"{name} {flag[0] if flag else action.dest} {value!r}")


@pytest.fixture
def traces(tmp_path):
    header_only = tmp_path / "header.csv"
    header_only.write_text(TRACE_HEADER)
    all_bad = tmp_path / "bad.csv"
    all_bad.write_text(TRACE_HEADER + "0,0,x,10\n1,-5,1,10\n2,0,1,0\n3,0,1\n4,0,1,nan\n")
    good = tmp_path / "good.csv"
    good.write_text(TRACE_HEADER + "0,0,1,10\n1,5,2,20\n")
    return {"missing": tmp_path / "missing.csv", "header": header_only, "bad": all_bad, "good": good}


def trace_cases() -> Iterator:
    for path, main, parser in COMMANDS:
        options = {s for a in parser._actions for s in a.option_strings}
        if "--trace" not in options:
            continue
        required = [a.option_strings[-1] for a in parser._actions
                    if a.required and a.option_strings and a.option_strings[-1] != "--trace"]
        missing = [r for r in required if r not in VALID]
        assert not missing, f"{' '.join(path)}: add a valid value for {missing} to VALID"
        base = path + [w for r in required for w in (r, VALID[r])]
        for kind in ("missing", "header", "bad"):
            yield pytest.param(main, base, kind, id=f"{' '.join(path)}: {kind} trace")


def run_in_process(main: Callable, argv: list[str]) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


def assert_one_line_error(code: int, stderr: str, want: set[int], argv: list[str]) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"{argv}: expected one line on stderr, got {stderr!r}"
    assert code in want, f"{argv}: exit status {code}, expected {sorted(want)}; stderr {stderr!r}"
    return lines[0]


def test_every_cli_has_commands():
    names = {" ".join(path) for path, _, _ in COMMANDS}
    assert {"master", "aggregator", "status", "simulate", "bench pushpull",      # autops
            "daemon", "device", "device stop", "run", "bench",                    # infiniswap
            "compare", "submit", "jobs"} <= names                                # tiresias
    assert len(COMMANDS) >= 25


@pytest.mark.parametrize("main, argv, status", list(bad_argument_cases()))
def test_malformed_argument_is_one_line_and_exit_2(main, argv, status):
    code, stderr = run_in_process(main, argv)
    line = assert_one_line_error(code, stderr, {status}, argv)
    assert ": error: " in line


@pytest.mark.parametrize("main, argv, kind", list(trace_cases()))
def test_a_trace_without_a_valid_job_is_one_line(main, argv, kind, traces):
    trace = traces[kind]
    code, stderr = run_in_process(main, argv + ["--trace", str(trace)])
    if kind == "missing":
        line = assert_one_line_error(code, stderr, {2}, argv)
        assert f"{trace}: no such trace file" in line
        return
    line = assert_one_line_error(code, stderr, {1}, argv)
    assert f"no valid job in {trace}" in line
    if kind == "bad":   # the count and the first three reasons
        assert "5 bad rows; first: " in line and f"{trace}:2: num_gpus is not an integer" in line
        assert f"{trace}:4: duration must be > 0" in line and f"{trace}:5:" not in line


@pytest.mark.parametrize("argv, status, text", [
    (["compare", "--policies", ""], 2, "policies"),
    (["compare", "--policies", "fifo,lottery"], 2, "unknown policy 'lottery'"),
    (["simulate", "--cluster", "0x4"], 2, "nodes, GPUs and CPUs per node must be >= 1"),
])
def test_tiresias_semantic_errors_on_a_good_trace(argv, status, text, traces):
    argv = argv[:1] + ["--trace", str(traces["good"]), "--cluster", "2x4", "--no-progress"] + argv[1:]
    code, stderr = run_in_process(tiresias.cli.main, argv)
    assert text in assert_one_line_error(code, stderr, {status}, argv)


def test_autops_simulate_names_the_skipped_rows_and_writes_no_nan(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE_HEADER + "0,0,x,10\n1,0,1,10\n2,0,1,0\n3,-1,1,5\n4,0,0,5\n")
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(trace), "--json", str(out), "--no-progress"]
    code, stderr = run_in_process(autops.cli.main, argv)
    line = assert_one_line_error(code, stderr, {0}, argv)
    assert line.startswith(f"autops simulate: skipped 4 bad rows of {trace}; first: {trace}:2: ")
    result = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert result["jobs"] == 1 and result["trace_rows_skipped"] == 4
    empty = public(simulate([]))          # no sample at all: the statistics are null, never NaN
    assert json.loads(json.dumps(empty, allow_nan=False))["ratio_percentiles"]["p50"] is None


def test_log_level_before_the_command_and_from_the_environment(monkeypatch):
    code, stderr = run_in_process(autops.cli.main, ["--log-level", "foo", "status"])
    assert "invalid choice: 'FOO'" in assert_one_line_error(code, stderr, {2}, ["--log-level", "foo"])
    monkeypatch.setenv("AUTOPS_LOG", "foo")
    code, stderr = run_in_process(autops.cli.main, ["status"])
    assert "$AUTOPS_LOG: invalid log level 'FOO'" in assert_one_line_error(code, stderr, {2}, ["status"])


@pytest.fixture
def dead_port():
    """A TCP port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def busy_port():
    """A TCP port a socket of this test listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv, text", [
    (["status", "--master", "127.0.0.1:{dead}", "--timeout", "0.2"], "did not answer"),
    (["status", "--master", "localhost:{dead}", "--timeout", "0.2"], "did not answer"),    # no tcp://
    (["migrate", "--master", "127.0.0.1:{dead}", "--job", "j", "--timeout", "0.2"], "did not answer"),
    (["migrate", "--master", "127.0.0.1:{dead}", "--job", "j", "--token-file", "/nonexistent/operator.token"],
     "cannot read /nonexistent/operator.token"),
    (["aggregator", "--master", "127.0.0.1:{dead}", "--register-timeout", "0.2"], "did not answer"),
    (["aggregator", "--master", "127.0.0.1:{dead}", "--bind", "127.0.0.1:{busy}"], "Address already in use"),
])
def test_autops_runtime_errors_are_one_line_and_exit_1(argv, text, dead_port, busy_port):
    argv = [a.format(dead=dead_port, busy=busy_port) for a in argv]
    code, stderr = run_in_process(autops.cli.main, argv)
    assert text in assert_one_line_error(code, stderr, {1}, argv)


def test_infiniswap_and_tiresias_clients_of_a_dead_peer(dead_port, tmp_path):
    argv = ["status", "--daemons", f"127.0.0.1:{dead_port}", "--timeout", "0.2"]
    code, stderr = run_in_process(infiniswap.cli.main, argv)
    assert "no answer" in assert_one_line_error(code, stderr, {1}, argv)
    token = tmp_path / "token"
    token.write_text("t")
    argv = ["jobs", "--master", f"http://127.0.0.1:{dead_port}", "--token-file", str(token)]
    code, stderr = run_in_process(tiresias.cli.main, argv)
    assert "cannot reach the master" in assert_one_line_error(code, stderr, {1}, argv)


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("argv, status, text", [
    (["autops", "master", "--bind", "127.0.0.1:{busy}"], 1, "Address already in use"),
    (["infiniswap", "daemon", "--bind", "127.0.0.1:{busy}", "--no-harden"], 1, "Address already in use"),
    (["autops", "--log-level", "foo", "status"], 2, "invalid choice: 'FOO'"),
    (["infiniswap", "simulate", "--machines", "0"], 2, "need at least 2 machines"),
    (["autops", "simulate", "--trace", "{header}"], 1, "no valid job in"),
    (["tiresias", "compare", "--trace", "{header}", "--cluster", "2x4"], 1, "no valid job in"),
])
def test_console_scripts(argv, status, text, busy_port, traces):
    argv = [a.format(busy=busy_port, header=traces["header"]) for a in argv]
    proc = run_script(*argv)
    assert text in assert_one_line_error(proc.returncode, proc.stderr, {status}, argv)


def test_tiresias_master_with_no_ray_cluster_at_the_address_is_one_line_at_once(tmp_path):
    with socket.socket() as s:              # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["master", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "--state", str(tmp_path / "st"),
            "--bind", "127.0.0.1:0"]
    t0 = time.monotonic()
    code, stderr = run_in_process(tiresias.cli.main, argv)
    line = assert_one_line_error(code, stderr, {1}, argv)
    assert f"no Ray cluster at 127.0.0.1:{port}: connection refused" in line
    assert time.monotonic() - t0 < 10


def test_autops_master_with_the_ray_provider_and_no_ray_cluster_is_one_line_at_once(tmp_path):
    with socket.socket() as s, socket.socket() as b:       # ports nothing listens on
        s.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, bind = s.getsockname()[1], b.getsockname()[1]
    argv = ["master", "--provider", "ray", "--ray-address", f"127.0.0.1:{port}", "--bind", f"127.0.0.1:{bind}",
            "--state-dir", str(tmp_path / "st")]
    t0 = time.monotonic()
    code, stderr = run_in_process(autops.cli.main, argv)
    line = assert_one_line_error(code, stderr, {1}, argv)
    assert f"no Ray cluster at 127.0.0.1:{port}: connection refused" in line
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("action", ["up", "status", "down"])
def test_dlrt_cluster_with_no_ray_cluster_at_the_address_is_one_line_at_once(action):
    from ports import free_port
    port = free_port()                      # nothing listens there
    argv = ["cluster", action, "--ray", f"127.0.0.1:{port}"]
    t0 = time.monotonic()
    code, stderr = run_in_process(dlrt.main.main, argv)
    line = assert_one_line_error(code, stderr, {1}, argv)
    assert f"no Ray cluster at 127.0.0.1:{port}: connection refused" in line
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("address, says", [("nohost", "expected HOST:PORT"), ("ray://h:10001", "not a Ray Client")])
def test_dlrt_cluster_with_a_bad_ray_address_is_a_usage_error(address, says):
    argv = ["cluster", "up", "--ray", address]
    code, stderr = run_in_process(dlrt.main.main, argv)
    assert says in assert_one_line_error(code, stderr, {2}, argv)
