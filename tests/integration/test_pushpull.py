"""Real pMaster and aggregator processes on loopback; agents in threads of this process."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from autops.worker.agent import Agent, AutoPSError
from autops_testlib import secret_for

TENSORS = [
    ("big", (300_000,), "float32"),      # 1.2 MB: 5 partitions at 256 KiB
    ("mid", (40_000,), "float32"),       # 160 KB: one key
    ("m2", (20_000,), "float32"),        # 80 KB: over sockets in one message with mid when in one burst
    ("d64", (10_000,), "float64"),       # 80 KB of another type: the next message
    ("b1", (10,), "float32"),            # small: batched
    ("b2", (3, 7), "float32"),           # small: batched
    ("i64", (5,), "int64"),              # small, integer
    ("h16", (7,), "float16"),            # small, 14 bytes: the next one in a packed batch is realigned
    ("b3", (9,), "float32"),
]


def run_workers(agents, fn):
    errors = []

    def body(r):
        try:
            fn(r, agents[r])
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def make_agents(master, job, world, **kw):
    kw.setdefault("secret", secret_for(job))
    return [Agent(master, job, r, world, timeout=kw.pop("timeout", 20), **kw) for r in range(world)]


@pytest.mark.parametrize("transport, lanes", [("auto", "1"), ("tcp", "3"), ("ipc", "1")])
def test_sum_mode_exact_three_workers_two_aggregators(pool2, monkeypatch, transport, lanes):
    """Over shared memory (auto, on one host), tcp with three connections per aggregator, and
    ipc; push_pull (one PUSH_PULL per key or batch) and, at iteration 2, separate push and pull."""
    monkeypatch.setenv("AUTOPS_TCP_LANES", lanes)
    exact_three_workers(pool2, transport)


def test_sum_mode_exact_over_cma(pool2_cma):
    """Workers and aggregators in separate processes, every large payload READ from its sender."""
    exact_three_workers(pool2_cma, "cma")


def exact_three_workers(pool, transport: str) -> None:
    agents = make_agents(pool.master, f"exact-{transport}", 3, average=False, partition_bytes=256 << 10,
                         transport=transport)
    try:
        for a in agents:
            a.declare(TENSORS)
        placement = agents[0].placement()
        assert set(placement) == {"agg-0", "agg-1"}          # spread over both
        assert sum(k.startswith("big#p") for keys in placement.values() for k in keys) == 5
        results = {}

        def work(r, agent):
            rng = np.random.default_rng(r)
            for it in (1, 2, 3):
                # float16 sums stay exact below 2048
                ins = {n: (rng.integers(-1000, 1000, size=s) // (8 if d == "float16" else 1)).astype(d)
                       for n, s, d in TENSORS}
                outs = {n: np.empty(s, d) for n, s, d in TENSORS}
                if it == 2:
                    handles = [agent.push(n, ins[n], it) for n, _, _ in TENSORS]
                    handles += [agent.pull(n, outs[n], it) for n, _, _ in TENSORS]
                else:
                    handles = [agent.push_pull(n, ins[n], outs[n], it) for n, _, _ in TENSORS]
                for h in handles:
                    h.wait()
                results[(r, it)] = (ins, outs)

        run_workers(agents, work)
        for it in (1, 2, 3):
            for n, _, _ in TENSORS:
                expected = sum(results[(r, it)][0][n] for r in range(3))
                for r in range(3):
                    np.testing.assert_array_equal(results[(r, it)][1][n], expected)
    finally:
        for a in agents:
            a.close()


def test_mean_is_default_and_push_pull_separately(pool1):
    agents = make_agents(pool1.master, "mean", 2)
    try:
        for a in agents:
            a.declare([("w", (1000,), "float32")])
        outs = [np.empty(1000, np.float32) for _ in agents]

        def work(r, agent):
            before = time.monotonic()
            pushed = agent.push("w", np.full(1000, float(r + 1), np.float32), 1)
            pushed.wait()
            pulled = agent.pull("w", outs[r], 1)
            pulled.wait()
            # each handle says when it completed
            assert before <= pushed.done_at <= pulled.done_at <= time.monotonic()

        run_workers(agents, work)
        for out in outs:
            np.testing.assert_array_equal(out, 1.5)
        # each agent's I/O thread carries its name where the kernel and its tools show it
        names = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        assert {"autops-agent-0", "autops-agent-1"} <= names, names
    finally:
        for a in agents:
            a.close()


def test_the_partition_size_comes_from_the_environment_unless_the_job_sets_one(pool1, monkeypatch):
    monkeypatch.setenv("AUTOPS_PARTITION_BYTES", str(256 << 10))
    for job, kw, parts in (("part-env", {}, 5), ("part-arg", {"partition_bytes": 1 << 20}, 2)):
        [agent] = make_agents(pool1.master, job, 1, **kw)
        try:
            agent.declare(TENSORS[:2])
            keys = sorted(k for keys in agent.placement().values() for k in keys)
            assert keys == sorted([f"big#p{i}" for i in range(parts)] + ["mid"]), (job, keys)
        finally:
            agent.close()


def test_pmaster_chooses_the_partition_size_when_nobody_sets_one(pool2, monkeypatch):
    """16 MiB over two aggregators: 1 MiB partitions, 8 each. A declaration of tensors no choice
    would split chooses nothing yet; the agents learn pMaster's choice (to tell it again after
    a restart), and a later declaration keeps it."""
    monkeypatch.delenv("AUTOPS_PARTITION_BYTES", raising=False)
    agents = make_agents(pool2.master, "part-auto", 2, num_aggregators=2)
    try:
        agents[0].declare([("bias", (1000,), "float32"), ("one-mib", (1 << 18,), "float32")])
        assert [a.partition_bytes for a in agents] == [None, None]
        assert len(agents[0].keys_of("one-mib")) == 1
        for a in agents:
            a.declare([("flat", (4 << 20,), "float32")])
        placement = agents[0].placement()
        assert sorted(sum(k.startswith("flat#") for k in keys) for keys in placement.values()) == [8, 8]
        assert {spec.nbytes for spec in agents[0].keys_of("flat")} == {1 << 20}
        assert [a.partition_bytes for a in agents] == [1 << 20, 1 << 20]
        agents[0].declare([("later", (3 << 20,), "float32")])      # 12 MiB: still 1 MiB partitions
        assert len(agents[0].keys_of("later")) == 12
    finally:
        for a in agents:
            a.close()
    # a job that asks for no number of aggregators is packed: the rule takes it as one
    [packed] = make_agents(pool2.master, "part-auto-packed", 1, num_aggregators=0)
    try:
        packed.declare([("flat", (4 << 20,), "float32")])
        assert packed.partition_bytes == 2 << 20 and len(packed.keys_of("flat")) == 8
    finally:
        packed.close()


def test_two_jobs_same_tensor_names_stay_isolated(pool2):
    job_a = make_agents(pool2.master, "job-a", 2, average=False)
    job_b = make_agents(pool2.master, "job-b", 2, average=False)
    try:
        for a in job_a + job_b:
            a.declare([("weight", (50_000,), "float32"), ("bias", (4,), "float32")])
        got = {}

        def work(r, agent):
            base = 1.0 if agent.job == "job-a" else 100.0
            for it in (1, 2):
                outs = {n: np.empty(s, np.float32) for n, s in (("weight", (50_000,)), ("bias", (4,)))}
                hs = [agent.push_pull(n, np.full(o.shape, base * it, np.float32), o, it) for n, o in outs.items()]
                for h in hs:
                    h.wait()
                got[(agent.job, agent.rank, it)] = outs

        run_workers(job_a + job_b, work)
        for it in (1, 2):
            for r in (0, 1):
                assert np.all(got[("job-a", r, it)]["weight"] == 2.0 * it)
                assert np.all(got[("job-b", r, it)]["bias"] == 200.0 * it)
        # a job cannot touch another job's keys: wrong secret is refused by the aggregator
        intruder = job_b[0]
        real_secret = intruder.secret
        intruder.secret = job_a[0].secret
        try:
            with pytest.raises(AutoPSError, match="wrong secret"):
                intruder.push_pull("weight", np.zeros(50_000, np.float32), np.empty(50_000, np.float32), 3).wait()
        finally:
            intruder.secret = real_secret
        # and a third process cannot join job-a once its ranks are in
        with pytest.raises(AutoPSError, match="already joined"):
            Agent(pool2.master, "job-a", 0, 2, timeout=5, secret=secret_for("job-a"))
    finally:
        for a in job_a + job_b:
            a.close()


def test_worker_death_gives_peers_a_clear_timeout(pool1):
    agents = make_agents(pool1.master, "dies", 2, timeout=1.5)
    try:
        for a in agents:
            a.declare([("w", (1000,), "float32")])
        out = np.empty(1000, np.float32)
        # rank 1 "dies" before pushing: rank 0 must not hang
        with pytest.raises(TimeoutError, match=r"pull of w \(iteration 1\).*another worker of the job may have died"):
            agents[0].push_pull("w", np.ones(1000, np.float32), out, 1).wait()
    finally:
        for a in agents:
            a.close()


def test_unreachable_master_fails_within_timeout():
    import time
    start = time.monotonic()
    with pytest.raises(AutoPSError, match=r"tcp://127\.0\.0\.1:9 did not answer"):
        Agent("tcp://127.0.0.1:9", "nobody", 0, 1, timeout=1.0, secret=secret_for("nobody"))
    assert time.monotonic() - start < 5


def test_agent_checks_shapes_and_declarations(pool1):
    agent = make_agents(pool1.master, "checks", 1)[0]
    try:
        agent.declare([("w", (10,), "float32")])
        with pytest.raises(AutoPSError, match="was not declared"):
            agent.push("nope", np.zeros(3, np.float32), 1)
        with pytest.raises(AutoPSError, match=r"declared \[10\] float32"):
            agent.push("w", np.zeros(11, np.float32), 1)
        with pytest.raises(AutoPSError, match="declared"):
            agent.declare([("w", (12,), "float32")])
    finally:
        agent.close()
