"""Online profile updates from measured speeds: the pure bookkeeping, and the live master
folding two packed jobs' measured speeds into its co-location profile (fake clock)."""
import pytest

from tiresias.packing.learning import SpeedLearner, observe


def test_a_pair_is_measured_once_both_have_run_alone_and_together():
    learn = SpeedLearner(settle=10.0)
    assert learn.sample(0.0, 1, None, 10.0) is None          # too soon after its start
    assert learn.sample(20.0, 1, None, 10.0) is None         # job 1 alone: 10 steps/s
    assert learn.sample(20.0, 2, None, 4.0) is None
    assert learn.sample(30.0, 2, None, 4.0) is None          # job 2 alone: 4 steps/s
    assert learn.sample(40.0, 1, 2, 6.0) is None             # partner changed: the window restarts
    assert learn.sample(40.0, 2, 1, 3.0) is None
    assert learn.sample(55.0, 1, 2, 6.0) is None             # one side measured: 0.6
    assert learn.sample(55.0, 2, 1, 3.0) == (2, 0.75, 1, 0.6)
    assert learn.sample(60.0, 2, 1, 3.0) is None             # taken: each measurement is used once


def test_no_speed_alone_means_nothing_to_normalise_by():
    learn = SpeedLearner(settle=0.0)
    learn.sample(0.0, 1, 2, 5.0)
    learn.sample(0.0, 2, 1, 5.0)
    assert learn.sample(1.0, 1, 2, 5.0) is None and learn.sample(1.0, 2, 1, 5.0) is None
    assert learn.sample(2.0, 1, 2, None) is None and learn.sample(2.0, 1, 2, 0.0) is None
    learn.forget(1)                                          # job 2 still waits to be measured alone
    assert 1 in learn.jobs
    with pytest.raises(ValueError):
        SpeedLearner(settle=-1)


def test_a_job_that_only_ran_packed_is_measured_alone_after_its_partner_leaves():
    learn = SpeedLearner(settle=5.0)
    learn.sample(0.0, 1, None, None)
    assert learn.sample(10.0, 1, None, 10.0) is None         # job 1 alone: 10
    learn.sample(10.0, 1, 2, None)
    learn.sample(10.0, 2, 1, None)
    assert learn.sample(20.0, 1, 2, 7.0) is None             # beside each other: 7 and 4
    assert learn.sample(20.0, 2, 1, 4.0) is None             # job 2's speed alone not known yet
    learn.forget(1)                                          # job 1 ends; job 2 runs alone
    assert learn.sample(21.0, 2, None, 5.0) is None          # a new pairing: settles first
    assert learn.sample(30.0, 2, None, 5.0) == (2, 0.8, 1, 0.7)
    learn.forget(2)
    learn.forget(1)
    assert learn.jobs == {}


def test_progress_speed_since_a_time():
    from tiresias.service.jobprogress import JobProgress
    progress = JobProgress()
    progress.feed(b"".join(f"{t} {s} 1.0\n".encode() for t, s in ((0, 0), (10, 100), (20, 150), (30, 200))))
    assert progress.steps_per_s() == pytest.approx(200 / 30)
    assert progress.steps_per_s(since=10) == pytest.approx(5.0)
    assert progress.steps_per_s(since=30) is None


def test_observe_needs_both_profile_keys():
    seen = []

    class Sharing:
        def observe(self, a, b, sa, sb):
            seen.append((a, b, sa, sb))

    assert observe(Sharing(), {1: "A", 2: "B"}, (1, 0.6, 2, 0.7)) is True
    assert observe(Sharing(), {1: "A", 2: None}, (1, 0.6, 2, 0.7)) is False
    assert seen == [("A", "B", 0.6, 0.7)]


def test_the_live_master_learns_a_pair_from_reported_progress(tmp_path):
    from test_tiresias_elastic_live import report
    from test_tiresias_master import FakeExecutor, make
    from tiresias.packing.profiles import DEFAULT_COLOCATION, JobType
    if not DEFAULT_COLOCATION.exists():
        pytest.skip("no co-location table in ../shared/data")
    m, clock, ex = make(tmp_path, executor=FakeExecutor(nodes=1, gpus=2), policy="tesserae-las",
                        round_interval=1000.0)
    store = m.driver.sharing.store
    ra, vg = JobType("resnet50", "32", 1), JobType("vgg19", "32", 1)
    before = store.pair(ra, vg)
    a = m.submit(spec(1, "a", model="resnet50", batch_size="32"))["id"]
    b = m.submit(spec(1, "b", model="vgg19", batch_size="32"))["id"]
    m.tick()                                         # a and b alone, a GPU each
    t0 = clock.t
    clock.t = t0 + 1
    m.tick()
    report(m, ex, a, [(t0 + i, 10 * i, 1.0) for i in range(80)])     # 10 steps/s alone
    report(m, ex, b, [(t0 + i, 5 * i, 1.0) for i in range(80)])      # 5 steps/s alone
    clock.t = t0 + 70
    m.tick()
    d = m.submit(spec(1, "d", share=False))["id"]    # queue 1 (a and b passed 100 GPU-s): first
    clock.t = t0 + 1000
    m.tick()                                         # the round: d gets a GPU, a and b share the other
    assert m.driver.slots.partner == {a: b, b: a} and d in m.driver.slots.gpus
    moved = [j for j in (a, b) if m.job(j)["status"] == "stopping"]
    assert len(moved) == 1                           # one of them moves: a stop and a restart
    ex.end(moved[0], 1, stopped=True)
    clock.t += 1
    m.tick()
    assert m.job(a)["status"] == m.job(b)["status"] == "running"
    assert m.job(a)["placement"] == m.job(b)["placement"]
    t1 = clock.t
    clock.t += 1
    m.tick()                                         # both seen with their partner from here
    report(m, ex, a, [(t1 + i, 1000 + 6 * i, 1.0) for i in range(80)])     # 0.6 of alone
    report(m, ex, b, [(t1 + i, 1000 + 3.5 * i, 1.0) for i in range(80)])   # 0.7 of alone
    clock.t = t1 + 70
    m.tick()
    after = store.pair(ra, vg)
    assert after == pytest.approx((0.5 * before[0] + 0.5 * 0.6, 0.5 * before[1] + 0.5 * 0.7), rel=0.02)
    assert any(e["kind"] == "profile" for e in m.store.events(job_id=None))


def spec(gpus, name, **kw):
    return {"gpus": gpus, "command": ["python", "train.py"], "name": name, "workdir": "/", **kw}
