"""The driver shared by the simulator and the live master.

The simulator's figures are pinned: they were measured before the driver was extracted from
``simulate()`` and must not move by a second (subsets of philly.csv and the 60-job trace, so
that the test runs fast; the whole-trace figures are in the README). The live mode (GPUs of
preempted jobs drain before reuse, nodes go offline, jobs confined to eligible nodes) is
tested on hand-built cases.
"""
from __future__ import annotations

import dataclasses
import pathlib

import pytest
from hypothesis import given, settings, strategies as st

from tiresias.cli import CYCLE_MODELS
from tiresias.cluster import ClusterSpec, parse_cluster
from tiresias.driver import Driver, DriverConfig
from tiresias.metrics import summarize
from tiresias.policies import make_policy
from tiresias.policies.base import JobState
from tiresias.policies.las import DiscretizedLAS
from tiresias.sim import SimConfig, simulate
from tiresias.trace import load_trace

DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data"
PHILLY = DATA / "traces" / "philly.csv"
JOB60 = DATA / "tiresias" / "60_job.csv"

ORIGINAL = SimConfig("count", overheads=False, slowdown=False)
# the pins predate the progress guarantee (tiresias.progress): with overheads charged they
# hold with the guarantee off (min_run_factor 0); without overheads it changes nothing
MODELLED = SimConfig("tiresias", overheads=True, slowdown=True, migrate=True, min_run_factor=0.0)
K3 = (3200.0, 25600.0)

