"""Benchmark: AutoPS push+pull of whole models vs gloo all-reduce (DDP-style 25 MB buckets).

Thin entry point for `make bench`; the same as `autops bench pushpull ...`. Reads model
tensor shapes from ../shared/data/models/tensor_shapes.json. Writes JSON lines with at least
model, workers, transport, autops_s, gloo_s, ratio (autops_s / gloo_s, medians).

    python bench/autops_pushpull.py --json bench/results/autops_pushpull.json
    python bench/autops_pushpull.py --model flat64m --workers 2 --transport shm ipc --mode server
    python bench/autops_pushpull.py --emulate-hosts --workers 4 --aggregators same --link 1gbit \
        --model flat64m --json out.json        # root: each worker and aggregator on its own emulated host
"""
import sys

from dlrt_bench.autops_pushpull import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
