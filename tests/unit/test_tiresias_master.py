"""The live master's decisions on a fake clock with an in-memory executor.

No processes: ``FakeExecutor`` records launches and signals, and the test says when a run
ends. What is checked is the mechanism around the shared driver: the stop protocol and its
escalation, requeue of lost runs, cancel, drain, restart recovery from SQLite (no job lost,
none started twice, service kept), and the two report feeds steering placement.
"""
from __future__ import annotations

import json
import re

import pytest

from tiresias.service.executor import LaunchSpec, NodeInfo, RunEnd
from tiresias.service.master import Master, MasterConfig, Refused, autops_job_name
from tiresias.service.reports import ReportFeed
from tiresias.service.store import MIGRATIONS, SCHEMA_VERSION, StateError, Store, migrate_to


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeExecutor:
    name = "fake"

    def __init__(self, nodes: int = 2, gpus: int = 2) -> None:
        self._nodes = [NodeInfo(f"node{i}", gpus) for i in range(nodes)]
        self.launched: list[LaunchSpec] = []
        self.signals: list[tuple[int, int, bool]] = []
        self.ended: list[RunEnd] = []
        self.alive: set[tuple[int, int]] = set()

    def nodes(self):
        return list(self._nodes)

    def launch(self, spec):
        self.launched.append(spec)
        self.alive.add((spec.job_id, spec.run))
        return {"fake": [spec.job_id, spec.run]}

    def terminate(self, job_id, run, handle, force=False):
        self.signals.append((job_id, run, force))

    def end(self, job_id, run, code=0, stopped=False, lost=False):
        self.alive.discard((job_id, run))
        self.ended.append(RunEnd(job_id, run, code, stopped, lost))

    def poll(self):
        out, self.ended = self.ended, []
        return out

    def reconcile(self, runs):
        ends = [e for e in self.ended if (e.job_id, e.run) in runs]
        self.ended = [e for e in self.ended if (e.job_id, e.run) not in runs]
        return ends + [RunEnd(j, r, None, lost=True) for (j, r) in runs if (j, r) not in self.alive
                       and not any(e.job_id == j for e in ends)]

    def close(self):
        pass


def make(tmp_path, clock=None, executor=None, reports=None, resizer=None, **cfg):
    cfg.setdefault("thresholds", (100.0,))
    cfg.setdefault("stop_grace", 10.0)
    cfg.setdefault("interval", 1.0)
    clock = clock or Clock()
    executor = executor or FakeExecutor()
    m = Master(MasterConfig(str(tmp_path / "state"), **cfg), executor, reports=reports or ReportFeed(clock=clock),
               clock=clock, resizer=resizer)
    return m, clock, executor


def spec(gpus, name="j", **kw):
    return {"gpus": gpus, "command": ["python", "train.py"], "name": name, "workdir": "/", **kw}


def status(m, job_id):
    return m.job(job_id)["status"]


def test_submit_runs_and_finishes(tmp_path):
    m, clock, ex = make(tmp_path)
    j = m.submit(spec(2))["id"]
    m.tick()
    assert status(m, j) == "running" and len(ex.launched) == 1
    launch = ex.launched[0]
    assert launch.launcher == "torchrun" and launch.env["TIRESIAS_JOB_ID"] == str(j)
    assert launch.env["TIRESIAS_CHECKPOINT_DIR"].endswith(f"/{j}/checkpoint")
    clock.t += 30
    ex.end(j, 1, 0)
    m.tick()
    view = m.job(j)
    assert view["status"] == "finished" and view["jct"] == pytest.approx(30.0)
    assert view["attained_service"] == pytest.approx(60.0)
    assert m.nodes()[0]["free_gpus"] == 2


def test_preemption_asks_then_sigterm_then_sigkill_and_resumes(tmp_path):
    m, clock, ex = make(tmp_path, executor=FakeExecutor(1, 2))
    a = m.submit(spec(2, "a"))["id"]
    m.tick()
    clock.t += 60                                   # 120 GPU-s: a is in Q2
    b = m.submit(spec(2, "b"))["id"]
    m.tick()
    assert status(m, a) == "stopping" and status(m, b) == "waiting"
    assert "released" in m.job(b)["reason"]
    stop_file = ex.launched[0].env["TIRESIAS_STOP_FILE"]
    import os
    assert os.path.exists(stop_file)
    clock.t += 9.9
    m.tick()
    assert ex.signals == []                          # inside the grace period
    clock.t += 0.2
    m.tick()
    assert ex.signals == [(a, 1, False)]             # SIGTERM
    clock.t += 5.0
    m.tick()
    assert ex.signals[-1] == (a, 1, True)            # SIGKILL
    ex.end(a, 1, -9)
    m.tick()
    assert status(m, a) == "preempted" and status(m, b) == "running"
    assert m.job(a)["preemptions"] == 1
    clock.t += 10
    ex.end(b, 1, 0)
    m.tick()
    assert status(m, a) == "running" and ex.launched[-1].run == 2
    assert not os.path.exists(stop_file)             # a fresh run starts without the old request
    kinds = [e["kind"] for e in m.events(job_id=a)]
    assert kinds == ["submitted", "started", "stopping", "sigterm", "sigkill", "preempted", "resumed"]


