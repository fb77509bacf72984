"""Elastic jobs in the live master, on a fake clock with an in-memory executor: an allocation
policy's rounds resize jobs by stop-and-restart at another GPU count, change a running job's
aggregator count through pMaster (no restart), learn from the jobs' progress reports and
AutoPS's iteration times, and each run records its GPU and aggregator counts."""
from __future__ import annotations

import json
import sys
import time

import pytest

from tiresias.service import master as master_mod
from tiresias.service.aggregators import AggregatorResizer, Resized
from tiresias.service.master import autops_job_name

from test_tiresias_master import FakeExecutor, make, spec

ROUND = 10.0


def elastic(tmp_path, policy="optimus", nodes=1, gpus=4, **cfg):
    return make(tmp_path, executor=FakeExecutor(nodes, gpus), policy=policy, round_interval=ROUND, **cfg)


def report(m, ex, job_id, lines):
    """The job's rank 0 appends progress lines (``time step loss``), as ``tiresias.job.report``."""
    path = next(s for s in reversed(ex.launched) if s.job_id == job_id).env["TIRESIAS_PROGRESS_FILE"]
    with open(path, "a") as f:
        f.writelines(f"{t} {step} {loss}\n" for t, step, loss in lines)


def run_gpus(ex, job_id):
    return [sum(len(g) for _, g in s.placement) for s in ex.launched if s.job_id == job_id]


def stop_requested(m, job_id):
    return m.runs[job_id].status == "stopping"


def converge_lines(t0, steps, per_s=10.0):
    """A loss falling like 1/k, one line a second at ``per_s`` steps a second."""
    return [(t0 + i, s, 1.0 / (1 + 0.01 * s)) for i, s in enumerate(range(0, steps, int(per_s)))]


def test_optimus_starts_an_elastic_job_small_then_grows_it_by_a_restart(tmp_path):
    m, clock, ex = elastic(tmp_path)
    j = m.submit(spec(4, min_gpus=1, converge=0.1))["id"]
    m.tick()
    assert run_gpus(ex, j) == [1]                    # nothing measured: its minimum
    view = m.job(j)
    assert view["allocation"] == {"gpus": 1, "aggregators": None} and view["converge"] == 0.1
    assert view["model"]["speed_samples"] == 0 and view["model"]["delta"] == 0.1
    report(m, ex, j, converge_lines(clock.t, 60))
    clock.t += 1
    m.tick()                                         # measured at 1 GPU; between rounds: no change
    assert not stop_requested(m, j)
    assert m.job(j)["model"]["speed_samples"] == 1 and m.job(j)["model"]["predicted_remaining_s"] > 0
    clock.t += ROUND
    m.tick()                                         # the round: linear from 1 GPU, so more helps
    assert stop_requested(m, j)
    ex.end(j, 1, 0, stopped=True)
    clock.t += 1
    m.tick()
    assert run_gpus(ex, j) == [1, 4]
    assert [(r["gpus"], r["outcome"] is not None) for r in m.job(j)["runs"]] == [(1, True), (4, False)]
    assert m.job(j)["allocation"]["gpus"] == 4


def test_a_second_job_takes_gpus_from_the_first_at_the_next_round(tmp_path):
    m, clock, ex = elastic(tmp_path, policy="drf")
    a = m.submit(spec(4, min_gpus=1, name="a"))["id"]
    m.tick()
    assert run_gpus(ex, a) == [4]                    # DRF: alone, as many as it may use
    clock.t += 1
    b = m.submit(spec(4, min_gpus=1, name="b"))["id"]
    m.tick()
    assert run_gpus(ex, b) == [] and not stop_requested(m, a)    # waits for the round
    clock.t += ROUND
    m.tick()
    assert stop_requested(m, a)
    ex.end(a, 1, 0, stopped=True)
    clock.t += 1
    m.tick()
    assert run_gpus(ex, a) == [4, 2] and run_gpus(ex, b) == [2]
    assert m.job(a)["preemptions"] == 1


def test_fixed_jobs_keep_their_count_under_an_allocation_policy(tmp_path):
    m, clock, ex = elastic(tmp_path, policy="drf")
    j = m.submit(spec(2))["id"]
    m.tick()
    clock.t += ROUND
    m.tick()
    assert run_gpus(ex, j) == [2] and not stop_requested(m, j)


class FakeResizer:
    """``AggregatorResizer`` without processes: records asks, answers as the test says."""

    def __init__(self) -> None:
        self.asks: list[tuple] = []
        self.answers: list[Resized] = []

    def ask(self, key, job, count):
        self.asks.append((key, job, count))

    def poll(self):
        out, self.answers = self.answers, []
        return out

    def close(self):
        pass


