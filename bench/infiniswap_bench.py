"""Benchmark: Infiniswap remote memory (shared memory, TCP) vs the backup file alone.

Thin entry point; the same as `infiniswap bench ...` (see infiniswap/benchmark.py). Prints a
table; `--json OUT` also writes the result.

    python bench/infiniswap_bench.py --size 2G --daemons 3 --json bench/results/infiniswap.json
"""
import sys

from infiniswap.benchmark import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
