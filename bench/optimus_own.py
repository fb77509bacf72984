"""Benchmark: our elastic policy, elastic-srpt, against DRF, 2D-LAS, Optimus and Optimus+Oracle
on the Pollux workloads 1-5 (with AutoPS's aggregators and in the calibration setting), and
what each of its ideas contributes.

Thin entry point (dlrt_bench/optimus_own.py).

    python bench/optimus_own.py --json bench/results/optimus_own.json
"""
import sys

from dlrt_bench.optimus_own import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
