"""Application paging: ``python -m dlrt_bench.workload`` (random 64 KiB chunk accesses over
its working set, plus its ``--sort-mib`` sort) with 100%, 75% and 50% of the working set
in memory (cgroup limit), paging to

* ``remote``: our device (daemons on loopback, FUSE -> loop (direct I/O) -> swap), and
* ``disk``: a disk-backed swap (a loop device, direct I/O, on a file on local disk, same size),

in the same run.  Reports per run: completion time, chunk latency p99, both normalized to
the 100% run of the same backend; disk runs are bounded by ``--disk-timeout`` and a timeout
is reported as such (the ratio then is a lower bound, ">").  Targets (thesis Fig 2.13 vs
2.1): at 50%, remote within 2x of 100%, and >= 4x faster than disk swap.
``python bench/infiniswap_apps.py [--mib 256] [--disk-timeout 300]`` (root; no other swap).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dlrt_bench import infiniswap_stack as demo  # noqa: E402

MiB = 1 << 20
FRACTIONS = (1.0, 0.75, 0.5)


def one(cmd: list[str], limit: int, progress, timeout: float) -> dict:
    r = demo.run_limited_watched(cmd, limit, progress, stall=60, timeout=timeout)
    w = demo.parse_workload(r["stdout"]) or {}
    out = {"seconds": round(r["seconds"], 2), "rc": r["rc"], "timed_out": r["timed_out"],
           "watchdog": r["watchdog"], "chunk_us_p99": w.get("chunk_us_p99"),
           "errors": w.get("errors"), "peak_mib": round(r["stats"].get("peak_bytes", 0) / MiB, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="working set (MiB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sort-mib", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300.0, help="per remote run (s)")
    ap.add_argument("--disk-timeout", type=float, default=300.0, help="per disk-swap run (s)")
    ap.add_argument("--num-daemons", type=int, default=2, metavar="N", help="daemon processes")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "infiniswap_apps.json"))
    args = ap.parse_args(argv)
    why = demo.missing()
    if why:
        print(f"skipped: {why}")
        return 0
    if demo.active_swaps():
        print(f"skipped: other swap areas are active: {demo.active_swaps()}")
        return 0
    # 100% run: limit = working set + interpreter/numpy overhead, so nothing pages
    overhead = 64 * MiB
    cmd = demo.workload_cmd(args.mib, args.rounds, args.sort_mib)
    size = (2 * args.mib * MiB + 16 * MiB - 1) // (16 * MiB) * (16 * MiB)
    res: dict = {"mib": args.mib, "rounds": args.rounds, "sort_mib": args.sort_mib,
                 "limit_overhead_mib": overhead // MiB, "cpus": os.cpu_count(),
                 "time": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": {"remote": {}, "disk": {}}}
    limits = {f"{int(f * 100)}%": int(args.mib * MiB * f) + (overhead if f == 1.0 else 0)
              for f in FRACTIONS}
    with demo.Stack(size, 16 * MiB, args.num_daemons, daemon_capacity=size, swap=True) as st:
        for name, limit in limits.items():
            res["runs"]["remote"][name] = one(cmd, limit, st.progress, args.timeout)
            print("remote", name, res["runs"]["remote"][name], flush=True)
        s = st.stats()
        res["remote_device"] = {"slabs_mapped": s["slabs_mapped"], "num_slabs": s["num_slabs"],
                                **{k: s["io"][k] for k in ("bytes_written_remote",
                                                           "bytes_read_remote", "bytes_read_disk")}}
    with demo.DiskSwap(size, swap=True) as ds:
        for name, limit in limits.items():
            res["runs"]["disk"][name] = one(cmd, limit, ds.progress, args.disk_timeout)
            print("disk", name, res["runs"]["disk"][name], flush=True)
    for backend, runs in res["runs"].items():
        base = runs["100%"]
        for r in runs.values():
            r["time_vs_100"] = round(r["seconds"] / base["seconds"], 2)
            if r["chunk_us_p99"] and base["chunk_us_p99"]:
                r["p99_vs_100"] = round(r["chunk_us_p99"] / base["chunk_us_p99"], 2)
    rem, dsk = res["runs"]["remote"]["50%"], res["runs"]["disk"]["50%"]
    ratio = dsk["seconds"] / rem["seconds"]
    res["disk_vs_remote_at_50"] = (f">{ratio:.2f}" if dsk["timed_out"] else round(ratio, 2))
    res["targets"] = {"remote_50_within_2x_of_100": rem["time_vs_100"] <= 2.0,
                      "disk_50_at_least_4x_slower": ratio >= 4.0}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps({k: res[k] for k in ("disk_vs_remote_at_50", "targets")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
