"""Benchmark: one training step (zero_grad, forward, backward, step) through autops.torch's
DistributedOptimizer, each contract idiom, against DDP over gloo measured in the same run.

Thin entry point; the workers and their timing live in dlrt_bench/torch_step.py. Variants:
local, sum, sum-clip, server, server-averaged, sum-accumulate, ddp, ddp-clip, ddp-accumulate.
Writes JSON lines, one per model and variant, with median_ms, p90_ms, steps_per_s,
cpu_ms_per_step, ratio_to_ddp, ratio_to_sum and ratio_to_peer (the DDP step doing the same work).

    python bench/autops_torch_step.py --model mlp many-small --json bench/results/autops_torch_step.json
    python bench/autops_torch_step.py --model many-small --variants sum server-averaged ddp --steps 30
"""
import sys

from dlrt_bench.torch_step import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
