"""A job's output and a full state disk must not sink the master.

Attacks, scaled down: (1) a job prints 200 MB as fast as it can into a master whose state dir is
a 64 MiB tmpfs: its log is rotated at ``--max-log-bytes`` (the disk never fills), the log API
keeps absolute offsets, and a victim's job runs; (2) a job fills the state disk to the last
byte (through its uncapped checkpoint dir) and exits while it is full, as does a bystander's
job: submits answer 507 naming the path and ``--min-free-bytes`` while reads keep working,
and once the space is freed both runs' ends are recorded (no phantom running job), the GPUs
are free and a victim's 2-GPU job is scheduled and completes. (3) In-process, SQLite itself
refuses writes (``max_page_count``): the master's in-memory view stays right, nothing is
dropped, and the database catches up when space returns.

The tmpfs is mounted and unmounted by the test (root needed; skipped otherwise).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tiresias.service.client import Client, ClientError
from tiresias.service.executor import NodeInfo, RunEnd
from tiresias.service.master import Master, MasterConfig, NoSpace
from tiresias.service.reports import ReportFeed
from tiresias_live import MasterProcess, wait_for

pytestmark = pytest.mark.timeout(180)

FS_BYTES = 64 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root needed): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def add_user(m: MasterProcess, name: str) -> Client:
    r = m.cli("master", "users", "add", name, "--json", "-")
    assert r.returncode == 0, r.stderr
    import json
    return Client(m.client.url, json.loads(r.stdout)["token"])


def submit(c: Client, gpus: int, code: str, name: str) -> int:
    return c.post("/api/v1/jobs", {"gpus": gpus, "name": name, "launcher": "plain",
                                   "command": [sys.executable, "-c", code], "workdir": "/"})["id"]


def status(c: Client, job_id: int) -> str:
    return c.get(f"/api/v1/jobs/{job_id}")["status"]


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


FLOOD = "import sys\nb = b'x' * 65535 + b'\\n'\nfor _ in range(3200): sys.stdout.buffer.write(b)\nprint('LAST LINE')"


def test_output_flood_is_capped_by_rotation(small_disk, tmp_path):
    cap = 2 << 20
    m = MasterProcess(small_disk / "state", "--nodes", "1x2", "--interval", "0.3",
                      "--max-log-bytes", str(cap), log=tmp_path / "master.log").start()
    try:
        mallory, alice = add_user(m, "mallory"), add_user(m, "alice")
        flood = submit(mallory, 1, FLOOD, "flood")                     # 200 MiB of output
        wait_for(lambda: status(mallory, flood) in ("finished", "failed"), 120, "the flood job to end")
        assert status(mallory, flood) == "finished"
        log = m.state / "jobs" / str(flood) / "job.log"
        sizes = [os.path.getsize(p) for p in (log, str(log) + ".1")]
        assert all(s <= cap for s in sizes), sizes                     # at most twice the cap in all
        assert free_bytes(small_disk) > FS_BYTES // 2
        first = mallory.get(f"/api/v1/jobs/{flood}/logs?offset=0")     # rotated away: the oldest kept
        kept_from = first["offset"] - len(first["data"])
        assert kept_from > 190 * 10 ** 6                                 # offsets count all the job wrote
        text, offset = first["data"], first["offset"]
        while True:                                                      # what `tiresias logs -f` does
            out = mallory.get(f"/api/v1/jobs/{flood}/logs?offset={offset}")
            if not out["data"]:
                break
            text, offset = text + out["data"], out["offset"]
        assert offset == kept_from + len(text) and len(text) <= 2 * cap
        assert "LAST LINE" in text and "ended with exit code 0" in text
        victim = submit(alice, 2, "print('victim ok')", "victim")
        wait_for(lambda: status(alice, victim) == "finished", 60, "the victim's job to finish")
        assert "victim ok" in alice.get(f"/api/v1/jobs/{victim}/logs")["data"]
    finally:
        m.stop()


FILL = """
import os, errno, time
d = os.environ['TIRESIAS_CHECKPOINT_DIR']
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, 'filler'), 'wb', buffering=0) as f:
    chunk = b'\\0' * (1 << 20)
    while True:
        try:
            f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC: raise
            break
    for size in (1 << 16, 4096, 512, 1):
        try:
            while True: f.write(b'\\0' * size)
        except OSError:
            pass
print('the disk is full')
"""

BYSTANDER = """
import os, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    print('working', flush=True)
    time.sleep(0.05)
