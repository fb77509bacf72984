"""AutoPS's data path over the rdma transport, in one process: pMaster and two aggregators
(``transport="rdma"``) in threads, two agents asking for rdma, every queue pair on a fake
fabric (``rdma_fake``) whose READs are memmoves -- so the whole path (endpoints
advertised and chosen, DATA records, lent published buffers READ by the agents, pushes
READ by the aggregators, DONE) runs here without a device. Sums must be exact."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import autops.worker.agent
import autops.transport.links as links
from autops.worker.agent import Agent
from autops.aggregator.service import Aggregator
from autops.master.pmaster import Master
from autops.transport.rdma import RdmaChannel
from rdma_fake import FakeFabric, FakeVerbs

TENSORS = [
    ("big", (300_000,), "float32"),      # partitions larger than INLINE_MAX: READ both ways
    ("mid", (40_000,), "float32"),
    ("b1", (10,), "float32"),            # small: batched and inline
    ("i64", (5,), "int64"),
]


@pytest.fixture
def rdma_pool(monkeypatch):
    fabric = FakeFabric()
    made: list[FakeVerbs] = []

    def open_fake() -> FakeVerbs:
        made.append(FakeVerbs(fabric, f"fake{len(made)}"))
        return made[-1]

    monkeypatch.setattr(links, "PyverbsNic", open_fake)
    monkeypatch.setattr(autops.worker.agent, "require_device", lambda: "fake")
    master = Master("tcp://127.0.0.1:0", heartbeat_timeout=30)
    aggs = [Aggregator(master.address, transport="rdma", heartbeat_interval=0.5) for _ in range(2)]
    threads = [threading.Thread(target=s.run, daemon=True) for s in (master, *aggs)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while not all(agg.agg_id for agg in aggs):          # both registered before a job asks
            assert time.monotonic() < deadline, "the aggregators did not register"
            time.sleep(0.01)
        yield master, aggs, fabric
    finally:
        for s in (*aggs, master):
            s.stop()
        for t in threads:
            t.join(10)


def test_push_pull_over_rdma_is_exact(rdma_pool):
    master, aggs, fabric = rdma_pool
    assert all(agg.endpoints["rdma"].startswith("rdma://") for agg in aggs)
    agents: list[Agent] = []
    results, errors = {}, []

    def work(rank: int, agent: Agent) -> None:
        try:
            rng = np.random.default_rng(rank)
            for it in (1, 2, 3):
                ins = {n: rng.integers(-1000, 1000, size=s).astype(d) for n, s, d in TENSORS}
                outs = {n: np.empty(s, d) for n, s, d in TENSORS}
                for h in [agent.push_pull(n, ins[n], outs[n], it) for n, _, _ in TENSORS]:
                    h.wait()
                results[(rank, it)] = (ins, outs)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    try:
        for rank in range(2):                       # appended one by one: all closed if one fails
            agents.append(Agent(master.address, "rdma-job", rank, 2, average=False, partition_bytes=256 << 10,
                                num_aggregators=2, transport="rdma", timeout=20, secret="rdma-job-secret-0123456789"))
        for agent in agents:
            agent.declare(TENSORS)
        threads = [threading.Thread(target=work, args=(r, a)) for r, a in enumerate(agents)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        for it in (1, 2, 3):
            for n, _, _ in TENSORS:
                expected = sum(results[(r, it)][0][n] for r in range(2))
                for r in range(2):
                    np.testing.assert_array_equal(results[(r, it)][1][n], expected)
        assert fabric.qps, "no queue pair was made"
        assert sum(qp.reads for qp in fabric.qps.values()) > 0     # payloads went by READ
    finally:
        for agent in agents:
            agent.close()


def test_agents_reach_rdma_aggregators_over_rdma_channels(rdma_pool, monkeypatch):
    master, aggs, _ = rdma_pool
    seen = []
    real_init = RdmaChannel.__init__

    def spy(self, *args, **kwargs):
        seen.append(args[2])                                   # the address
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(RdmaChannel, "__init__", spy)
    agent = Agent(master.address, "rdma-one", 0, 1, num_aggregators=1, transport="rdma", timeout=20,
                  secret="rdma-one-secret-0123456789")
    try:
        agent.declare([("w", (50_000,), "float32")])
        out = np.empty(50_000, np.float32)
        agent.push_pull("w", np.ones(50_000, np.float32), out, 1).wait()
        np.testing.assert_array_equal(out, np.ones(50_000, np.float32))
    finally:
        agent.close()
    assert seen and all(address in {agg.endpoints["rdma"] for agg in aggs} for address in seen)