def grow_aggregators(m, clock, j):
    """Measured: a second aggregator doubles the speed at 2 workers; the round gives it one."""
    for p, w, f in ((1, 1, 4.0), (1, 2, 5.0), (2, 2, 10.0), (2, 1, 5.0)):
        m.driver.policy.observe_speed(j, p, w, f)
    clock.t += ROUND
    m.tick()


def test_an_aggregator_change_alone_asks_pmaster_and_does_not_restart(tmp_path):
    resizer = FakeResizer()
    m, clock, ex = make(tmp_path, executor=FakeExecutor(1, 2), policy="optimus", round_interval=ROUND,
                        autops_master="tcp://127.0.0.1:1", resizer=resizer)
    j = m.submit(spec(2, min_gpus=2, autops_aggregators=1))["id"]
    m.tick()
    assert ex.launched[0].env["AUTOPS_AGGREGATORS"] == "1"
    grow_aggregators(m, clock, j)
    run = m.runs[j]
    assert not stop_requested(m, j) and len(ex.launched) == 1
    assert resizer.asks == [((j, 1, 1), autops_job_name(j, 1, run.secret), 2)]
    assert m.job(j)["allocation"]["aggregators"] == 2
    resizer.answers.append(Resized((j, 1, 1), "x", 2, 2))
    clock.t += 1
    m.tick()
    assert m.job(j)["runs"][0]["aggregators"] == 2
    assert any(e["kind"] == "aggregators" for e in m.events(job_id=j))


def test_a_failed_resize_is_an_event_not_a_crash(tmp_path):
    resizer = FakeResizer()
    m, clock, ex = make(tmp_path, executor=FakeExecutor(1, 2), policy="optimus", round_interval=ROUND,
                        autops_master="tcp://127.0.0.1:1", resizer=resizer)
    j = m.submit(spec(2, min_gpus=2, autops_aggregators=1))["id"]
    m.tick()
    grow_aggregators(m, clock, j)
    assert m.states[j].aggregators == 2
    resizer.answers.append(Resized((j, 1, 1), "x", 2, None, "pMaster did not answer"))
    clock.t += 1
    m.tick()
    assert m.runs[j].status == "running" and m.job(j)["runs"][0]["aggregators"] == 1
    assert m.states[j].aggregators == 1              # what it really runs with
    failed = [e for e in m.events(job_id=j) if e["kind"] == "aggregators-failed"]
    assert failed and "did not answer" in failed[0]["detail"]


def test_the_resizer_runs_autops_migrate_count_and_reads_its_answer(tmp_path):
    """The real ``AggregatorResizer`` against a stand-in ``autops`` command (no pMaster)."""
    fake = tmp_path / "fake_autops.py"
    fake.write_text("import json, sys\n"
                    "a = sys.argv[1:]\n"
                    "job, count = a[a.index('--job') + 1], int(a[a.index('--count') + 1])\n"
                    "if job == 'bad':\n"
                    "    sys.exit('autops migrate: job not registered')\n"
                    "print(json.dumps({'keys': 3, 'batches': 1, 'aggregators': min(count, 2)}))\n")
    resizer = AggregatorResizer("tcp://127.0.0.1:1", timeout=30, command=[sys.executable, str(fake)])
    try:
        resizer.ask("a", "good", 3)
        resizer.ask("b", "bad", 1)
        done = {}
        deadline = time.monotonic() + 30
        while len(done) < 2 and time.monotonic() < deadline:
            done.update({r.key: r for r in resizer.poll()})
            time.sleep(0.02)
        assert done["a"].got == 2 and done["a"].asked == 3
        assert done["b"].got is None and "not registered" in done["b"].error
        slow = AggregatorResizer("x", timeout=0.0, command=[sys.executable, "-c", "import time; time.sleep(30)"])
        slow.ask("c", "j", 1)
        (late,) = slow.poll()
        assert late.got is None and "no answer" in late.error and slow.pending() == 0
    finally:
        resizer.close()


