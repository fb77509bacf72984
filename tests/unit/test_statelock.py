"""``dlrt.statelock``: one owner per state directory (an exclusive flock on ``owner.lock``)."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dlrt import statelock
from dlrt.statelock import StateLocked

HOLDER = """
import sys, time
from dlrt import statelock
lock = statelock.acquire(sys.argv[1], "holder")
lock.record(url="tcp://127.0.0.1:1234")
print("locked", flush=True)
time.sleep(60)
"""


def start_holder(directory) -> subprocess.Popen:
    """Another process holding ``directory``'s lock (it says 'locked' once it does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_acquire_records_the_owner_and_a_second_acquire_names_it(tmp_path):
    state = tmp_path / "state"
    with statelock.acquire(state, "tiresias master") as lock:        # the directory is made
        lock.record(url="http://127.0.0.1:8470")
        owner = json.loads((state / statelock.LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["program"] == "tiresias master"
        assert owner["url"] == "http://127.0.0.1:8470"
        # flock locks open file descriptions: a second open, even in this process, is refused
        with pytest.raises(StateLocked) as refused:
            statelock.acquire(state, "tiresias master", hint="give another --state")
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and "http://127.0.0.1:8470" in message
        assert "tiresias master" in message and message.endswith("give another --state")
        assert refused.value.owner["pid"] == os.getpid()
    assert not lock.held
    again = statelock.acquire(state, "next")                          # released: free again
    again.release()
    again.release()                                                   # idempotent


def test_an_owner_in_another_process_is_named_and_its_kill_frees_the_lock(tmp_path):
    proc = start_holder(tmp_path)
    try:
        with pytest.raises(StateLocked, match=rf"owned by holder \(pid {proc.pid}, tcp://127\.0\.0\.1:1234\)"):
            statelock.acquire(tmp_path, "me")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
    with statelock.acquire(tmp_path, "me") as lock:           # the stale lock file is taken over
        owner = statelock.read_owner(tmp_path)
        assert owner["pid"] == os.getpid() and owner["program"] == "me" and "url" not in owner
        assert lock.held


def test_children_do_not_inherit_the_lock(tmp_path):
    lock = statelock.acquire(tmp_path, "parent")
    child = subprocess.Popen(["sleep", "30"], close_fds=False)
    try:
        lock.release()
        statelock.acquire(tmp_path, "next").release()         # the child holds nothing
    finally:
        child.kill()
        child.wait(timeout=10)


def test_an_owner_still_writing_its_record_is_named_without_details(tmp_path):
    (tmp_path / statelock.LOCK_NAME).write_text("")
    fd = os.open(tmp_path / statelock.LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)          # a lock taken, its record not written yet
        started = time.monotonic()
        with pytest.raises(StateLocked, match="owned by another process \\(pid unknown, address not yet known\\)"):
            statelock.acquire(tmp_path, "me")
        assert time.monotonic() - started < 5
    finally:
        os.close(fd)
