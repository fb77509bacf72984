"""A memory-intensive workload that checks its own results: the application the paging tests,
the application benchmark and the demo run inside a memory-limited cgroup.

``python -m dlrt_bench.workload --mib 256 --rounds 3`` allocates ``mib`` MiB of 64-bit words
filled with a known pattern, then touches random 64 KiB chunks (each round visits every chunk
once, in a random order): it checks the chunk against what it must hold and rewrites it
with a round-dependent key. A final pass checks every word, and ``--sort`` also sorts a copy
of a slice and checks the order. With less memory than ``mib`` in the cgroup, every round
pages chunks out and back in through whatever swap is active. One JSON line goes to stdout:
seconds per phase, chunk latency percentiles (microseconds) and ``errors`` (mismatching
words; the exit status is 1 when there are any).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

CHUNK_WORDS = 8192                 # 64 KiB of uint64
MULT = np.uint64(0x9E3779B97F4A7C15)


def pattern(start: int, count: int) -> np.ndarray:
    idx = np.arange(start, start + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return idx * MULT + np.uint64(0x5DEECE66D)


def round_key(r: int) -> np.uint64:
    return np.uint64((r + 1) * 0x2545F4914F6CDD1D % (1 << 64))


def run(mib: int, rounds: int, seed: int, sort_mib: int) -> dict:
    words = mib * (1 << 20) // 8
    chunks = words // CHUNK_WORDS
    words = chunks * CHUNK_WORDS
    t0 = time.perf_counter()
    data = np.empty(words, dtype=np.uint64)
    for c in range(0, chunks, 256):                     # fill in slices: no big temporary
        n = min(256, chunks - c) * CHUNK_WORDS
        data[c * CHUNK_WORDS:c * CHUNK_WORDS + n] = pattern(c * CHUNK_WORDS, n)
    fill_s = time.perf_counter() - t0
    keys = np.zeros(chunks, dtype=np.uint64)             # xor of the round keys applied per chunk
    rng = np.random.default_rng(seed)
    latencies = np.empty(chunks * rounds, dtype=np.float64)
    errors = 0
    t1 = time.perf_counter()
    n = 0
    for r in range(rounds):
        key = round_key(r)
        for c in rng.permutation(chunks):
            s = time.perf_counter()
            view = data[c * CHUNK_WORDS:(c + 1) * CHUNK_WORDS]
            expect = pattern(c * CHUNK_WORDS, CHUNK_WORDS) ^ keys[c]
            errors += int(np.count_nonzero(view != expect))
            np.bitwise_xor(view, key, out=view)
            keys[c] ^= key
            latencies[n] = time.perf_counter() - s
            n += 1
    access_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    for c in range(chunks):
        view = data[c * CHUNK_WORDS:(c + 1) * CHUNK_WORDS]
        errors += int(np.count_nonzero(view != (pattern(c * CHUNK_WORDS, CHUNK_WORDS) ^ keys[c])))
    verify_s = time.perf_counter() - t2
    sort_s = 0.0
    if sort_mib:
        t3 = time.perf_counter()
        part = np.array(data[:min(words, sort_mib * (1 << 20) // 8)])
        part.sort(kind="stable")
        errors += int(np.count_nonzero(part[1:] < part[:-1]))
        sort_s = time.perf_counter() - t3
        del part
    lat_us = latencies[:n] * 1e6
    return {"mib": mib, "rounds": rounds, "chunks": chunks, "fill_s": fill_s, "access_s": access_s,
            "verify_s": verify_s, "sort_s": sort_s, "total_s": fill_s + access_s + verify_s + sort_s,
            "chunk_us_p50": float(np.percentile(lat_us, 50)), "chunk_us_p99": float(np.percentile(lat_us, 99)),
            "chunk_us_max": float(lat_us.max()) if n else 0.0, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dlrt_bench.workload", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="working set in MiB")
    ap.add_argument("--rounds", type=int, default=2, help="random passes over all chunks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sort-mib", type=int, default=0, help="also sort a copy of this many MiB")
    args = ap.parse_args(argv)
    result = run(args.mib, args.rounds, args.seed, args.sort_mib)
    print(json.dumps(result), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
