"""What the AutoPS property tests share: a small model of tensors (a partitioned key, a whole
key, small keys batched per aggregator), deterministic gradients, and the bit-identical
comparison of two training runs' results, the secret a test's launcher gives a job, which
aggregators hold a job and what they report, and a one-key server-mode job checked as it trains."""
from __future__ import annotations

import hashlib
import time

import numpy as np

from autops.worker.agent import Agent
from autops.aggregator.optim import make_optimizer

TENSORS = [("big", (120_000,), "float32"),     # 2 partitions at 256 KiB
           ("mid", (20_000,), "float32"),
           ("mid2", (17_000,), "float32"),      # with mid, one message over a socket when on one aggregator
           ("s1", (100,), "float32"),           # small keys, batched per aggregator
           ("s2", (37,), "float32")]
W = 2


def secret_for(job: str) -> str:
    """The secret this suite's "launcher" gives every rank of ``job``: one per job id, the same
    in every test process (a real launcher makes a random one, ``autops.wire.jobauth.new_job_secret``)."""
    return hashlib.sha256(f"autops-test-secret/{job}".encode()).hexdigest()


def grad(rank: int, it: int, name: str, shape) -> np.ndarray:
    rng = np.random.default_rng([rank, it, sum(map(ord, name))])
    return rng.integers(-8, 8, size=shape).astype(np.float32)


def check_same(got: dict, ref: dict) -> None:
    """Every rank's final value and sum of pulled values equal the reference run's."""
    for rank in range(W):
        for name, (last, acc) in ref["results"][rank].items():
            g_last, g_acc = got["results"][rank][name]
            np.testing.assert_array_equal(g_last, last, err_msg=f"rank {rank} tensor {name}: final value")
            np.testing.assert_array_equal(g_acc, acc, err_msg=f"rank {rank} tensor {name}: values pulled")


def holding(pool, job: str, including: str | None = None, timeout: float = 15.0) -> set:
    """The aggregators of ``pool`` (a ``LocalPool``) holding ``job`` (keys or replicas) once
    their heartbeats name more than one (and ``including``, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {a["id"] for a in pool.status()["aggregators"] if job in a.get("holds_jobs", [])}
        if (len(held) > 1 and including in (None, *held)) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def reported(pool, aggs, counter: str, timeout: float = 15.0) -> dict:
    """Every aggregator's figures in ``pool``'s status (``{id: stats}``), once each of
    ``aggs`` reports a non-zero ``counter`` (they come with the heartbeats) or ``timeout``
    seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {a["id"]: a for a in pool.status()["aggregators"]}
        if all(stats.get(a, {}).get(counter) for a in aggs) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


class ServerKeyJob:
    """A W-rank ``server``-mode job of one float32 key ``w`` of ``shape`` on ``pool`` (SGD with
    momentum, one aggregator); ``step(it)`` pushes and pulls iteration ``it`` and checks every
    rank's result against the same optimizer applied locally. A context manager: closes its
    agents."""
    HP = {"lr": 0.01, "momentum": 0.9}

    def __init__(self, pool, job: str, shape: tuple, timeout: float = 20) -> None:
        self.shape = shape
        self.agents: list[Agent] = []
        try:
            for rank in range(W):           # appended one by one: all closed if one fails
                self.agents.append(Agent(pool.master, job, rank, W, mode="server", optimizer="sgd", hp=self.HP,
                                         average=False, num_aggregators=1, timeout=timeout, transport="tcp",
                                         secret=secret_for(job)))
            for agent in self.agents:
                agent.declare([("w", shape, "float32")])
            param = np.linspace(-1, 1, shape[0], dtype=np.float32)
            self.agents[0].init("w", param).wait()
        except BaseException:
            self.close()
            raise
        self.param, self.reference = param.copy(), make_optimizer("sgd", self.HP)
        self.outs = [np.empty(shape, np.float32) for _ in range(W)]

    def step(self, it: int) -> None:
        handles = [agent.push_pull("w", grad(r, it, "w", self.shape), self.outs[r], it)
                   for r, agent in enumerate(self.agents)]
        for handle in handles:
            handle.wait(30)
        self.reference.step(self.param, sum(grad(r, it, "w", self.shape) for r in range(W)))
        for out in self.outs:
            np.testing.assert_array_equal(out, self.param)

    def owner(self) -> str:
        return next(iter(self.agents[0].placement()))

    def close(self) -> None:
        for agent in self.agents:
            agent.close()

    def __enter__(self) -> "ServerKeyJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