def test_job_that_finishes_while_asked_to_stop_is_finished(tmp_path):
    m, clock, ex = make(tmp_path, executor=FakeExecutor(1, 2))
    a = m.submit(spec(2, "a"))["id"]
    m.tick()
    clock.t += 60
    m.submit(spec(2, "b"))
    m.tick()
    ex.end(a, 1, 0, stopped=False)
    m.tick()
    assert status(m, a) == "finished"


def test_failed_job_keeps_its_code_and_others_run_on(tmp_path):
    m, clock, ex = make(tmp_path)
    a = m.submit(spec(1, "a"))["id"]
    b = m.submit(spec(1, "b"))["id"]
    m.tick()
    ex.end(a, 1, 3)
    m.tick()
    view = m.job(a)
    assert view["status"] == "failed" and view["exit_code"] == 3 and "exit code 3" in view["detail"]
    assert status(m, b) == "running"


def test_lost_run_requeues_and_resumes(tmp_path):
    m, clock, ex = make(tmp_path)
    a = m.submit(spec(2))["id"]
    m.tick()
    ex.end(a, 1, None, lost=True)
    m.tick()
    assert status(m, a) == "running" and ex.launched[-1].run == 2
    assert [e["kind"] for e in m.events(job_id=a)][-2:] == ["lost", "resumed"]


def test_a_job_whose_runs_are_lost_every_time_fails_after_max_lost_runs(tmp_path):
    """Lost runs are retried from the checkpoint, but not without limit: after --max-lost-runs
    in a row the job fails with the reason; a run that ends normally in between resets the count."""
    m, clock, ex = make(tmp_path, max_lost_runs=3)
    a = m.submit(spec(1))["id"]
    m.tick()
    for run in (1, 2):
        ex.end(a, run, None, lost=True)
        m.tick()
        assert status(m, a) == "running" and ex.launched[-1].run == run + 1
    ex.end(a, 3, None, lost=True)
    m.tick()
    view = m.job(a)
    assert view["status"] == "failed" and "3 runs in a row were lost" in view["detail"]
    assert len([r for r in ex.launched if r.job_id == a]) == 3


def test_cancel_waiting_and_running(tmp_path):
    m, clock, ex = make(tmp_path, executor=FakeExecutor(1, 2))
    a = m.submit(spec(2, "a"))["id"]
    b = m.submit(spec(2, "b"))["id"]
    m.tick()
    assert m.cancel(b)["status"] == "cancelled"
    assert m.cancel(a)["status"] == "stopping"
    ex.end(a, 1, 0, stopped=True)
    m.tick()
    assert status(m, a) == "cancelled" and m.nodes()[0]["free_gpus"] == 2
    with pytest.raises(Refused, match="already cancelled"):
        m.cancel(a)


def test_drained_node_requeues_its_jobs_elsewhere(tmp_path):
    m, clock, ex = make(tmp_path)
    a = m.submit(spec(2))["id"]
    m.tick()
    node = ex.launched[0].placement[0][0]
    out = m.drain(node)
    assert out["preempted"] == [a] and status(m, a) == "stopping"
    ex.end(a, 1, 0, stopped=True)
    m.tick()
    assert status(m, a) == "running" and ex.launched[-1].placement[0][0] != node


def test_validation_refuses_and_stores_nothing(tmp_path):
    m, clock, ex = make(tmp_path, policy="srtf")
    bad = [spec(5), spec(0), {"gpus": 1, "command": []}, spec(1, name="bad name"), spec(1, colour="red"),
           spec(1, duration=-1), spec(1), spec(1, duration=10, autops_aggregators=2), "not a dict"]
    for s in bad:
        with pytest.raises(Refused):
            m._validate(s) if not isinstance(s, dict) else m.submit(s)
    assert m.jobs() == []
    assert m.submit(spec(1, duration=10))["duration"] == 10.0


