"""Benchmark: what surviving an aggregator's loss costs AutoPS -- fault tolerance on vs off per
iteration (sum mode: the workers' copies of their pushes; server mode: replication to a second
aggregator), and the pause a SIGKILLed aggregator causes (heartbeat timeout + recovery).

Thin entry point; the same as `autops bench failover ...` (dlrt_bench/autops_failover.py).

    python bench/autops_failover.py --json bench/results/autops_failover.json
"""
import sys

from dlrt_bench.autops_failover import main

if __name__ == "__main__":
    sys.exit(main())
