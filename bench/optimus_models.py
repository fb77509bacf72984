"""Benchmark: Optimus' speed model (eq. 4) and convergence model (eq. 1) on the Pollux applications.

Thin entry point (dlrt_bench/optimus_models.py): the speed fit's relative error with 10 sampled
(p, w) configurations (the paper's Fig. 8) and the convergence fit's error from half the epochs.

    python bench/optimus_models.py --json bench/results/optimus_models.json
"""
import sys

from dlrt_bench.optimus_models import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
