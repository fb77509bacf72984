"""What the AutoPS property tests share: a small model of tensors (a partitioned key, a whole
key, small keys batched per aggregator), deterministic gradients, and the bit-identical
comparison of two training runs' results, the secret a test's launcher gives a job, and
which aggregators hold a job."""
from __future__ import annotations

import hashlib
import time

import numpy as np

TENSORS = [("big", (120_000,), "float32"),     # 2 partitions at 256 KiB
           ("mid", (20_000,), "float32"),
           ("mid2", (17_000,), "float32"),      # with mid, one message over a socket when on one aggregator
           ("s1", (100,), "float32"),           # small keys, batched per aggregator
           ("s2", (37,), "float32")]
W = 2


def secret_for(job: str) -> str:
    """The secret this suite's "launcher" gives every rank of ``job``: one per job id, the same
    in every test process (a real launcher makes a random one, ``autops.jobauth.new_job_secret``)."""
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
