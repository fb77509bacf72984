"""Benchmark: pause a training job sees when AutoPS live-migrates all its tensors to other
aggregators, and how long the migration takes (thesis Table 4.3).

Thin entry point; the same as `autops bench migrate ...` (dlrt_bench/autops_migrate.py). One
job, 2 workers, 4 aggregators (static pool), real tensor sizes by default, and a resnet50 job
on the aggregators it moves to (--other). Writes JSON lines with at least model, mode,
max_pause_ms, median_pause_ms (the switch iterations), max_window_excess_ms,
median_window_excess_ms (the whole migration), migration_s, keys_moved, baseline_comm_ms and
other_job (the neighbour's times during and outside the migrations, and their ratios).

    python bench/autops_migrate.py --model vgg19 bert-base --json bench/results/autops_migrate.json
    python bench/autops_migrate.py --model vgg19 --mode server --json bench/results/autops_migrate.json --append
"""
import sys

from dlrt_bench.autops_migrate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
