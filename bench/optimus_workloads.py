"""Benchmark: every policy on the Pollux workloads 1-5 on 16x4, in the calibration setting
(against the published figures) and with AutoPS's aggregators (against DRF, as the paper).

Thin entry point (dlrt_bench/optimus_workloads.py).

    python bench/optimus_workloads.py --json bench/results/optimus_workloads.json
"""
import sys

from dlrt_bench.optimus_workloads import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
