"""``make demo``'s Infiniswap stage: a workload pages into remote memory, then to a disk swap.

As root with FUSE, loop devices and memory cgroups: starts two daemons on loopback, one
device served as FUSE file -> loop device (direct I/O) -> swap, runs the self-checking
workload (``python -m dlrt_bench.workload``, 192 MiB working set in a 96 MiB cgroup) paging
into remote memory, and prints the slabs mapped, the bytes paged, the time, and the speed-up
over the same workload paging to a disk-backed swap (a loop device on a file on local disk;
bounded by a timeout: "> N x" when it runs out). Otherwise it prints why it skips. The
building blocks (``Stack``, ``DiskSwap``, the watchdog) are ``dlrt_bench.infiniswap_stack``.

    python examples/infiniswap_demo.py [--mib 192] [--limit-mib 96] [--disk-timeout 45]
"""
from __future__ import annotations

import argparse
import sys

from dlrt_bench.infiniswap_stack import (MiB, DiskSwap, Stack, active_swaps, missing, run_limited_watched,
                                         workload_cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python examples/infiniswap_demo.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--mib", type=int, default=192, help="working set, MiB")
    ap.add_argument("--limit-mib", type=int, default=96, help="cgroup memory limit, MiB")
    ap.add_argument("--disk-timeout", type=float, default=45.0,
                    help="give the disk-swap run this long, seconds")
    args = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"infiniswap demo: skipped: {why}")
        return 0
    others = active_swaps()
    if others:
        print(f"infiniswap demo: skipped: other swap areas are active ({', '.join(others)}); "
              f"the demo must be the only swap")
        return 0
    size = 2 * args.mib * MiB // (16 * MiB) * (16 * MiB)
    cmd = workload_cmd(args.mib, rounds=1)
    limit = args.limit_mib * MiB
    print(f"infiniswap demo: workload {args.mib} MiB in a {args.limit_mib} MiB cgroup; "
          f"device {size >> 20} MiB in 16 MiB slabs, 2 daemons")
    with Stack(size, 16 * MiB, 2, swap=True) as st:
        print(f"  swap on {st.loop_device} <- {st.frontend.disk_path} (FUSE) <- daemons "
              f"{', '.join(st.daemons.addresses)}")
        r = run_limited_watched(cmd, limit, st.progress, stall=30, timeout=120)
        s = st.stats()
    if r["rc"] != 0 or r["watchdog"] or r["timed_out"]:
        print(f"infiniswap demo: FAILED: rc {r['rc']} {r['watchdog']} "
              f"{'timed out' if r['timed_out'] else ''}\n{r['stderr'][-2000:]}")
        return 1
    io = s["io"]
    remote_s = r["seconds"]
    print(f"  remote memory: {remote_s:.1f} s, slabs mapped {s['slabs_mapped']}/{s['num_slabs']} "
          f"({', '.join(f'{a}: {len(v)}' for a, v in s['mapped'].items())}), paged out "
          f"{io['bytes_written_remote'] >> 20} MiB to remote memory, in "
          f"{io['bytes_read_remote'] >> 20} MiB from remote memory, "
          f"{io['bytes_read_disk'] >> 20} MiB from the backup file")
    with DiskSwap(size, swap=True) as ds:
        d = run_limited_watched(cmd, limit, ds.progress, stall=60, timeout=args.disk_timeout)
    if d["timed_out"]:
        print(f"  disk swap:     > {args.disk_timeout:.0f} s (stopped)  ->  speed-up "
              f"> {args.disk_timeout / remote_s:.1f} x")
    elif d["rc"] != 0:
        print(f"  disk swap:     failed (rc {d['rc']}): {d['watchdog']}")
    else:
        print(f"  disk swap:     {d['seconds']:.1f} s  ->  speed-up {d['seconds'] / remote_s:.1f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
