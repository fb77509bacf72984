"""Benchmark: Optimus's sensitivity to errors in its estimates (Fig. 15) and what its allocation
and placement contribute (Fig. 18-19) on the Pollux workloads 1-5, with AutoPS's aggregators.

Thin entry point (dlrt_bench/optimus_sensitivity.py).

    python bench/optimus_sensitivity.py --json bench/results/optimus_sensitivity.json
"""
import sys

from dlrt_bench.optimus_sensitivity import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
