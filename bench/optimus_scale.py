"""Benchmark: one Optimus scheduling pass (marginal-gain allocation + placement) with 4,000 jobs
on 16,000 nodes, the allocation and placement times apart (paper Fig. 12: about 5 s).

Thin entry point (dlrt_bench/optimus_scale.py).

    python bench/optimus_scale.py --json bench/results/optimus_scale.json
"""
import sys

from dlrt_bench.optimus_scale import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
