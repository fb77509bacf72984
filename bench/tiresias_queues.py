"""Benchmark: 2D-LAS with ``--queues auto`` next to the paper's K=2 / 3,200 GPU-s, SRTF,
best-effort and Gandiva, on philly.csv at 48x8 and on a trace built from the original
simulator's YARN GPU-time samples, as the original simulator and with the cost models on.

Thin entry point (dlrt_bench/tiresias_queues.py). Takes several minutes (the philly runs).

    python bench/tiresias_queues.py --json bench/results/tiresias_queues.json
"""
import sys

from dlrt_bench.tiresias_queues import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
