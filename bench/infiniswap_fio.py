"""fio against /dev/loopN with direct I/O (libaio), peers in the same run.

Measures, for each block device: 4 KiB random read and random write at iodepth 1 and 16
(numjobs 1 and 2), 128 KiB sequential read and write; IOPS, bandwidth, mean and p99
completion latency.  Devices:

* ``remote``: our device (FUSE file -> loop, direct I/O) with every slab mapped to daemons
  on loopback and the whole device written first, so reads are served from remote memory;
* ``backup_only``: the same device with no daemons (every page from the backup file);
* ``plain_loop``: a plain loop device (direct I/O) on a file on local disk.

Targets (remote): 4 KiB randread iodepth 16 >= 80k IOPS, 128 KiB seq read >= 2 GB/s.
``python bench/infiniswap_fio.py [--runtime 10] [--size 512M] [--json OUT]`` (root).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dlrt_bench import infiniswap_stack as demo  # noqa: E402
from infiniswap.sizes import parse_size  # noqa: E402

MiB = 1 << 20
TESTS = [("randread_4k_qd1_j1", "randread", "4k", 1, 1),
         ("randread_4k_qd16_j1", "randread", "4k", 16, 1),
         ("randread_4k_qd16_j2", "randread", "4k", 16, 2),
         ("randwrite_4k_qd1_j1", "randwrite", "4k", 1, 1),
         ("randwrite_4k_qd16_j1", "randwrite", "4k", 16, 1),
         ("randwrite_4k_qd16_j2", "randwrite", "4k", 16, 2),
         ("seqread_128k_qd16_j1", "read", "128k", 16, 1),
         ("seqwrite_128k_qd16_j1", "write", "128k", 16, 1)]


def fio(dev: str, rw: str, bs: str, qd: int, jobs: int, runtime: float, size: int) -> dict:
    cmd = ["fio", "--name=b", f"--filename={dev}", "--direct=1", "--ioengine=libaio",
           f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--numjobs={jobs}",
           f"--size={size}", "--time_based=1", f"--runtime={runtime}", "--group_reporting=1",
           "--randrepeat=0", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime + 60)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-500:]}
    j = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = j["read"] if "read" in rw else j["write"]
    lat = side.get("clat_ns", {})
    return {"iops": round(side["iops"]), "MBps": round(side["bw_bytes"] / 1e6, 1),
            "clat_mean_us": round(lat.get("mean", 0) / 1e3, 1),
            "clat_p99_us": round(lat.get("percentile", {}).get("99.000000", 0) / 1e3, 1),
            "errors": j["error"]}


def fill(dev: str, size: int) -> None:
    subprocess.run(["fio", "--name=fill", f"--filename={dev}", "--direct=1", "--ioengine=libaio",
                    "--rw=write", "--bs=1m", "--iodepth=8", f"--size={size}"],
                   capture_output=True, check=True, timeout=300)


def run_all(dev: str, runtime: float, size: int) -> dict:
    fill(dev, size)
    return {name: fio(dev, rw, bs, qd, j, runtime, size) for name, rw, bs, qd, j in TESTS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runtime", type=float, default=10.0, help="seconds per test")
    ap.add_argument("--size", default="512M", help="device size")
    ap.add_argument("--num-daemons", type=int, default=2, metavar="N", help="daemon processes")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "infiniswap_fio.json"))
    args = ap.parse_args(argv)
    why = demo.missing()
    if why:
        print(f"skipped: {why}")
        return 0
    size = parse_size(args.size)
    result: dict = {"runtime_s": args.runtime, "size": size, "cpus": os.cpu_count(),
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"), "devices": {}}
    with demo.Stack(size, 16 * MiB, args.num_daemons, daemon_capacity=size) as st:
        mapped = st.device.map_now()
        result["remote_slabs_mapped"] = f"{mapped}/{st.device.num_slabs}"
        result["devices"]["remote"] = run_all(st.loop_device, args.runtime, size)
        io = st.stats()["io"]
        result["remote_io"] = {k: io[k] for k in ("bytes_read_remote", "bytes_read_disk",
                                                  "bytes_written_remote")}
    with demo.Stack(size, 16 * MiB, 0) as st:
        result["devices"]["backup_only"] = run_all(st.loop_device, args.runtime, size)
    with demo.DiskSwap(size) as ds:
        result["devices"]["plain_loop"] = run_all(ds.loop_device, args.runtime, size)
    r = result["devices"]["remote"]
    result["targets"] = {
        "randread_4k_qd16_iops>=80k": r["randread_4k_qd16_j1"].get("iops", 0) >= 80_000,
        "seqread_128k_GBps>=2": r["seqread_128k_qd16_j1"].get("MBps", 0) >= 2000}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{'test':<24}" + "".join(f"{d:>26}" for d in result["devices"]))
    for name, *_ in TESTS:
        row = "".join(f"{v[name].get('iops', 0):>12} IOPS {v[name].get('MBps', 0):>7} MB/s"
                      for v in result["devices"].values())
        print(f"{name:<24}{row}")
    print("targets:", result["targets"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
