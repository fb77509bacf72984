"""``joblog.CappedLog``: a job's log rotated at its cap, read back with absolute offsets.

Checks that the files never exceed the cap (so a job's logs take at most twice it), that the
newest output is always kept and the oldest dropped, that offsets keep their meaning across
rotations (a follower neither repeats nor skips what is kept), that a pipe is pumped to EOF,
that a second writer of the same log (the Ray executor's nodes) reopens after the other
rotated, and that a full disk drops output (counted, noted later) instead of raising.
"""
from __future__ import annotations

import errno
import os

import pytest

from tiresias.service import joblog
from tiresias.service.joblog import CappedLog


def sizes(path):
    return [os.path.getsize(p) for p in (path, path + ".1") if os.path.exists(p)]


def test_rotates_at_the_cap_and_keeps_the_newest(tmp_path):
    path = str(tmp_path / "job.log")
    log = CappedLog(path, 1000)
    data = b"".join(f"{i:07d}\n".encode() for i in range(1000))       # 8000 bytes
    for i in range(0, len(data), 300):
        log.write(data[i:i + 300])
    assert all(s <= 1000 for s in sizes(path)) and sum(sizes(path)) <= 2000
    kept, end = joblog.read_log(path, 0, 1 << 20)
    assert end == len(data)                                         # absolute: bytes ever written
    assert data.endswith(kept) and len(kept) >= 1000                 # the newest, contiguous
    assert joblog.tail(path, 16) == data[-16:]
    assert not os.path.exists(path + ".2")


def test_offsets_survive_rotation_for_a_follower(tmp_path):
    path = str(tmp_path / "job.log")
    log = CappedLog(path, 500)
    written, seen, offset = b"", b"", 0
    for i in range(60):
        chunk = f"line {i:04d} ".encode() * 3
        log.write(chunk)
        written += chunk
        if i % 2:                                                    # the follower keeps up
            data, offset = joblog.read_log(path, offset, 1 << 20)
            seen += data
    data, offset = joblog.read_log(path, offset, 1 << 20)
    seen += data
    assert seen == written and offset == len(written)               # nothing repeated, nothing skipped
    data, new = joblog.read_log(path, 0, 100)                        # rotated away: from the oldest kept
    assert written[new - len(data):new] == data and new - len(data) > 0
    assert joblog.read_log(path, 10 ** 9, 100) == (b"", 10 ** 9)      # past the end: nothing


def test_no_cap_and_missing_log(tmp_path):
    path = str(tmp_path / "job.log")
    assert joblog.read_log(path, 0) == (b"", 0) and joblog.tail(path, 10) == b""
    log = CappedLog(path, 0)
    log.write(b"x" * 5000)
    assert sizes(path) == [5000]
    with pytest.raises(ValueError):
        CappedLog(path, -1)


def test_pump_copies_a_pipe_to_eof(tmp_path):
    path = str(tmp_path / "job.log")
    log = CappedLog(path, 4096)
    r, w = os.pipe()
    thread = joblog.start_pump(log, r)
    payload = os.urandom(50_000)
    for i in range(0, len(payload), 7000):
        os.write(w, payload[i:i + 7000])
    os.close(w)
    thread.join(10)
    assert not thread.is_alive()
    data, end = joblog.read_log(path, 0, 1 << 20)
    assert end == len(payload) and payload.endswith(data) and sum(sizes(path)) <= 2 * 4096


def test_two_writers_share_one_log(tmp_path):
    path = str(tmp_path / "job.log")
    a, b = CappedLog(path, 1000), CappedLog(path, 1000)
    for i in range(200):
        (a if i % 2 else b).write(f"{i:05d}\n".encode())
    assert all(s <= 1000 for s in sizes(path))
    data, end = joblog.read_log(path, 0, 1 << 20)
    assert end == 1200 and data.endswith(b"00199\n")
    assert [int(x) for x in data.split()] == list(range(200 - len(data) // 6, 200))


def test_full_disk_drops_and_notes_instead_of_raising(tmp_path, monkeypatch):
    path = str(tmp_path / "job.log")
    log = CappedLog(path, 0)
    log.write(b"before\n")
    real = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    log.write(b"lost " * 10)                                         # no exception
    assert log.dropped == 50 and log.dropped_total == 50
    monkeypatch.setattr(os, "write", real)
    log.write(b"after\n")
    text = open(path).read()
    assert text.startswith("before\n") and "50 bytes of output dropped" in text and text.endswith("after\n")
    assert log.dropped == 0


def test_other_errors_still_raise(tmp_path, monkeypatch):
    log = CappedLog(str(tmp_path / "job.log"), 0)

    def broken(fd, data):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError):
        log.write(b"x")
