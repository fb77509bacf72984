"""Benchmark: Optimus's parameter assignment (PAA, EuroSys'18 §5.3/Table 3) vs. MXNet's default
split vs. AutoPS's key planning (auto partition size, spread_by_bytes), per model and p.

Thin entry point (dlrt_bench/autops_paa.py). Pure computation, a second or two.

    python bench/autops_paa.py --json bench/results/autops_paa.json
"""
import sys

from dlrt_bench.autops_paa import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
