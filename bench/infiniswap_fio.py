"""Benchmark: fio on the Infiniswap device's loop device against its peers (root).

Thin entry point (see dlrt_bench/infiniswap_fio.py).

    python bench/infiniswap_fio.py --json bench/results/infiniswap_fio.json
    python bench/infiniswap_fio.py --emulate-hosts --link 10gbit --json bench/results/infiniswap_fio_hosts.json
"""
import sys

from dlrt_bench.infiniswap_fio import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