def test_restart_loses_nothing_runs_nothing_twice_and_keeps_service(tmp_path):
    clock = Clock()
    ex = FakeExecutor()
    m, _, _ = make(tmp_path, clock=clock, executor=ex)
    a = m.submit(spec(2, "a"))["id"]
    b = m.submit(spec(2, "b"))["id"]
    c = m.submit(spec(2, "c"))["id"]
    m.tick()
    clock.t += 10.0
    m.tick()
    assert {status(m, a), status(m, b), status(m, c)} == {"running", "waiting"}
    running = [j for j in (a, b, c) if status(m, j) == "running"]
    # the master dies (no close); while down, one run ends and one keeps running
    clock.t += 20.0
    ex.end(running[0], 1, 0)
    launched = len(ex.launched)
    m2, _, _ = make(tmp_path, clock=clock, executor=ex)
    assert status(m2, running[0]) == "finished"
    assert status(m2, running[1]) == "running" and len(ex.launched) == launched
    assert m2.job(running[1])["attained_service"] == pytest.approx(2 * 30.0, abs=2 * 1.0)
    m2.tick()                                        # the waiting job starts on the freed GPUs
    waiting = ({a, b, c} - set(running)).pop()
    assert status(m2, waiting) == "running" and len(ex.launched) == launched + 1


def test_restart_relaunches_a_run_the_executor_lost(tmp_path):
    clock, ex = Clock(), FakeExecutor()
    m, _, _ = make(tmp_path, clock=clock, executor=ex)
    a = m.submit(spec(2))["id"]
    m.tick()
    ex.alive.clear()                                 # the run vanished with the master
    m2, _, _ = make(tmp_path, clock=clock, executor=ex)
    m2.tick()
    assert status(m2, a) == "running" and ex.launched[-1].run == 2


def test_state_schema_upgrades_in_place(tmp_path):
    import sqlite3
    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path, isolation_level=None)
    migrate_to(db, 1)
    db.execute("INSERT INTO jobs(name, spec, gpus, status, submitted) VALUES ('old', ?, 1, 'waiting', 5.0)",
               (json.dumps(spec(1, "old")),))
    db.close()
    store = Store(path)
    assert store.upgraded_from == 1 and store.version() == SCHEMA_VERSION == len(MIGRATIONS)
    [row] = store.jobs()
    assert row["name"] == "old" and row["queue"] == 0 and row["skew"] is None
    store.set_meta("schema_version", str(SCHEMA_VERSION + 1))
    store.close()
    with pytest.raises(StateError, match="schema version"):
        Store(path)


def test_measured_skew_consolidates_from_the_next_start(tmp_path):
    clock = Clock()
    feed = ReportFeed(autops=["tcp://127.0.0.1:1"], clock=clock)
    m, _, ex = make(tmp_path, clock=clock, executor=FakeExecutor(2, 4), reports=feed,
                    autops_master="tcp://127.0.0.1:5555")
    for name in ("x", "y"):
        m.submit(spec(3, name))
    m.tick()                                          # 1 GPU left on each node
    j = m.submit(spec(2, "vgg", autops_aggregators=1))["id"]
    m.tick()
    assert status(m, j) == "running" and len(ex.launched[-1].placement) == 2   # spread: skew unknown
    report = {"type": "autops.utilization", "version": 1, "master": "tcp://127.0.0.1:5555",
              "jobs": [{"job": ex.launched[-1].env["AUTOPS_JOB"], "skew": 0.71, "tensors": 38}]}
    assert feed.ingest(b"autops.utilization " + json.dumps(report).encode())
    m.tick()
    assert m.job(j)["skew"] == pytest.approx(0.71) and m.job(j)["skew_measured"]
    ex.end(j, 1, None, lost=True)                     # it must start again: consolidated now
    m.tick()
    assert status(m, j) == "preempted" and "PACKLIMIT" in m.job(j)["reason"]


