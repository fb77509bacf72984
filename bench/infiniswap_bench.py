"""Benchmark: Infiniswap remote memory (shared memory, TCP) vs the backup file alone.

Thin entry point; the same as `infiniswap bench ...` (see dlrt_bench/infiniswap_bench.py).
Prints a table; `--json FILE` also writes the result (`-`: stdout, instead of the table).

    python bench/infiniswap_bench.py --size 2G --num-daemons 3 --json bench/results/infiniswap_bench.json
"""
import sys

from dlrt_bench.infiniswap_bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