def test_a_job_measured_at_one_aggregator_count_is_given_one_more_live(tmp_path):
    resizer = FakeResizer()
    m, clock, ex = make(tmp_path, executor=FakeExecutor(1, 2), policy="optimus", round_interval=ROUND,
                        autops_master="tcp://127.0.0.1:1", resizer=resizer)
    j = m.submit(spec(2, min_gpus=2, autops_aggregators=1))["id"]
    m.tick()
    clock.t += ROUND
    m.tick()
    assert resizer.asks == []                        # not measured where it runs yet
    m.driver.policy.observe_speed(j, 1, 2, 5.0)
    clock.t += ROUND
    m.tick()
    assert [a[2] for a in resizer.asks] == [2] and not stop_requested(m, j)
    m.driver.policy.observe_speed(j, 2, 2, 5.5)      # measured at two counts: the fit decides from now on
    resizer.answers.append(Resized((j, 1, 1), "x", 2, 2))
    clock.t += ROUND
    m.tick()
    assert len(resizer.asks) in (1, 2) and m.states[j].aggregators in (1, 2)


def test_autops_iteration_times_are_the_speed_samples(tmp_path):
    m, clock, ex = elastic(tmp_path, gpus=2, autops_master="tcp://127.0.0.1:1")
    j = m.submit(spec(2, min_gpus=1, autops_aggregators=1))["id"]
    m.tick()
    run = m.runs[j]
    frame = json.dumps({"jobs": [{"job": autops_job_name(j, run.run, run.secret), "iteration_time_s": 0.25,
                                  "tensors": 2}]}).encode()
    assert m.reports.ingest(b"autops.utilization " + frame)
    report(m, ex, j, [(clock.t, 1, 1.0), (clock.t + 1, 2, 0.9)])     # the file's 1 step/s loses to AutoPS
    clock.t += 1
    m.tick()
    assert m.driver.policy.models[j].speeds == {(1, 1): pytest.approx(4.0)}


def test_a_new_run_measures_its_own_speed(tmp_path):
    m, clock, ex = elastic(tmp_path, policy="drf")
    j = m.submit(spec(2, min_gpus=1))["id"]
    m.tick()
    report(m, ex, j, [(clock.t, 0, 1.0), (clock.t + 10, 100, 0.5)])
    clock.t += 1
    m.tick()
    assert m.job(j)["progress"]["steps_per_s"] == pytest.approx(10.0)
    m.cancel(j)


def test_converge_is_validated(tmp_path):
    m, clock, ex = elastic(tmp_path)
    for bad in (0, 1, -0.1, "0.1", True):
        with pytest.raises(Exception, match="converge"):
            m.submit(spec(2, min_gpus=1, converge=bad))


def test_allocation_policies_are_live_except_those_reading_the_truth():
    assert {"optimus", "drf", "tetris", "elastic-srpt"} <= set(master_mod.LIVE_POLICIES)
    assert not {"optimus-oracle", "optimus-noisy", "optimus-drf-alloc"} & set(master_mod.LIVE_POLICIES)
    with pytest.raises(ValueError, match="round-interval"):
        master_mod.MasterConfig("/tmp/x", "optimus", round_interval=0)


def test_the_dashboard_carries_an_elastic_jobs_allocation_and_model(tmp_path):
    import pathlib
    m, clock, ex = elastic(tmp_path)
    j = m.submit(spec(4, min_gpus=1))["id"]
    m.tick()
    report(m, ex, j, converge_lines(clock.t, 60))
    clock.t += 1
    m.tick()
    (job,) = [x for x in m.dashboard()["jobs"] if x["id"] == j]
    assert job["allocation"]["gpus"] == 1 and job["model"]["predicted_remaining_s"] > 0
    page = (pathlib.Path(master_mod.__file__).parent / "static" / "dashboard.html").read_text()
    for field in ("allocation", "predicted_remaining_s", "min_gpus", "remaining_steps"):
        assert field in page                        # the page reads what the view gives


def test_a_run_the_pool_refused_asks_for_fewer_aggregators_next_time(tmp_path):
    from dlrt import requeue
    m, clock, ex = make(tmp_path, executor=FakeExecutor(1, 4), policy="drf", round_interval=ROUND,
                        autops_master="tcp://127.0.0.1:1", resizer=FakeResizer())
    j = m.submit(spec(4, min_gpus=1, autops_aggregators=1))["id"]
    m.tick()
    assert ex.launched[-1].env["AUTOPS_AGGREGATORS"] == "4"          # DRF: one aggregator per worker
    with open(ex.launched[-1].env[requeue.ENV], "w") as f:
        f.write("AutoPS pool refused the job for now: the pool can give 3 now\n")
    ex.end(j, 1, 1)
    m.tick()
    assert m.job(j)["status"] == "waiting"
    clock.t += ROUND
    m.tick()
    assert ex.launched[-1].env["AUTOPS_AGGREGATORS"] == "3" and len(ex.launched) == 2
