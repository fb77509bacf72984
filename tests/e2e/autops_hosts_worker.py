"""A worker of ``test_autops_hosts``: seeded pushes, the pulled results saved for comparison.

``python autops_hosts_worker.py MASTER JOB RANK WORLD OUT.npz`` declares ``TENSORS``
(a partitioned one, a whole one, two batched small ones), runs ``ITERATIONS`` iterations of
``push_pull`` (mean over the ranks) of random values drawn from ``RANK`` and saves every
pulled array to ``OUT.npz`` as ``NAME@ITERATION``; the placement goes to stdout as JSON.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from autops.worker.agent import Agent

TENSORS = [("big", (300_000,), "float32"), ("mid", (40_000,), "float32"),
           ("b1", (10,), "float32"), ("b2", (3, 7), "float32")]
ITERATIONS = 3
PARTITION_BYTES = 256 << 10


def main(master: str, job: str, rank: int, world: int, out_path: str) -> None:
    agent = Agent(master, job, rank, world, num_aggregators=2, timeout=60, partition_bytes=PARTITION_BYTES,
                  secret=f"test-secret-of-{job}-0123456789abcdef")     # the same for both ranks
    try:
        agent.declare(TENSORS)
        rng = np.random.default_rng(1000 + rank)
        pulled = {}
        for it in range(1, ITERATIONS + 1):
            ins = {n: rng.standard_normal(s).astype(d) for n, s, d in TENSORS}
            outs = {n: np.empty(s, d) for n, s, d in TENSORS}
            for handle in [agent.push_pull(n, ins[n], outs[n], it) for n, _, _ in TENSORS]:
                handle.wait()
            pulled.update({f"{n}@{it}": outs[n] for n in outs})
        np.savez(out_path, **pulled)
        print(json.dumps({"placement": agent.placement()}), flush=True)
    finally:
        agent.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