"""


def test_full_state_disk_loses_no_run_end(small_disk, tmp_path):
    m = MasterProcess(small_disk / "state", "--nodes", "1x2", "--interval", "0.3",
                      log=tmp_path / "master.log").start()
    try:
        mallory, alice, bob = add_user(m, "mallory"), add_user(m, "alice"), add_user(m, "bob")
        go = tmp_path / "go"                                            # outside the small disk
        bystander = alice.post("/api/v1/jobs", {"gpus": 1, "name": "bystander", "launcher": "plain", "workdir": "/",
                                                "command": [sys.executable, "-c", BYSTANDER, str(go)]})["id"]
        wait_for(lambda: status(alice, bystander) == "running", 30, "the bystander to run")
        filler = submit(mallory, 1, FILL, "fill")
        wait_for(lambda: free_bytes(small_disk) < 64 << 10, 60, "the disk to fill")
        # the disk is full: submits refused with 507, reads still served
        with pytest.raises(ClientError) as refused:
            submit(bob, 1, "pass", "refused")
        assert refused.value.status == 507
        text = str(refused.value)
        assert str(small_disk / "state") in text and "--min-free-bytes" in text and "bytes free" in text
        assert len(text.splitlines()) == 1
        assert alice.get("/api/v1/jobs")[0]["id"] == bystander
        assert m.client.get("/api/v1/dashboard")["summary"]["gpus"] == 2
        go.touch()                                                      # the bystander ends on a full disk
        time.sleep(1.5)                                                 # both runs have ended by now
        os.unlink(m.state / "checkpoints" / str(filler) / "checkpoint" / "filler")   # the operator frees space
        wait_for(lambda: status(alice, bystander) == "finished", 30, "the bystander's end to be recorded")
        wait_for(lambda: status(mallory, filler) == "finished", 30, "the filler's end to be recorded")
        nodes = m.client.get("/api/v1/nodes")
        assert nodes[0]["free_gpus"] == 2 and nodes[0]["jobs"] == {}    # no phantom GPU
        victim = submit(bob, 2, "print('bob ok')", "victim")
        wait_for(lambda: status(bob, victim) == "finished", 60, "the victim's 2-GPU job to finish")
        summary = m.client.get("/api/v1/summary")
        assert summary["state_disk"]["pending_writes"] == 0 and summary["gpus_used"] == 0
        assert summary["jobs"] == {"finished": 3}
        runs = alice.get(f"/api/v1/jobs/{bystander}")["runs"]
        assert [r["outcome"] for r in runs] == ["exit 0"]
        assert "working" in alice.get(f"/api/v1/jobs/{bystander}/logs")["data"]
    finally:
        m.stop()


# --- in process: SQLite refuses writes -----------------------------------------------------------------
class Executor:
    name = "fake"

    def __init__(self) -> None:
        self.ended: list[RunEnd] = []

    def nodes(self):
        return [NodeInfo("node0", 2)]

    def launch(self, spec):
        return {"fake": spec.job_id}

    def terminate(self, *a, **k):
        pass

    def poll(self):
        out, self.ended = self.ended, []
        return out

    def reconcile(self, runs):
        return []

    def close(self):
        pass


def test_sqlite_full_keeps_the_run_end(tmp_path):
    ex = Executor()
    m = Master(MasterConfig(str(tmp_path / "state"), interval=1.0), ex, reports=ReportFeed())
    try:
        first = m.submit({"gpus": 2, "command": ["x"], "name": "a", "workdir": "/"}, owner="alice")["id"]
        m.tick()
        assert m.job(first)["status"] == "running"
        db = m.store._db
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        for i in range(50):                                           # fill what pages are left
            m.store.event("filler", None, "x" * 4000)
        ex.ended.append(RunEnd(first, 1, 0))
        m.tick()                                                      # the end arrives on a full database
        assert m.store.pending_writes() > 0
        assert m.job(first)["status"] == "running"                   # the row is behind ...
        assert first not in m.runs and m.nodes()[0]["free_gpus"] == 2  # ... the master's view is not
        with pytest.raises(NoSpace):
            m.submit({"gpus": 2, "command": ["x"], "name": "b", "workdir": "/"}, owner="bob")
        db.execute("PRAGMA max_page_count = 1073741823")              # space returns
        m.tick()
        assert m.store.pending_writes() == 0
        assert m.job(first)["status"] == "finished"
        assert [r["outcome"] for r in m.job(first)["runs"]] == ["exit 0"]
        second = m.submit({"gpus": 2, "command": ["x"], "name": "b", "workdir": "/"}, owner="bob")["id"]
        m.tick()
        assert m.job(second)["status"] == "running"                   # the freed GPUs are schedulable
    finally:
        m.close()

