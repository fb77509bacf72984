"""One owner per state directory, with real processes (DESIGN §6): a second ``tiresias
master`` / ``autops master`` on the same state exits 1 at once naming the owner's pid and
URL, binds nothing and writes nothing; the admin commands work beside the owner; an owner
killed with SIGKILL leaves a lock the next master takes over."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from dlrt import statelock
from tiresias_live import BIN, MasterProcess, wait_for
from ports import free_port

pytestmark = pytest.mark.timeout(180)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def snapshot(state: pathlib.Path, names: tuple[str, ...]) -> dict[str, tuple[bytes, int]]:
    return {n: ((state / n).read_bytes(), (state / n).stat().st_mtime_ns) for n in names}


def assert_refused(proc: subprocess.CompletedProcess, pid: int, url: str) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"pid {pid}" in lines[0] and url in lines[0], lines[0]
    assert "listening" not in proc.stdout
    return lines[0]


@pytest.fixture
def masters(tmp_path):
    started = []

    def start(*args: str) -> MasterProcess:
        m = MasterProcess(tmp_path / "state", "--nodes", "1x2", "--interval", "0.5", *args).start()
        started.append(m)
        return m
    yield start
    for m in started:
        m.stop()


def test_a_second_tiresias_master_exits_naming_the_owner_and_a_killed_one_is_taken_over(masters, tmp_path):
    first = masters()
    state = first.state
    owner = json.loads((state / "master.json").read_text())
    assert owner["pid"] == first.proc.pid
    before = snapshot(state, ("master.json", "token"))
    port = free_port()
    started = time.monotonic()
    second = subprocess.run([str(BIN / "tiresias"), "master", "--state", str(state), "--bind", f"127.0.0.1:{port}",
                             "--nodes", "1x2"], capture_output=True, text=True, timeout=60)
    line = assert_refused(second, first.proc.pid, owner["url"])
    assert line.startswith("tiresias master: error: state dir ") and "--state" in line
    assert time.monotonic() - started < 30
    assert port_free(port)                               # it never bound its port
    assert snapshot(state, ("master.json", "token")) == before
    assert first.proc.poll() is None and first.client.get("/api/v1/nodes")    # the owner serves on

    # the admin commands on the state keep working beside the running master
    added = first.cli("master", "users", "add", "alice")
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip().splitlines()[-1]
    listed = first.cli("master", "users", "list", "--json", "-")
    assert listed.returncode == 0 and [u["name"] for u in json.loads(listed.stdout)] == ["alice"]
    (tmp_path / "alice.token").write_text(token)
    jobs = subprocess.run([str(BIN / "tiresias"), "jobs", "--master", owner["url"], "--token-file",
                           str(tmp_path / "alice.token"), "--json", "-"], capture_output=True, text=True, timeout=60)
    assert jobs.returncode == 0 and json.loads(jobs.stdout) == [], jobs.stderr   # the master took it at once

    # SIGKILL: the kernel drops the lock; the next master takes the state over
    first.kill(signal.SIGKILL)
    third = masters()
    now = json.loads((state / "master.json").read_text())
    assert now["pid"] == third.proc.pid != first.proc.pid
    wait_for(lambda: (statelock.read_owner(state) or {}).get("url") == now["url"], 10, "the new owner's URL")
    assert statelock.read_owner(state)["pid"] == third.proc.pid
    assert third.cli("master", "users", "list", "--json", "-").returncode == 0


def autops_master(state_dir: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autops.cli", "master", "--bind", f"127.0.0.1:{free_port()}",
                             "--state-dir", str(state_dir)], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def recorded_owner(state_dir: pathlib.Path, proc: subprocess.Popen, log: pathlib.Path) -> dict:
    def recorded():
        assert proc.poll() is None, f"pMaster exited {proc.returncode}: {log.read_text()[-2000:]}"
        owner = statelock.read_owner(state_dir)
        return owner if owner and owner.get("pid") == proc.pid and owner.get("url") else None
    return wait_for(recorded, 30, f"pMaster {proc.pid} to record its address")


def test_a_second_pmaster_exits_naming_the_owner_and_a_killed_one_is_taken_over(tmp_path):
    state_dir = tmp_path / "autops-state"
    procs = []
    try:
        first = autops_master(state_dir, tmp_path / "first.log")
        procs.append(first)
        owner = recorded_owner(state_dir, first, tmp_path / "first.log")
        assert owner["url"].startswith("tcp://127.0.0.1:")
        secrets_db = sorted(p.name for p in state_dir.iterdir())
        port = free_port()
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "autops.cli", "master", "--bind", f"127.0.0.1:{port}",
                                 "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=60)
        line = assert_refused(second, first.pid, owner["url"])
        assert line.startswith("autops master: error: state dir ") and "--state-dir" in line
        assert time.monotonic() - started < 30 and port_free(port)
        assert sorted(p.name for p in state_dir.iterdir()) == secrets_db
        assert first.poll() is None

        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        third = autops_master(state_dir, tmp_path / "third.log")
        procs.append(third)
        assert recorded_owner(state_dir, third, tmp_path / "third.log")["url"].startswith("tcp://127.0.0.1:")
        assert third.poll() is None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
