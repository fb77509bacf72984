"""Benchmark: the device's C FUSE front end against a Python FUSE server, both behind a
loop device with direct I/O, measured with fio in the same run (DESIGN.md §4).

    sudo .venv/bin/python bench/infiniswap_fuse_compare.py --json bench/results/infiniswap_fuse_compare.json

* C path — the real thing, RAM-backed: an ``infiniswap.Device`` whose slabs are all
  mapped to one same-host daemon (shared memory), served by ``isw_fuse`` (libfuse3
  low-level API, C threads) through :class:`infiniswap.frontend.Frontend`.  The device is
  written once in full first, so every page is valid in remote memory and every read is
  a memcpy from the daemon's slab memory (the JSON shows the backup file was not read).
* Python peer — ``bench/pyfuse3_ramdisk.py``: the same file on pyfuse3 (trio) over a
  bytearray.  Its connection gets the same max_background / congestion_threshold through
  fusectl (the C server sets them in init()).

Both files are attached with ``losetup --direct-io=on --sector-size 4096``; fio runs on
the loop device: 4 KiB random reads at iodepth 16 with 1 and 2 jobs, 128 KiB sequential
reads at iodepth 16 (``--direct=1 --ioengine=libaio --time_based``).  Needs root, fio,
losetup, /dev/fuse and pyfuse3 (``pip install pyfuse3``; it builds against
libfuse3-dev).  Prints a table and JSON; ratios are C / Python.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import subprocess
import sys
import tempfile

from dlrt.procs import stop_processes
from infiniswap.frontend import Frontend
from dlrt.sizes import parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
FUSECTL = "/sys/fs/fuse/connections"

TESTS = [
    # name, rw, block size, numjobs
    ("randread_4k_qd16_j1", "randread", "4k", 1),
    ("randread_4k_qd16_j2", "randread", "4k", 2),
    ("seqread_128k_qd16", "read", "128k", 1),
]


def fio(dev: str, rw: str, bs: str, numjobs: int, runtime: float, size: int) -> dict:
    cmd = ["fio", "--name=bench", f"--filename={dev}", f"--rw={rw}", f"--bs={bs}",
           "--iodepth=16", f"--numjobs={numjobs}", "--group_reporting", "--direct=1",
           "--ioengine=libaio", "--time_based", f"--runtime={runtime:g}", f"--size={size}",
           "--randrepeat=0", "--norandommap", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime + 120)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()[-500:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    rd = job["read"]
    return {"iops": round(rd["iops"]), "mb_s": round(rd["bw_bytes"] / 1e6, 1),
            "gib_s": round(rd["bw_bytes"] / (1 << 30), 3),
            "lat_mean_us": round(rd["lat_ns"]["mean"] / 1000, 1),
            "fio_error": job.get("error", 0)}


def fio_fill(dev: str, size: int) -> None:
    subprocess.run(["fio", "--name=fill", f"--filename={dev}", "--rw=write", "--bs=1M",
                    "--iodepth=16", "--direct=1", "--ioengine=libaio", f"--size={size}",
                    "--output-format=terse"], check=True, capture_output=True, timeout=600)


def run_suite(dev: str, size: int, runtime: float, label: str) -> dict:
    res = {}
    for name, rw, bs, jobs in TESTS:
        r = fio(dev, rw, bs, jobs, runtime, size)
        print(f"  {label:<7} {name:<22} {r['iops']:>9} IOPS {r['mb_s']:>9.1f} MB/s", flush=True)
        res[name] = r
    return res


def set_conn_limits(conn_id: int, max_background: int = 128, congestion: int = 96) -> str:
    """max_background / congestion_threshold of a FUSE connection, through fusectl (mounted
    on a private directory for the moment if it is not mounted)."""
    def write(base: str) -> None:
        for name, v in (("max_background", max_background),
                        ("congestion_threshold", congestion)):
            with open(f"{base}/{conn_id}/{name}", "w", encoding="ascii") as fh:
                fh.write(str(v))
    if os.path.exists(f"{FUSECTL}/{conn_id}"):
        write(FUSECTL)
        return FUSECTL
    tmp = tempfile.mkdtemp(prefix="fusectl-")
    try:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", tmp], check=True)
        try:
            write(tmp)
        finally:
            subprocess.run(["umount", tmp], check=True)
    finally:
        os.rmdir(tmp)
    return "private fusectl mount"


def losetup(path: str) -> str:
    return subprocess.run(["losetup", "--find", "--show", "--direct-io=on", "--sector-size",
                           "4096", path], check=True, capture_output=True,
                          text=True).stdout.strip()


def bench_c(size: int, slab: int, runtime: float, work: str) -> dict:
    from infiniswap.device import Device
    from infiniswap.local import LocalDaemons

    with LocalDaemons(1, slab_size=slab, capacity=size, headroom=0, period=0.2) as daemons:
        with Device(size, backup=os.path.join(work, "backup"), daemons=daemons.addresses,
                    slab_size=slab, transport="shm", hot_slab=1e12) as dev:
            mapped = dev.map_now()
            if mapped != dev.num_slabs:
                raise RuntimeError(f"only {mapped} of {dev.num_slabs} slabs mapped")
            with Frontend(dev, os.path.join(work, "mnt-c"), loop=True) as fe:
                assert fe.loop_device is not None
                fio_fill(fe.loop_device, size)     # every page valid in remote memory
                dev.flush()                         # and no disk writes still queued
                before = dev.core.stats()
                results = run_suite(fe.loop_device, size, runtime, "C")
                after = dev.core.stats()
                fs = fe.fuse.stats() if fe.fuse else None
    results["_device"] = {
        "slabs_mapped": mapped,
        "bytes_read_remote": after.bytes_read_remote - before.bytes_read_remote,
        "bytes_read_disk": after.bytes_read_disk - before.bytes_read_disk,
        "fuse_errors": fs.errors if fs else None,
    }
    return results


def bench_python(size: int, runtime: float, work: str) -> dict:
    mnt = os.path.join(work, "mnt-py")
    os.mkdir(mnt)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "pyfuse3_ramdisk.py"), mnt,
                             str(size)], stdout=subprocess.PIPE, text=True)
    loop = None
    try:
        if not select.select([proc.stdout], [], [], 30)[0] or proc.stdout.readline() != "ready\n":
            raise RuntimeError("the pyfuse3 server did not start")
        st = os.stat(os.path.join(mnt, "disk"))
        conn = (os.major(st.st_dev) << 20) | os.minor(st.st_dev)
        where = set_conn_limits(conn)
        loop = losetup(os.path.join(mnt, "disk"))
        results = run_suite(loop, size, runtime, "Python")
        results["_tuning"] = f"max_background 128, congestion_threshold 96 via {where}"
        return results
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        stop_processes([proc], timeout=30)
        if any(line.split()[1] == mnt for line in open("/proc/mounts") if len(line.split()) > 1):
            subprocess.run(["umount", "-l", mnt], check=False)
        os.rmdir(mnt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="device / file size (default 1G)")
    ap.add_argument("--slab-size", default="64M", help="device slab size (default 64M)")
    ap.add_argument("--runtime", type=float, default=10.0, help="seconds per fio run")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (FUSE mount options, losetup, fusectl)", file=sys.stderr)
        return 2
    for tool in ("fio", "losetup"):
        if shutil.which(tool) is None:
            print(f"`{tool}` is not installed", file=sys.stderr)
            return 2
    try:
        import pyfuse3
    except ImportError:
        print("the Python peer needs pyfuse3: pip install pyfuse3 (builds against "
              "libfuse3-dev)", file=sys.stderr)
        return 2
    size, slab = parse_size(args.size), parse_size(args.slab_size)
    load_at_start = os.getloadavg()[0]       # other work on the machine lowers both sides
    work = tempfile.mkdtemp(prefix="isw-fuse-bench-", dir="/var/tmp")
    try:
        c = bench_c(size, slab, args.runtime, work)
        py = bench_python(size, args.runtime, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {name: {"iops": round(c[name]["iops"] / py[name]["iops"], 2),
                     "mb_s": round(c[name]["mb_s"] / py[name]["mb_s"], 2)}
              for name, *_ in TESTS}
    fuse_version = subprocess.run(["pkg-config", "--modversion", "fuse3"], capture_output=True,
                                  text=True).stdout.strip()
    result = {
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                    "libfuse": fuse_version, "pyfuse3": pyfuse3.__version__,
                    "loadavg_at_start": load_at_start},
        "setup": {"size": size, "slab_size": slab, "runtime_s": args.runtime,
                  "loop": "losetup --direct-io=on --sector-size 4096",
                  "fio": "--direct=1 --ioengine=libaio --iodepth=16 --time_based"},
        "c": c, "python": py, "ratio_c_over_python": ratios,
    }
    print(f"\n{'test':<22} {'C IOPS':>9} {'C MB/s':>9} {'Py IOPS':>9} {'Py MB/s':>9} "
          f"{'ratio':>6}")
    for name, *_ in TESTS:
        print(f"{name:<22} {c[name]['iops']:>9} {c[name]['mb_s']:>9.1f} {py[name]['iops']:>9} "
              f"{py[name]['mb_s']:>9.1f} {ratios[name]['iops']:>6.2f}")
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
