"""Retention of ended jobs, on a fake clock: the pure policy and the master's ``prune_step``.

Jobs end at known fake times; once the clock passes the retention the step prunes them in
bounded batches, rows, runs, events, log and checkpoint dirs, and a pruned job answers like
one that never was (404). Active jobs and recent ones are never touched.
"""
from __future__ import annotations

import os

import pytest

from tiresias.service.executor import RunEnd
from tiresias.service.master import Master, MasterConfig, NotFound
from tiresias.service.reports import ReportFeed
from tiresias.service.retention import DAY, RetentionConfig, cutoff, expired

from test_tiresias_master import Clock, FakeExecutor


def test_policy():
    assert cutoff(100 * DAY, 0) is None
    assert cutoff(100 * DAY, 30 * DAY) == 70 * DAY
    assert expired(69 * DAY, "finished", 100 * DAY, 30 * DAY)
    assert not expired(71 * DAY, "finished", 100 * DAY, 30 * DAY)
    assert not expired(1.0, "running", 100 * DAY, 30 * DAY) and not expired(None, "failed", 100 * DAY, 30 * DAY)
    assert not expired(1.0, "cancelled", 100 * DAY, 0)
    with pytest.raises(ValueError):
        RetentionConfig(-1)


def make(tmp_path, **cfg):
    clock, ex = Clock(1_000_000.0), FakeExecutor(nodes=1, gpus=4)
    m = Master(MasterConfig(str(tmp_path / "state"), interval=1.0, **cfg), ex, reports=ReportFeed(clock=clock),
               clock=clock)
    return m, clock, ex


def run_to_end(m, ex, clock, n, code=0):
    ids = [m.submit({"gpus": 1, "command": ["true"], "name": f"j{i}", "workdir": "/"}, owner="alice")["id"]
           for i in range(n)]
    m.tick()
    for job_id in ids:
        os.makedirs(os.path.join(m.jobs_dir, str(job_id)), exist_ok=True)
        with open(m.log_path(job_id), "w") as f:
            f.write("output\n")
        ex.ended.append(RunEnd(job_id, 1, code))
    clock.t += 1
    m.tick()
    return ids


def test_prune_step_removes_old_ended_jobs_in_batches(tmp_path):
    m, clock, ex = make(tmp_path, retention_s=10 * DAY)
    m.retention = RetentionConfig(10 * DAY, batch=3)
    old = run_to_end(m, ex, clock, 4) + run_to_end(m, ex, clock, 1, code=2)      # finished, failed
    clock.t += 5 * DAY
    recent = run_to_end(m, ex, clock, 2)
    live = m.submit({"gpus": 4, "command": ["true"], "name": "live", "workdir": "/"}, owner="bob")["id"]
    m.tick()
    assert m.prune_step() == 0                                        # nothing old enough yet
    clock.t += 6 * DAY                                                # old: 11 days; recent: 6
    assert m.prune_step() == 3 and m.prune_step() == 2 and m.prune_step() == 0
    for job_id in old:
        with pytest.raises(NotFound):
            m.job(job_id)
        assert not os.path.exists(os.path.join(m.jobs_dir, str(job_id)))
        assert not os.path.exists(os.path.join(m.ckpt_root, str(job_id)))
        assert m.events(job_id=job_id) == [] and m.store.placements(job_id) == []
    assert [j["id"] for j in m.jobs()] == recent + [live]
    assert os.path.exists(m.log_path(recent[0]))
    assert m.summary()["jobs"] == {"finished": 2, "running": 1}
    clock.t += 365 * DAY                                              # the live one is never pruned
    assert m.prune_step() == 2 and [j["id"] for j in m.jobs()] == [live]
    new = m.submit({"gpus": 1, "command": ["true"], "name": "after", "workdir": "/"}, owner="alice")["id"]
    assert new > live                                                 # ids are never reused
    m.close()


def test_retention_zero_keeps_forever(tmp_path):
    m, clock, ex = make(tmp_path, retention_s=0)
    ids = run_to_end(m, ex, clock, 2)
    clock.t += 10_000 * DAY
    assert m.prune_step() == 0 and [j["id"] for j in m.jobs()] == ids
    m.close()
