"""GPU sharing under Optimus's allocation in the live master (``tesserae-optimus``), on a fake
clock with an in-memory executor: the jobs a round leaves without GPUs run as guests on a
running job's very GPUs; a pair the next round keeps is not restarted; a host that ends or is
cancelled leaves its GPUs to its guest; a restarted master re-attaches both; a drained node
stops both."""
from __future__ import annotations

import pytest

from tiresias.service import master as master_mod

from test_tiresias_master import FakeExecutor, make, spec, status

ROUND = 10.0


def pair_master(tmp_path, **kw):
    return make(tmp_path, executor=kw.pop("executor", FakeExecutor(1, 1)), policy="tesserae-optimus",
                round_interval=ROUND, **kw)


def placements(ex, job_id):
    return [s.placement for s in ex.launched if s.job_id == job_id]


def test_a_job_left_out_runs_on_the_gpus_of_a_running_one_and_stays_there(tmp_path):
    assert "tesserae-optimus" in master_mod.LIVE_POLICIES
    m, clock, ex = pair_master(tmp_path)
    a = m.submit(spec(1, "a", model="resnet50", batch_size="32"))["id"]
    b = m.submit(spec(1, "b", model="vgg19", batch_size="32"))["id"]
    c = m.submit(spec(1, "c", model="vgg19", batch_size="32", share=False))["id"]
    m.tick()
    assert placements(ex, a) == placements(ex, b) == [[("node0", [0])]]     # b on a's very GPU
    assert placements(ex, c) == [] and status(m, c) == "waiting"            # c may not share
    assert m.job(a)["shares_with"] == b and m.job(b)["shares_with"] == a
    assert m.nodes()[0]["shared_gpus"] == {"0": [a, b]} and m.driver.used == 1
    for _ in range(3):                                # the rounds keep the pair: no restart
        clock.t += ROUND
        m.tick()
    assert len(ex.launched) == 2 and ex.signals == [] and status(m, b) == "running"
    ex.end(a, 1)                                      # a ends: b keeps the GPU, alone
    clock.t += 1
    m.tick()
    assert status(m, a) == "finished" and m.job(b)["shares_with"] is None
    assert m.nodes()[0]["free_gpus"] == 0 and m.driver.allocation(b) == [(0, 1)]
    assert placements(ex, c) == []


def test_a_cancelled_host_leaves_its_gpus_to_its_guest(tmp_path):
    m, clock, ex = pair_master(tmp_path)
    a = m.submit(spec(1, "a", model="resnet50", batch_size="32"))["id"]
    b = m.submit(spec(1, "b", model="vgg19", batch_size="32"))["id"]
    m.tick()
    m.cancel(a)
    assert status(m, a) == "stopping" and status(m, b) == "running"
    ex.end(a, 1, stopped=True)
    clock.t += 1
    m.tick()
    assert status(m, a) == "cancelled" and status(m, b) == "running"
    assert m.nodes()[0]["free_gpus"] == 0 and m.driver.used == 1 and m.driver.host_of(b) is None
    d = m.submit(spec(1, "d", model="resnet50", batch_size="32"))["id"]
    clock.t += ROUND
    m.tick()                                          # the round: d joins b on its GPU
    assert placements(ex, d) == [[("node0", [0])]] and m.job(d)["shares_with"] == b


def test_a_restarted_master_reattaches_a_guest_to_its_host(tmp_path):
    m, clock, ex = pair_master(tmp_path)
    a = m.submit(spec(1, "a", model="resnet50", batch_size="32"))["id"]
    b = m.submit(spec(1, "b", model="vgg19", batch_size="32"))["id"]
    m.tick()
    clock.t += 5
    m2, _, _ = make(tmp_path, clock=clock, executor=ex, policy="tesserae-optimus", round_interval=ROUND)
    assert m2.driver.partner(a) == b and m2.driver.partner(b) == a and m2.driver.used == 1
    clock.t += ROUND
    m2.tick()
    assert len(ex.launched) == 2 and ex.signals == []


def test_a_drained_node_stops_a_host_and_its_guest_and_the_gpu_waits_for_both(tmp_path):
    m, clock, ex = pair_master(tmp_path, executor=FakeExecutor(2, 1))
    a = m.submit(spec(1, "a", model="resnet50", batch_size="32"))["id"]
    b = m.submit(spec(1, "b", model="resnet50", batch_size="32"))["id"]
    c = m.submit(spec(1, "c", model="vgg19", batch_size="32"))["id"]
    m.tick()
    host = m.driver.host_of(c)
    assert host in (a, b)
    node = placements(ex, host)[0][0][0]
    assert placements(ex, c) == placements(ex, host)
    i = m.node_index[node]
    out = m.drain(node)
    assert sorted(out["preempted"]) == sorted([host, c])
    assert status(m, host) == status(m, c) == "stopping"
    held = m.driver.nodes.free[i]                     # offline, its GPU still held (-1)
    ex.end(host, 1, stopped=True)                     # the host exits first: its guest still holds the GPU
    clock.t += 1
    m.tick()
    assert m.driver.nodes.free[i] == held == -1
    ex.end(c, 1, stopped=True)
    clock.t += 1
    m.tick()
    assert m.driver.nodes.free[i] == 0 and status(m, host) == "preempted"


@pytest.mark.parametrize("policy", ["tesserae-optimus", "optimus"])
def test_the_round_interval_of_an_allocation_policy_is_its_own(tmp_path, policy):
    assert master_mod.MasterConfig(str(tmp_path), policy).round_interval == 600.0
