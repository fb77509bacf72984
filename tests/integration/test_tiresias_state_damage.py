"""A damaged ``STATE/state.db`` is refused at start with one line naming the file and its
backup (``STATE/state.db.bak``, kept by the master); restoring that backup as the line says
brings the master back with its jobs."""
from __future__ import annotations

import re
import sqlite3
import subprocess
import sys

import pytest

from tiresias_live import MasterProcess

PAGE = 4096


def start_refused(state) -> subprocess.CompletedProcess:
    """``tiresias master`` on ``state``, expected to refuse at once."""
    out = subprocess.run([sys.executable, "-m", "tiresias.cli", "master", "--state", str(state),
                          "--bind", "127.0.0.1:0", "--nodes", "1x2"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return out


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A state dir a master ran on (three finished jobs), stopped cleanly; its state.db bytes."""
    state = tmp_path_factory.mktemp("damage") / "state"
    m = MasterProcess(state, "--nodes", "1x2", "--interval", "0.2").start()
    try:
        ids = [m.submit(1, sys.executable, "-c", "pass", name=f"job{i}") for i in range(3)]
        for job_id in ids:
            m.wait_status(job_id, "finished")
    finally:
        m.stop()
    db = state / "state.db"
    assert (state / "state.db.bak").stat().st_size > 0          # made at start and at the clean stop
    assert (state / "state.db.bak").stat().st_mode & 0o777 == 0o600
    return state, ids, db.read_bytes()


@pytest.fixture
def state(stopped, tmp_path):
    """A fresh copy of the stopped state dir's database and backup."""
    src, ids, data = stopped
    dst = tmp_path / "state"
    dst.mkdir()
    (dst / "state.db").write_bytes(data)
    (dst / "state.db.bak").write_bytes((src / "state.db.bak").read_bytes())
    return dst, ids


def test_a_page_overwritten_mid_file_is_refused_and_the_backup_restores_every_job(state):
    state, ids = state
    db = state / "state.db"
    data = bytearray(db.read_bytes())
    pages = len(data) // PAGE
    assert pages >= 3
    mid = pages // 2 * PAGE
    data[mid:mid + PAGE] = b"\xa5" * PAGE
    db.write_bytes(bytes(data))
    out = start_refused(state)
    assert str(db) in out.stderr and "corrupt" in out.stderr
    assert f"{db}.bak" in out.stderr
    command = re.search(r"with: (.*?) \(", out.stderr).group(1)
    assert command.startswith("rm -f") and f"cp {db}.bak {db}" in command
    subprocess.run(command, shell=True, check=True, timeout=30)
    m = MasterProcess(state, "--nodes", "1x2").start()
    try:
        jobs = m.client.get("/api/v1/jobs")
        assert [j["id"] for j in jobs] == ids and {j["status"] for j in jobs} == {"finished"}
    finally:
        m.stop()


def test_an_empty_state_db_is_refused_not_started_fresh(state):
    state, _ = state
    db = state / "state.db"
    db.write_bytes(b"")
    out = start_refused(state)
    assert str(db) in out.stderr and "empty" in out.stderr and f"{db}.bak" in out.stderr
    assert db.stat().st_size == 0                                # nothing was written
    (state / "state.db.bak").unlink()
    out = start_refused(state)
    assert "no backup" in out.stderr


def test_a_malformed_job_row_is_named_by_job_id_and_file(state):
    state, ids = state
    db = state / "state.db"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE jobs SET spec = '{not json' WHERE id = ?", (ids[1],))
    conn.close()
    out = start_refused(state)
    assert f"job {ids[1]}" in out.stderr and str(db) in out.stderr and "spec" in out.stderr


def test_a_missing_state_db_is_still_a_fresh_start(tmp_path):
    m = MasterProcess(tmp_path / "state", "--nodes", "1x2").start()
    try:
        assert m.client.get("/api/v1/jobs") == []
    finally:
        m.stop()
