"""The live master with real processes: local executor, preemption by checkpoint, restart.

Each test runs a real ``tiresias master`` (local executor, 127.0.0.1, port 0) and real jobs
(``tiresias_jobs/counter.py``: counts steps, checkpoints when asked, refuses to run twice at
once). Decisions are checked through the API and the jobs' own records, never by timing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tiresias_live import BIN, MasterProcess, counter, steps, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def master(tmp_path):
    started = []

    def start(*args, state="state"):
        m = MasterProcess(tmp_path / state, *args).start()
        started.append(m)
        return m
    yield start
    for m in started:
        m.stop()


def test_preempt_checkpoint_resume_and_a_job_that_ignores_the_request(master, tmp_path):
    m = master("--nodes", "1x2", "--interval", "0.5", "--stop-grace", "2", "--thresholds", "2")
    a = m.submit(2, *counter(30, 0.1), name="polite")
    m.wait_status(a, "running")
    wait_for(lambda: len(steps(m.state, a)) >= 12, 30, "job a to pass its threshold")
    b = m.submit(2, *counter(5, 0.1), name="short")
    done_b = m.wait_status(b, "finished")
    done_a = m.wait_status(a, "finished")
    assert done_a["preemptions"] >= 1 and done_a["run"] >= 2
    assert done_b["started"] < done_a["ended"]
    # resumed at the step it saved: every step ran exactly once, in order
    assert steps(m.state, a) == list(range(1, 31))
    log = m.cli("logs", str(a)).stdout
    assert "stopped at step" in log and "start at step 0" in log and "done at step 30" in log
    assert any(line.startswith("start at step") and not line.startswith("start at step 0")
               for line in log.splitlines())
    kinds = [e["kind"] for e in m.client.get(f"/api/v1/events?job={a}")]
    assert "stopping" in kinds and "preempted" in kinds and "resumed" in kinds and "sigterm" not in kinds

    # a job that ignores the stop request: SIGTERM after the grace period, resumed later
    c = m.submit(2, *counter(80, 0.1, "--ignore-stop"), name="ignores-stop")
    m.wait_status(c, "running")
    wait_for(lambda: len(steps(m.state, c)) >= 12, 30, "job c to pass its threshold")
    d = m.submit(2, *counter(3, 0.1), name="urgent")
    m.wait_status(d, "finished")
    done_c = m.wait_status(c, "finished")
    kinds = [e["kind"] for e in m.client.get(f"/api/v1/events?job={c}")]
    assert "sigterm" in kinds and kinds.count("preempted") >= 1 and kinds[-1] == "finished"
    assert done_c["preemptions"] >= 1
    for job_id in (a, b, c, d):
        assert not (m.state / "checkpoints" / str(job_id) / "checkpoint" / "DOUBLE").exists()


def test_failing_job_is_marked_failed_with_its_log_tail_others_unaffected(master):
    m = master("--nodes", "2x2", "--interval", "0.5")
    ok = m.submit(1, *counter(10, 0.05), name="fine")
    bad = m.submit(2, *counter(10, 0.05, "--fail-at", "2"), name="broken")
    failed = m.wait_status(bad, "failed")
    assert failed["exit_code"] == 3 and "failing on purpose" in failed["detail"]
    assert m.wait_status(ok, "finished")["exit_code"] == 0
    follow = m.cli("logs", str(ok), "--follow")        # returns once the job has ended
    assert follow.returncode == 0 and "done at step 10" in follow.stdout
    view = m.cli("jobs", "--json", "-")
    jobs = {j["id"]: j for j in json.loads(view.stdout)}
    for key in ("id", "name", "status", "gpus", "submitted", "started", "ended", "preemptions",
                "attained_service", "placement"):
        assert key in jobs[ok]
    assert jobs[bad]["status"] == "failed" and jobs[ok]["status"] == "finished"


def test_master_sigkill_and_restart_keeps_every_job_and_runs_none_twice(master, tmp_path):
    args = ("--nodes", "2x2", "--interval", "0.5", "--stop-grace", "2")
    m = master(*args)
    long_ = m.submit(2, *counter(60, 0.1), name="long")
    quick = m.submit(2, *counter(8, 0.1), name="quick")
    waiting = m.submit(2, *counter(5, 0.1), name="later")
    m.wait_status(long_, "running")
    m.wait_status(quick, "running")
    before = m.job(long_)
    wait_for(lambda: m.job(long_)["attained_service"] >= 4, 30, "service to accrue")
    m.kill(signal.SIGKILL)
    # while the master is down, "quick" finishes on its own and "long" keeps running
    wait_for(lambda: len(steps(m.state, quick)) == 8, 30, "quick to finish without a master")
    m2 = master(*args)                     # same state dir
    assert m2.job(quick)["status"] == "finished"
    after = m2.job(long_)
    assert after["status"] == "running" and after["run"] == before["run"] == 1
    m2.wait_status(waiting, "finished")
    done = m2.wait_status(long_, "finished")
    assert done["run"] == 1 and steps(m.state, long_) == list(range(1, 61))
    # service kept within a scheduling interval: the job ran ~6 s on 2 GPUs, start to end
    ran = done["ended"] - done["started"]
    assert abs(done["attained_service"] - 2 * ran) <= 2 * 1.0
    for job_id in (long_, quick, waiting):
        assert not (m.state / "checkpoints" / str(job_id) / "checkpoint" / "DOUBLE").exists()
    kinds = [e["kind"] for e in m2.client.get("/api/v1/events?limit=500")]
    assert "recovered" in kinds


def test_cli_refusals_and_usage_errors(master, tmp_path):
    m = master("--nodes", "1x2")
    r = m.cli("submit", "--gpus", "3", "--", "true")
    assert r.returncode == 1 and "cluster has 2" in r.stderr and "Traceback" not in r.stderr
    r = m.cli("submit", "--gpus", "1")
    assert r.returncode == 2 and "no command" in r.stderr
    r = m.cli("submit", "--gpus", "1", "--memory", "lots", "--", "true")
    assert r.returncode == 2 and "size" in r.stderr
    r = m.cli("job", "999")
    assert r.returncode == 1 and "no job 999" in r.stderr
    bad_token = tmp_path / "bad-token"
    bad_token.write_text("nope\n")
    url = json.loads((m.state / "master.json").read_text())["url"]
    r = subprocess.run([str(BIN / "tiresias"), "jobs", "--master", url, "--token-file", str(bad_token)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "token" in r.stderr
    r = subprocess.run([str(BIN / "tiresias"), "master", "--state", str(tmp_path / "x"), "--policy", "nope"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert m.cli("jobs", "--json", "-").stdout.strip() == "[]"      # nothing stored
    assert oct(os.stat(m.state / "token").st_mode & 0o777) == "0o600"
    r = subprocess.run([str(BIN / "tiresias")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "master" in r.stdout


def test_sigkill_reaches_torchrun_workers_in_their_own_sessions(master, tmp_path):
    """torchrun starts workers in new sessions; a cancelled job that ignores SIGTERM must still
    leave no worker behind."""
    import sys
    from tiresias_live import JOBS
    piddir = tmp_path / "pids"
    piddir.mkdir()
    m = master("--nodes", "1x2", "--interval", "0.5", "--stop-grace", "1")
    j = m.submit(2, sys.executable, str(JOBS / "sigterm_ignoring_worker.py"), str(piddir), name="ignores-stop",
                 launcher="torchrun")
    m.wait_status(j, "running")
    pids = wait_for(lambda: len(list(piddir.iterdir())) == 2 and [int(p.read_text()) for p in piddir.iterdir()],
                    60, "two torchrun workers")
    for pid in pids:
        assert os.getsid(pid) == pid          # each worker leads a session of its own
    m.client.post(f"/api/v1/jobs/{j}/cancel")
    m.wait_status(j, "cancelled", 60)
    kinds = [e["kind"] for e in m.client.get(f"/api/v1/events?job={j}")]
    assert "sigkill" in kinds or "sigterm" in kinds

    def gone(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True
    wait_for(lambda: all(gone(p) for p in pids), 30, "the workers to be gone")


@pytest.mark.skipif(os.geteuid() != 0, reason="memory cgroups need root")
def test_declared_memory_is_enforced_by_a_cgroup_of_that_size(master, tmp_path):
    import sys
    out = tmp_path / "limit.txt"
    probe = ("import os, sys\n"
             "line = [l for l in open('/proc/self/cgroup') if 'memory' in l or l.startswith('0::')][0]\n"
             "path = line.strip().split(':', 2)[2]\n"
             "root = '/sys/fs/cgroup/memory' if os.path.isdir('/sys/fs/cgroup/memory' + path) else '/sys/fs/cgroup'\n"
             "name = 'memory.limit_in_bytes' if root.endswith('memory') else 'memory.max'\n"
             "open(sys.argv[1], 'w').write(path + ' ' + open(root + path + '/' + name).read())\n")
    m = master("--nodes", "1x2")
    j = m.submit(1, sys.executable, "-c", probe, str(out), name="limited", memory=64 << 20)
    assert m.wait_status(j, ("finished", "failed"))["status"] == "finished", m.job(j)["detail"]
    path, limit = out.read_text().split()
    assert "tiresias" in path and int(limit) == 64 << 20
    leftover = [p for p in ("/sys/fs/cgroup/memory" + path, "/sys/fs/cgroup" + path) if os.path.isdir(p)]
    assert leftover == []                          # removed when the run ended


def test_a_run_whose_supervisor_is_killed_is_stopped_before_it_runs_again(master, tmp_path):
    m = master("--nodes", "1x1", "--interval", "0.5")
    j = m.submit(1, *counter(25, 0.1), name="orphaned")
    m.wait_status(j, "running")
    wait_for(lambda: len(steps(m.state, j)) >= 5, 30, "the job to count a few steps")
    run1 = m.state / "jobs" / str(j) / "run1"
    groups = json.loads((run1 / "groups.json").read_text())["groups"]
    os.kill(int((run1 / "supervisor.pid").read_text()), signal.SIGKILL)
    done = m.wait_status(j, ("finished", "failed"))
    assert done["status"] == "finished" and done["run"] >= 2, done
    kinds = [e["kind"] for e in m.client.get(f"/api/v1/events?job={j}")]
    assert "lost" in kinds
    assert not (m.state / "checkpoints" / str(j) / "checkpoint" / "DOUBLE").exists()   # never ran twice at once
    for pgid in groups:                          # the lost run's processes were stopped
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
