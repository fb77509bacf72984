"""The ``infiniswap`` command end to end on loopback: ``daemon`` and ``device`` as child
processes (stopped by pid with SIGTERM -> exit status 0), ``status --json -`` asking both,
``simulate``, argument errors (one line, no traceback) and the command-line convention
(``dlrt.cli``: ``--json FILE``, ``--log-level`` after the command, ``HOST:PORT`` addresses,
exit status 2 for usage errors, help with defaults)."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest

from infiniswap.cli import main
from infiniswap.local import LocalDaemons

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
CLI = [sys.executable, "-m", "infiniswap.cli"]


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def first_line(proc: subprocess.Popen, wait: float = 30) -> str:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    raise AssertionError("the process did not announce itself")


@pytest.fixture
def device_proc(tmp_path):
    """Start ``infiniswap device`` with given daemons; always stopped by pid afterwards."""
    procs: list[subprocess.Popen] = []

    def start(daemons: list[str]) -> tuple[subprocess.Popen, str]:
        log = open(tmp_path / f"device{len(procs)}.log", "wb")
        proc = subprocess.Popen(
            [*CLI, "device", "--size", "8M", "--slab-size", "1M", "--backup",
             str(tmp_path / "backup"), "--daemons", ",".join(daemons), "--status-bind",
             "tcp://127.0.0.1:0", "--period", "0.1", "--timeout", "1", "--map-all",
             "--device-id", "cli-dev"],
            stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        procs.append(proc)
        m = re.search(r"status (\S+)", first_line(proc))
        assert m, "no status address announced"
        return proc, m.group(1)
    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
            proc.stdout.close()


def test_daemon_device_status_end_to_end(device_proc):
    with LocalDaemons(2, slab_size=MiB, capacity=16 * MiB, headroom=0, period=0.1) as daemons:
        dev, status_addr = device_proc(daemons.addresses)

        out = run_cli("status", "--daemons", ",".join(daemons.addresses), "--devices",
                      status_addr, "--json", "-")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        device = report["devices"][status_addr]
        assert device["device_id"] == "cli-dev" and device["slabs_mapped"] == 8
        assert sorted(s for slabs in device["mapped"].values() for s in slabs) == list(range(8))
        hosted = {a: r["slabs_mapped"] for a, r in report["daemons"].items()}
        assert sum(hosted.values()) == 8 and all(n > 0 for n in hosted.values())  # M_new first
        for a, r in report["daemons"].items():
            assert r["devices"] == {"cli-dev": device["mapped"][a]}
            assert r["slabs_free"] + r["slabs_mapped"] <= 16

        text = run_cli("status", "--daemons", ",".join(daemons.addresses), "--devices",
                       status_addr)
        assert text.returncode == 0 and "cli-dev" in text.stdout and "slab" in text.stdout

        dev.send_signal(signal.SIGTERM)
        assert dev.wait(20) == 0                  # clean shutdown gives the slabs back
        after = json.loads(run_cli("status", "--daemons", ",".join(daemons.addresses),
                                   "--json", "-").stdout)
        assert all(r["slabs_mapped"] == 0 for r in after["daemons"].values())
        assert daemons.stop() == [0, 0]


def test_status_of_an_unreachable_endpoint_exits_1():
    out = run_cli("status", "--daemons", "tcp://127.0.0.1:9", "--timeout", "0.3", "--json", "-")
    assert out.returncode == 1
    assert "no answer from tcp://127.0.0.1:9" in out.stderr
    assert "error" in json.loads(out.stdout)["daemons"]["tcp://127.0.0.1:9"]


def test_status_takes_host_port_and_log_level_after_the_command(tmp_path):
    out_file = tmp_path / "status.json"
    out = run_cli("status", "--daemons", "127.0.0.1:9", "--timeout", "0.3", "--log-level", "debug",
                  "--json", str(out_file))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "no answer from tcp://127.0.0.1:9" in out.stderr
    assert "unreachable" in out.stdout                    # the table still goes to stdout
    assert "error" in json.loads(out_file.read_text())["daemons"]["tcp://127.0.0.1:9"]


def test_simulate_prints_the_report(capsys):
    assert main(["simulate", "--machines", "200", "--trials", "500", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machines"] == 200
    assert {"placement", "eviction"} <= set(report)


def test_no_command_lists_the_commands_and_exits_2():
    out = run_cli()
    assert out.returncode == 2 and out.stderr == ""
    for command in ("daemon", "device", "status", "run", "simulate", "bench"):
        assert command in out.stdout


@pytest.mark.parametrize("args, text", [
    (["daemon", "--help"], "(default: 127.0.0.1:7300)"),
    (["daemon", "--help"], "(default: 8G)"),
    (["device", "--help"], "(default: 1G)"),
    (["status", "--help"], "--json FILE"),
    (["bench", "--help"], "--num-daemons N"),
    (["bench", "--help"], "(default: 2G)"),
    (["simulate", "--help"], "(default: 1000)"),
])
def test_help_shows_defaults_and_the_convention(args, text):
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert text in " ".join(out.stdout.split())            # help lines wrap


@pytest.mark.parametrize("args, text, code", [
    (["daemon", "--headroom", "lots"], "bad size 'lots'", 2),
    (["device", "--size", "4G"], "the following arguments are required: --backup", 2),
    (["device", "--size", "3M", "--slab-size", "2M", "--backup", "/tmp/x"],
     "must be a multiple of the slab size", 2),
    (["device", "--size", "4M", "--slab-size", "1M", "--backup", "/nonexistent/dir/b"],
     "No such file or directory", 1),
    (["device", "--size", "4M", "--slab-size", "1M", "--backup", "/tmp/x", "--daemons",
      "host-without-port"], "bad address 'host-without-port'", 2),
    (["daemon", "--bind", "tcp://127.0.0.1:0", "--emulate-usage", "/tmp/x"],
     "--emulate-usage needs --capacity", 2),
    (["daemon", "--bind", "nowhere"], "bad address 'nowhere'", 2),
    (["status"], "give --daemons and/or --devices", 2),
    (["status", "--daemons", "127.0.0.1:9", "--log-level", "chatty"], "invalid choice: 'CHATTY'", 2),
    (["status", "--daemons", "127.0.0.1:9", "--json"], "--json: expected one argument", 2),
    (["bench", "--size", "lots"], "bad size 'lots'", 2),
    (["bench", "--modes", "rdma"], "unknown mode(s) rdma", 2),
    (["frobnicate"], "invalid choice", 2),
])
def test_bad_arguments_one_clear_line(tmp_path, args, text, code):
    args = [str(tmp_path / "x") if a == "/tmp/x" else a for a in args]
    out = run_cli(*args)
    assert out.returncode == code
    assert text in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "x").exists()          # nothing created on a bad argument


def test_daemon_on_a_taken_port_fails_cleanly():
    with LocalDaemons(1, slab_size=MiB, capacity=4 * MiB) as one:
        out = run_cli("daemon", "--bind", one.addresses[0], "--slab-size", "1M", "--capacity",
                      "4M", "--no-lock")
        assert out.returncode == 1
        assert "cannot bind the daemon's control socket" in out.stderr
        assert "Traceback" not in out.stderr


def test_a_daemon_started_by_local_dies_with_its_parent(tmp_path):
    # a test or bench killed hard must not leave daemons behind (--exit-with-parent)
    script = tmp_path / "parent.py"
    script.write_text("import time\nfrom infiniswap.local import DaemonProcess\n"
                      "d = DaemonProcess(slab_size=1 << 20, capacity=16 << 20, headroom=2 << 20)\nd.start()\nprint(d.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    daemon_pid = None
    try:
        daemon_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and psutil.pid_exists(daemon_pid) and \
                psutil.Process(daemon_pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        assert not psutil.pid_exists(daemon_pid) or psutil.Process(daemon_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if parent.poll() is None:
            parent.kill()
        if daemon_pid and psutil.pid_exists(daemon_pid):
            try:
                os.kill(daemon_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