# name: (trace, cluster, first N jobs, policy, config, policy options,
#        (avg JCT, median JCT, preemptions) measured before the driver existed)
CASES = {
    "philly1500/fifo": (PHILLY, "48x8", 1500, "fifo", ORIGINAL, {}, (443161.55666666664, 385737.5, 0)),
    "philly1500/best-effort": (PHILLY, "48x8", 1500, "best-effort", ORIGINAL, {},
                               (426303.05333333334, 383834.0, 0)),
    "philly1500/srtf": (PHILLY, "48x8", 1500, "srtf", ORIGINAL, {}, (81202.59133333333, 212.0, 2352)),
    "philly1500/gandiva-rr": (PHILLY, "48x8", 1500, "gandiva-rr", ORIGINAL, {}, (78907.21733333333, 445.5, 5033)),
    "philly1500/las": (PHILLY, "48x8", 1500, "las", ORIGINAL, {}, (92434.98466666667, 212.0, 2146)),
    # K=3: re-pinned when a demotion stopped jumping a queue (it set the service to the next
    # threshold, not the one crossed: 91459.32533333333, 212.0, 3081 before)
    "philly1500/gittins-k3": (PHILLY, "48x8", 1500, "gittins", ORIGINAL, {"thresholds": K3, "promote_knob": 8.0},
                              (81540.81866666667, 212.0, 1950)),
    "philly1500/las-k3": (PHILLY, "48x8", 1500, "las", ORIGINAL, {"thresholds": K3, "promote_knob": 8.0},
                          (81540.81866666667, 212.0, 1950)),
    "job60-2x4/las": (JOB60, "2x4", None, "las", MODELLED, {"promote_knob": 2.0}, (715.977157899617, 150.5, 0)),
    "job60-2x4/gittins": (JOB60, "2x4", None, "gittins", MODELLED, {"promote_knob": 2.0},
                          (880.2889631405557, 372.0, 58)),
    "job60-2x4/srsf": (JOB60, "2x4", None, "srsf", MODELLED, {"promote_knob": 2.0},
                       (581.3048896941638, 147.02080147596337, 13)),
    "job60-2x4/gandiva-rr": (JOB60, "2x4", None, "gandiva-rr", MODELLED, {"promote_knob": 2.0},
                          (626.9893495662836, 156.5, 4)),
    "philly800-16x8-cycle/las": (PHILLY, "16x8", 800, "las", MODELLED, {"cycle": True},
                                 (195124.4636933974, 224.30333333322778, 1165)),
    "philly800-16x8-cycle-consolidate/srtf": (PHILLY, "16x8", 800, "srtf",
                                              SimConfig("consolidate", overheads=True, slowdown=True,
                                                        min_run_factor=0.0),
                                              {"cycle": True}, (199413.89444895834, 215.0, 467)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulator_figures_unchanged_by_the_driver(case):
    trace, shape, limit, name, config, opts, pinned = CASES[case]
    opts = dict(opts)
    cycle = opts.pop("cycle", False)
    cluster = parse_cluster(shape)
    jobs = load_trace(trace, None, max_gpus=cluster.total_gpus, limit=limit).jobs
    if cycle:
        jobs = [j if j.model else dataclasses.replace(j, model=CYCLE_MODELS[j.job_id % len(CYCLE_MODELS)])
                for j in jobs]
    policy = make_policy(name, history=[j.num_gpus * j.duration for j in jobs], **opts)
    target = cluster if config.placement != "count" else cluster.total_gpus
    summary = summarize(simulate(jobs, target, policy, config=config))
    assert (summary["avg_jct"], summary["median_jct"], summary["preemptions"]) == pinned


# --- live mode -------------------------------------------------------------------------------
LIVE = DriverConfig("tiresias", defer_release=True)


def _job(jid, gpus, t=0.0, skew=0.0):
    return JobState(jid, gpus, t, wait_since=t, skew=skew)


@pytest.mark.parametrize("lazy", [True, False])
def test_a_demotion_moves_a_job_one_queue_to_the_threshold_it_crossed(lazy):
    """K=3 (thresholds 10 and 100 GPU-s): a 1-GPU job crosses 10 at t=10 and lands in Q2 with
    10 GPU-s (not 100, the next threshold); it reaches Q3 at t=100, whether its service was
    accounted at every step (the live master) or only when it changed (the simulator)."""
    config = LIVE if not lazy else DriverConfig("tiresias")
    drv = Driver(DiscretizedLAS(thresholds=[10.0, 100.0]), ClusterSpec(1, 1), config)
    a = _job(1, 1)
    drv.submit(a)
    drv.schedule()
    seen = []
    for t in (5.0, 10.0, 50.0, 100.0):
        drv.advance(t)
        drv.schedule()
        drv.settle_all()
        seen.append((drv.policy.queue_of(a), a.service))
    assert [q for q, _ in seen] == [0, 1, 1, 2]
    assert seen[1][1] == pytest.approx(10.0) and seen[3][1] == pytest.approx(100.0)


def test_policy_changes_are_applied_by_the_driver_not_the_policy():
    drv = Driver(DiscretizedLAS(thresholds=[10.0]), ClusterSpec(1, 2), LIVE)
    a = _job(1, 2)
    drv.submit(a)
    assert [j.job_id for j in drv.schedule().started] == [1]
    drv.advance(5.0)                       # 2 GPUs x 5 s = the threshold
    assert a.service == pytest.approx(10.0)
    drv.schedule()
    assert drv.policy.queue_of(a) == 1


def test_preempted_gpus_drain_before_a_waiting_job_starts_on_them():
    drv = Driver(DiscretizedLAS(thresholds=[4.0]), ClusterSpec(1, 2), LIVE)
    old = _job(1, 2)
    drv.submit(old)
    drv.schedule()
    drv.advance(10.0)                      # old is in Q2 now
    new = _job(2, 2, t=10.0)
    drv.submit(new)
    d = drv.schedule()
    assert [j.job_id for j in d.stopped] == [1] and d.started == []
    assert drv.draining == {1: [(0, 2)]} and "released" in drv.reasons[2]
    assert drv.schedule().started == []    # still draining: nothing starts twice on the GPUs
    drv.advance(12.0)
    drv.released(old)
    d = drv.schedule()
    assert [j.job_id for j in d.started] == [2] and drv.allocation(2) == [(0, 2)]
    assert old.service == pytest.approx(20.0) and new.first_start == 12.0


def test_offline_node_preempts_its_jobs_and_takes_its_gpus_away():
    drv = Driver(DiscretizedLAS(), ClusterSpec(2, 2), LIVE)
    a, b = _job(1, 2), _job(2, 2)
    for j in (a, b):
        drv.submit(j)
    drv.schedule()
    node_of_a = drv.allocation(1)[0][0]
    hit = drv.set_online(node_of_a, False)
    assert hit == [a] and not a.running
    drv.released(a)
    assert drv.schedule().started == []    # the other node is full, a's node offline
    drv.remove(b)
    d = drv.schedule()
    assert [j.job_id for j in d.started] == [1] and drv.allocation(1)[0][0] != node_of_a
    drv.set_online(node_of_a, True)
    assert sum(drv.nodes.free) == 2


def test_eligibility_confines_a_job_and_says_why_it_waits():
    allowed = {1: [False, True], 2: [False, False]}
    drv = Driver(DiscretizedLAS(), ClusterSpec(2, 2), LIVE, eligible=lambda j: allowed.get(j.job_id))
    drv.submit(_job(1, 1))
    drv.submit(_job(2, 1))
    d = drv.schedule()
    assert [j.job_id for j in d.started] == [1] and drv.allocation(1) == [(1, 1)]
    assert "memory" in drv.reasons[2]


def test_high_skew_job_waits_for_a_consolidated_placement_low_skew_spreads():
    drv = Driver(DiscretizedLAS(), ClusterSpec(2, 4), LIVE)
    for jid in (1, 2):
        drv.submit(_job(jid, 3))
    drv.schedule()                          # one free GPU left on each node
    drv.submit(_job(3, 2, t=1.0, skew=0.7))
    drv.submit(_job(4, 2, t=2.0, skew=0.05))
    d = drv.schedule()
    assert [j.job_id for j in d.started] == [4] and len(drv.allocation(4)) == 2
    assert "PACKLIMIT" in drv.reasons[3] and "fragmented" in drv.reasons[3]


def test_simulator_refuses_live_mode():
    with pytest.raises(ValueError, match="live"):
        simulate([], ClusterSpec(1, 1), DiscretizedLAS(), config=DriverConfig("tiresias", defer_release=True))


def test_a_draining_job_never_starts_again_before_its_run_exits():
    drv = Driver(DiscretizedLAS(), ClusterSpec(2, 2), LIVE)
    a = _job(1, 2)
    drv.submit(a)
    drv.schedule()
    node = drv.allocation(1)[0][0]
    drv.set_online(node, False)              # its node is drained: a stops, the other node is free
    d = drv.schedule()
    assert d.started == [] and "previous run" in drv.reasons[1]
    drv.released(a)
    d = drv.schedule()
    assert [j.job_id for j in d.started] == [1] and drv.allocation(1)[0][0] != node


# --- invariants of the live driver under random events (hypothesis) ----------------------------

EVENTS = st.lists(st.tuples(st.sampled_from(["submit", "advance", "finish", "release", "offline", "online",
                                             "cancel"]),
                            st.integers(0, 1000), st.floats(0.0, 1.0)), min_size=1, max_size=80)


@settings(max_examples=150, deadline=None)
@given(EVENTS)
def test_live_driver_never_overcommits_a_node_nor_restarts_a_draining_job(events):
    drv = Driver(DiscretizedLAS(thresholds=[8.0, 40.0]), ClusterSpec(3, 4), LIVE)
    next_id, t = 0, 0.0
    for kind, n, x in events:
        if kind == "submit":
            next_id += 1
            drv.submit(_job(next_id, 1 + n % 8, t, skew=x))
        elif kind == "advance":
            t += 1 + n % 20
            drv.advance(t)
        elif kind == "finish" and drv.running:
            drv.finish(sorted(drv.running.values(), key=lambda j: j.job_id)[n % len(drv.running)])
        elif kind == "release" and drv.draining:
            jid = sorted(drv.draining)[n % len(drv.draining)]
            drv.released(drv.jobs[jid])
        elif kind in ("offline", "online"):
            drv.set_online(n % 3, kind == "online")
        elif kind == "cancel" and drv.policy.active:
            jid = sorted(drv.policy.active)[n % len(drv.policy.active)]
            drv.withdraw(drv.jobs[jid])
        before = set(drv.draining)
        decision = drv.schedule()
        started = {j.job_id for j in decision.started}
        assert not started & before                       # a draining job never starts again
        assert not set(drv.running) & set(drv.draining)
        held = [0, 0, 0]
        for alloc in list(drv.nodes.alloc.values()) + list(drv.draining.values()):
            for node, g in alloc:
                held[node] += g
        for node in range(3):
            if node not in drv.nodes.offline:
                assert held[node] + drv.nodes.free[node] == 4   # every GPU is free, running or draining
            assert all(node != nd for jid in drv.running for nd, _ in drv.nodes.alloc[jid]) \
                or node not in drv.nodes.offline                # nothing runs on an offline node
        assert drv.used == sum(j.num_gpus for j in drv.running.values())
        assert set(drv.running) == set(drv.nodes.alloc)