def test_autops_job_names_are_unguessable_per_run_and_survive_a_restart(tmp_path):
    """Whoever registers an AutoPS job id first owns it: a run's AUTOPS_JOB carries a tag derived
    from the job's secret, so nobody can name it from the job id and run number."""
    names = {}
    for state in ("a", "b"):                           # two masters: the same job ids and run numbers
        m, clock, ex = make(tmp_path / state, autops_master="tcp://127.0.0.1:5555")
        j = m.submit(spec(1, "ps", autops_aggregators=1))["id"]
        m.tick()
        first = ex.launched[-1].env["AUTOPS_JOB"]
        ex.end(j, 1, None, lost=True)
        m.tick()
        m.tick()
        second = ex.launched[-1].env["AUTOPS_JOB"]
        assert ex.launched[-1].run == 2
        for run, name in ((1, first), (2, second)):
            assert re.fullmatch(rf"tiresias-{j}-r{run}-[0-9a-f]{{16}}", name), name
            assert name == autops_job_name(j, run, m.runs[j].secret)
        names[state] = (first, second)
        m.close()
    assert names["a"][0] != names["a"][1]              # each run registers a new job
    assert names["a"][0] != names["b"][0] and names["a"][1] != names["b"][1]   # not from id and run alone
    m2 = Master(MasterConfig(str(tmp_path / "a" / "state"), thresholds=(100.0,), stop_grace=10.0, interval=1.0),
                FakeExecutor(), reports=ReportFeed(clock=Clock()), clock=Clock())
    assert autops_job_name(j, 2, m2.runs[j].secret) == names["a"][1]     # the same after a restart
    m2.close()


def test_declared_memory_places_where_reports_say_it_fits(tmp_path, monkeypatch):
    import tiresias.service.cgroup as cg
    monkeypatch.setattr(cg, "unavailable", lambda: None)
    clock = Clock()
    feed = ReportFeed(infiniswap=["tcp://127.0.0.1:1"], clock=clock, max_age=5.0)
    m, _, ex = make(tmp_path, clock=clock, executor=FakeExecutor(2, 2), reports=feed)
    ex.name = "local"
    GiB = 1 << 30

    def report(host, free, lendable):
        r = {"type": "infiniswap.utilization", "version": 1, "daemon": f"d-{host}", "host": host,
             "memory_total_bytes": 16 * GiB, "memory_free_bytes": free, "lendable_bytes": lendable,
             "slabs_lent": 0, "slab_bytes": GiB}
        feed.ingest(b"infiniswap.utilization " + json.dumps(r).encode())

    report("node0", 1 * GiB, 0)
    report("node1", 6 * GiB, 0)
    j = m.submit(spec(1, memory=4 * GiB))["id"]
    m.tick()
    assert ex.launched[-1].placement[0][0] == "node1" and ex.launched[-1].memory_bytes == 4 * GiB
    k = m.submit(spec(1, memory=12 * GiB))["id"]
    m.tick()
    assert status(m, k) == "waiting" and "memory" in m.job(k)["reason"]
    report("node0", 1 * GiB, 8 * GiB)                  # node0's daemon can lend 8 GiB to node1
    m.tick()
    assert status(m, k) == "running" and ex.launched[-1].placement[0][0] == "node1"
    clock.t += 6.0                                     # reports go stale: ignored and flagged
    assert all(s["stale"] for s in feed.sources())
    assert m.nodes()[0]["memory_free_bytes"] is None
    assert status(m, j) == "running"


def test_a_failed_launch_requeues_and_the_third_in_a_row_fails_the_job(tmp_path):
    m, clock, ex = make(tmp_path)
    real_launch, failures = ex.launch, []

    def flaky(spec):
        if len(failures) < 1:
            failures.append(spec.run)
            raise RuntimeError("placement group not ready")
        return real_launch(spec)
    ex.launch = flaky
    a = m.submit(spec(2, "a"))["id"]
    m.tick()
    assert status(m, a) == "waiting" and m.job(a)["preemptions"] == 0
    assert m.nodes()[0]["free_gpus"] + m.nodes()[1]["free_gpus"] == 4
    m.tick()
    assert status(m, a) == "running"

    def broken(spec):
        raise RuntimeError("no such command")
    ex.launch = broken
    b = m.submit(spec(1, "b"))["id"]
    for _ in range(3):
        m.tick()
    view = m.job(b)
    assert view["status"] == "failed" and "launch failed 3 times" in view["detail"]
    assert [e["kind"] for e in m.events(job_id=b)].count("launch-failed") == 2


def test_master_upgrades_an_older_state_dir_in_place_and_runs_its_jobs(tmp_path):
    import sqlite3
    state = tmp_path / "state"
    state.mkdir()
    db = sqlite3.connect(str(state / "state.db"), isolation_level=None)
    migrate_to(db, 1)                                 # a state dir written by the first schema
    db.execute("INSERT INTO jobs(name, spec, gpus, status, submitted, wait_since) VALUES "
               "('old', ?, 2, 'waiting', 900.0, 900.0)", (json.dumps(spec(2, "old")),))
    db.close()
    m, clock, ex = make(tmp_path)
    assert m.store.upgraded_from == 1 and m.store.version() == SCHEMA_VERSION
    m.tick()
    view = m.job(1)
    assert view["status"] == "running" and view["name"] == "old" and ex.launched[0].job_id == 1


