"""Benchmark check: replay every simulator figure ``bench/results/`` pins and compare.

Thin entry point (dlrt_bench/tiresias_pinned.py).

    python bench/tiresias_pinned.py [--only 60job philly20k] [--update] [--json FILE]
"""
import sys

from dlrt_bench.tiresias_pinned import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
