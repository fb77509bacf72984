"""One user's flood of jobs, and readers hammering the dashboard, must not sink the master.

Attacks, scaled down: (1) mallory submits as fast as four threads can: past her burst the
rate limit answers 429 with ``Retry-After`` naming ``--submit-rate-per-user``, past her
queued cap 429 naming ``--max-queued-per-user``; no more than the cap is stored, alice's job
is still accepted, scheduled and completes, and the operator's token is not limited. (2) A
state with 3,000 ended jobs (1,000 of them past ``--retention``) and four readers hammering
the dashboard: the old ones are pruned (404, dirs gone), the dashboard holds the active jobs
plus the latest 200 ended ones while its counts still cover every job, list reads are bounded,
and a victim's reads are answered meanwhile (its latency is printed, not asserted).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tiresias.service.client import Client
from tiresias.service.store import Store
from tiresias_live import MasterProcess, wait_for

pytestmark = pytest.mark.timeout(180)


def add_user(m: MasterProcess, name: str, role: str = "user") -> Client:
    r = m.cli("master", "users", "add", name, "--role", role, "--json", "-")
    assert r.returncode == 0, r.stderr
    return Client(m.client.url, json.loads(r.stdout)["token"])


def post(c: Client, spec: dict) -> tuple[int, dict, dict]:
    """(status, headers, body) of one submit, without raising on 4xx."""
    req = urllib.request.Request(c.url + "/api/v1/jobs", data=json.dumps(spec).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {c.token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def job(name: str, *command: str) -> dict:
    return {"gpus": 1, "name": name, "launcher": "plain", "workdir": "/", "command": list(command)}


def test_submit_flood_is_throttled_per_user(tmp_path):
    m = MasterProcess(tmp_path / "state", "--nodes", "1x4", "--interval", "0.3", "--thresholds", "2",
                      "--stop-grace", "0.5", "--min-run-factor", "0", "--max-queued-per-user", "10",
                      "--submit-rate-per-user", "600", "--submit-burst", "4").start()
    try:
        mallory, alice = add_user(m, "mallory"), add_user(m, "alice")
        answers: list[tuple[int, dict, dict]] = []
        lock = threading.Lock()
        deadline = time.monotonic() + 4.0

        def flood() -> None:
            while time.monotonic() < deadline:
                a = post(mallory, job("spam", "sleep", "60"))
                with lock:
                    answers.append(a)
                if sum(1 for s, _, b in answers if s == 429 and "--max-queued-per-user" in b["error"]) > 20:
                    return
        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        codes = [s for s, _, _ in answers]
        assert set(codes) == {201, 429}, set(codes)
        refused = [(h, b["error"]) for s, h, b in answers if s == 429]
        rate = [e for _, e in refused if "--submit-rate-per-user" in e]
        queued = [e for _, e in refused if "--max-queued-per-user" in e]
        assert rate and queued and len(rate) + len(queued) == len(refused)
        assert all(int(h["Retry-After"]) >= 1 for h, _ in refused)
        assert all(len(e.splitlines()) == 1 and "mallory" in e for _, e in refused)
        assert codes.count(201) == 10                                   # exactly the cap stored
        assert len(m.client.get("/api/v1/jobs?status=waiting,running,stopping,preempted")) == 10
        # the victim: accepted, and (behind at most the cap of mallory's jobs) scheduled and completes
        victim = alice.post("/api/v1/jobs", job("victim", sys.executable, "-c", "print('alice ok')"))["id"]
        wait_for(lambda: alice.get(f"/api/v1/jobs/{victim}")["status"] == "finished", 60, "alice's job to finish")
        assert "alice ok" in alice.get(f"/api/v1/jobs/{victim}/logs")["data"]
        # the operator's token is not limited
        ops = [post(m.client, job(f"op{i}", "true"))[0] for i in range(40)]
        assert ops == [201] * 40
    finally:
        m.stop()


def seed(state, now: float, ended: int, old: int) -> list[int]:
    """``ended`` finished jobs of carol's in a fresh state dir, the first ``old`` ended 40 days ago."""
    os.makedirs(state, exist_ok=True)
    store = Store(os.path.join(state, "state.db"))
    spec = json.dumps({"name": "old", "gpus": 1, "command": ["true"], "launcher": "plain", "workdir": "/"})
    rows = [("old", spec, 1, "finished", now - 50 * 86400 + i, now - (40 if i < old else 1) * 86400 + i,
             now - 50 * 86400 + i, "carol") for i in range(ended)]
    with store._tx() as db:
        db.executemany("INSERT INTO jobs(name, spec, gpus, status, submitted, ended, wait_since, owner) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        db.executemany("INSERT INTO events(time, job_id, kind, detail) VALUES (?, ?, 'finished', 'old')",
                       [(r[5], i + 1) for i, r in enumerate(rows)])
    store.close()
    for job_id in (1, old + 1):
        os.makedirs(os.path.join(state, "jobs", str(job_id)), exist_ok=True)
    return list(range(1, ended + 1))


def victim_latency(c: Client, job_id: int, n: int = 40) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.get(f"/api/v1/jobs/{job_id}")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def test_dashboard_readers_and_retention(tmp_path):
    state = tmp_path / "state"
    ids = seed(str(state), time.time(), 3000, 1000)
    m = MasterProcess(state, "--nodes", "1x2", "--interval", "0.3", "--retention", "30d").start()
    try:
        alice, viewer = add_user(m, "alice"), add_user(m, "dave", "viewer")
        wait_for(lambda: m.client.get("/api/v1/summary")["jobs"].get("finished") == 2000, 30,
                 "the jobs past the retention to be pruned")
        assert not (state / "jobs" / "1").exists() and (state / "jobs" / str(1001)).exists()
        code = post(m.client, {})[0]
        assert code == 400
        for gone in (1, 1000):
            req = urllib.request.Request(f"{m.client.url}/api/v1/jobs/{gone}",
                                         headers={"Authorization": f"Bearer {m.client.token}"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 404
        mine = alice.post("/api/v1/jobs", job("mine", "sleep", "30"))["id"]
        wait_for(lambda: alice.get(f"/api/v1/jobs/{mine}")["status"] == "running", 30, "alice's job to run")
        quiet = victim_latency(alice, mine)
        stop = threading.Event()
        reads = [0] * 4

        def hammer(i: int) -> None:
            while not stop.is_set():
                viewer.get("/api/v1/dashboard")
                reads[i] += 1
        readers = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in readers:
            t.start()
        try:
            time.sleep(0.5)
            loaded = victim_latency(alice, mine)
        finally:
            stop.set()
            for t in readers:
                t.join(30)
        print(f"\nvictim GET /api/v1/jobs/{mine}: median {quiet:.1f} ms alone, {loaded:.1f} ms with 4 dashboard "
              f"readers ({sum(reads)} dashboard reads)")
        board = viewer.get("/api/v1/dashboard")
        assert len(board["jobs"]) == 200 + 1                            # latest 200 ended + the active one
        assert board["summary"]["jobs"] == {"finished": 2000, "running": 1}
        assert board["summary"]["finished"] == 2000 and board["summary"]["avg_jct"] is not None
        assert max(j["id"] for j in board["jobs"] if j["status"] == "finished") == ids[-1]
        assert len(m.client.get("/api/v1/jobs")) == 1000                # list reads are bounded too
        latest = m.client.get("/api/v1/jobs?limit=3")
        assert [j["id"] for j in latest] == [ids[-2], ids[-1], mine]
        assert [j["id"] for j in alice.get("/api/v1/jobs")] == [mine]
    finally:
        m.stop()