# --- GPU sharing (tesserae-*): two jobs on one GPU, a stop drains before the GPU is reused -----

def test_sharing_policy_packs_two_jobs_on_one_gpu(tmp_path):
    m, clock, ex = make(tmp_path, executor=FakeExecutor(nodes=1, gpus=1), policy="tesserae-las",
                        round_interval=60.0)
    a = m.submit(spec(1, "a", model="resnet50", batch_size="32"))
    b = m.submit(spec(1, "b", model="vgg19", batch_size="32"))
    c = m.submit(spec(1, "c", model="vgg19", batch_size="32", share=False))
    m.tick()
    assert sorted(s.job_id for s in ex.launched) == [a["id"], b["id"]]     # c may not share: it waits
    assert {s.job_id: s.placement for s in ex.launched}[a["id"]] == {s.job_id: s.placement for s in ex.launched}[b["id"]]
    ja, jc = m.job(a["id"]), m.job(c["id"])
    assert ja["shares_with"] == b["id"] and ja["placement"] == {"node0": [0]}
    assert m.nodes()[0]["shared_gpus"] == {"0": sorted([a["id"], b["id"]])}
    assert jc["status"] == "waiting" and jc["may_share"] is False
    # a ends: the GPU stays busy for b; c is only planned at the next round
    ex.end(a["id"], 1)
    clock.t += 1
    m.tick()
    assert m.nodes()[0]["free_gpus"] == 0 and len(ex.launched) == 2
    clock.t += 60
    m.tick()
    assert len(ex.launched) == 2 and ex.signals == []     # b (LAS: started first) keeps it, c waits
    assert m.job(c["id"])["status"] == "waiting"
    ex.end(b["id"], 1)                               # b ends: the next round plans c on the GPU
    clock.t += 60
    m.tick()
    assert [s.job_id for s in ex.launched][-1] == c["id"] and m.job(c["id"])["placement"] == {"node0": [0]}
    with pytest.raises(Refused, match="batch_size"):
        m.submit(spec(1, "d", batch_size=64))
    with pytest.raises(Refused, match="share"):
        m.submit(spec(1, "d", share="no"))


def test_sharing_round_preempts_and_starts_on_the_gpu_once_the_run_has_exited(tmp_path):
    m, clock, ex = make(tmp_path, executor=FakeExecutor(nodes=1, gpus=1), policy="tesserae-las",
                        round_interval=60.0)
    a = m.submit(spec(1, "a", share=False))
    m.tick()
    clock.t += 200                                   # a passes the 100 GPU-s threshold: queue 2
    b = m.submit(spec(1, "b", share=False))
    m.tick()                                         # a round is due: b first, a stops
    assert ex.signals == [] and m.job(a["id"])["status"] == "stopping"
    assert [s.job_id for s in ex.launched] == [a["id"]]
    assert "released" in m.job(b["id"])["reason"]
    clock.t += 1
    m.tick()
    assert [s.job_id for s in ex.launched] == [a["id"]]      # the GPU still drains
    ex.end(a["id"], 1, stopped=True)
    clock.t += 1
    m.tick()
    assert [s.job_id for s in ex.launched] == [a["id"], b["id"]]
    assert m.job(b["id"])["placement"] == {"node0": [0]} and m.job(a["id"])["status"] == "preempted"


def test_sharing_restart_reattaches_both_jobs_of_a_shared_gpu(tmp_path):
    clock, ex = Clock(), FakeExecutor(nodes=1, gpus=1)
    m, _, _ = make(tmp_path, clock=clock, executor=ex, policy="tesserae-las", round_interval=60.0)
    a = m.submit(spec(1, "a", model="resnet50", batch_size="32"))["id"]
    b = m.submit(spec(1, "b", model="vgg19", batch_size="32"))["id"]
    m.tick()
    assert len(ex.launched) == 2
    clock.t += 5
    m2, _, _ = make(tmp_path, clock=clock, executor=ex, policy="tesserae-las", round_interval=60.0)
    assert m2.driver.gpu_ids(a) == m2.driver.gpu_ids(b) == [(0, [0])]
    assert m2.driver.slots.partner == {a: b, b: a} and m2.driver.used == 1
    c = m2.submit(spec(1, "c", model="vgg19", batch_size="32"))["id"]
    clock.t += 60
    m2.tick()                                       # a round: a and b stay where they are, c waits
    assert len(ex.launched) == 2 and ex.signals == [] and status(m2, c) == "waiting"
    assert m2.driver.nodes.migrations == 0
