"""Benchmark: aggregators and aggregator CPU when J concurrent 2s-2w jobs share AutoPS (packing)
vs. keep 2 dedicated aggregators each, and how much slower each job runs (thesis Fig. 4.9/4.10).

Thin entry point; the same as `autops bench packing ...` (dlrt_bench/autops_packing.py). Worker
compute is sleep-emulated at the model's iteration time, tensors are scaled by --scale (default
0.1). Writes JSON lines with
at least model, jobs, aggregators_shared, aggregators_dedicated, cpu_s_per_iter_shared,
cpu_s_per_iter_dedicated, max_slowdown, aggregator_reduction.

    python bench/autops_packing.py --jobs 2 3 4 --model vgg19 --json bench/results/autops_packing.json
    python bench/autops_packing.py --jobs 4 --model alexnet resnet50 --json bench/results/autops_packing.json --append
"""
import sys

from dlrt_bench.autops_packing import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
