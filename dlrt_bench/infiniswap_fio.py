"""fio against /dev/loopN with direct I/O (libaio), peers in the same run.

Measures, for each block device: 4 KiB random read and random write at iodepth 1 and 16
(numjobs 1 and 2), 128 KiB sequential read and write; IOPS, bandwidth, mean and p99
completion latency, and for the device with remote memory the daemons' CPU seconds per GB
they moved and % of one core.  Devices:

* ``remote``: our device (FUSE file -> loop, direct I/O) with every slab mapped to daemons
  and the whole device written first, so reads are served from remote memory.  The daemons
  run on this host (the device then uses their memory directly, over shared memory), or,
  with ``--emulate-hosts``, each on its own emulated host (``dlrt_bench.testbed``, root) with the
  device on another, over TCP through links shaped to ``--link``;
* ``backup_only``: the same device with no daemons (every page from the backup file);
* ``plain_loop``: a plain loop device (direct I/O) on a file on local disk.

With ``--emulate-hosts`` it also runs the integrity check across hosts: fio with crc32c
verification while a daemon is SIGKILLed, then a full write and verify (``verify``: errors
must be zero), and reports the bytes each host sent and received over its link.

Targets (remote, same host): 4 KiB randread iodepth 16 >= 80k IOPS, 128 KiB seq read >= 2 GB/s.
``python bench/infiniswap_fio.py [--runtime 10] [--size 512M] [--emulate-hosts --link 10gbit]
[--json OUT]`` (root).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable

from dlrt_bench import infiniswap_stack as demo
from dlrt.sizes import parse_size
from dlrt.procs import exit_on_sigterm

from .testbed import add_rps_option

__all__ = ["TESTS", "fio", "run_all", "main"]

MiB = 1 << 20
SLAB = 16 * MiB
TESTS = [("randread_4k_qd1_j1", "randread", "4k", 1, 1),
         ("randread_4k_qd16_j1", "randread", "4k", 16, 1),
         ("randread_4k_qd16_j2", "randread", "4k", 16, 2),
         ("randwrite_4k_qd1_j1", "randwrite", "4k", 1, 1),
         ("randwrite_4k_qd16_j1", "randwrite", "4k", 16, 1),
         ("randwrite_4k_qd16_j2", "randwrite", "4k", 16, 2),
         ("seqread_128k_qd16_j1", "read", "128k", 16, 1),
         ("seqwrite_128k_qd16_j1", "write", "128k", 16, 1)]

# () -> (the daemons' CPU seconds so far, bytes they moved so far)
Meter = Callable[[], "tuple[float, int]"]


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


def run_all(dev: str, runtime: float, size: int, meter: Meter | None = None) -> dict:
    """Fill ``dev``, then every test; with ``meter``, the daemons' CPU per GB for each."""
    fill(dev, size)
    out = {}
    for name, rw, bs, qd, jobs in TESTS:
        before = meter() if meter else None
        t0 = time.perf_counter()
        out[name] = fio(dev, rw, bs, qd, jobs, runtime, size)
        wall = time.perf_counter() - t0
        if meter and before:
            cpu, moved = (b - a for a, b in zip(before, meter()))
            out[name].update(daemon_cpu_s=round(cpu, 3), daemon_bytes=moved,
                             daemon_cpu_s_per_GB=round(cpu / (moved / 1e9), 3) if moved else None,
                             daemon_core_percent=round(100 * cpu / wall, 1))
    return out


def _local_remote(size: int, runtime: float, daemons: int) -> dict[str, Any]:
    with demo.Stack(size, SLAB, daemons, daemon_capacity=size) as st:
        mapped = st.device.map_now()

        def meter() -> tuple[float, int]:
            io = st.stats()["io"]
            return (sum(d.cpu_seconds() for d in st.daemons.daemons),
                    io["bytes_read_remote"] + io["bytes_written_remote"])

        result = {"slabs_mapped": f"{mapped}/{st.device.num_slabs}",
                  "transports": sorted({d["transport"] for d in st.stats()["daemons"].values()
                                        if d["transport"]}),
                  "tests": run_all(st.loop_device, runtime, size, meter)}
        io = st.stats()["io"]
        result["io"] = {k: io[k] for k in ("bytes_read_remote", "bytes_read_disk",
                                           "bytes_written_remote")}
        return result


def _emulated_remote(size: int, runtime: float, daemons: int, link: str,
                     delay: str | None, rps: bool = True) -> dict[str, Any]:
    from .testbed import Testbed, available, cleanup
    from dlrt_bench.infiniswap_hosts import (DeviceProcess, HostCluster, link_delta,
                                             verify_with_a_daemon_killed)

    why = available(delay=delay is not None)
    if why:
        raise RuntimeError(f"emulated hosts are unavailable here: {why}")
    prefix = "iswfio"
    cleanup(prefix)
    workdir = tempfile.mkdtemp(prefix="infiniswap-fio-", dir=demo.DISK_DIR)
    try:
        with Testbed(daemons + 1, link=link, delay=delay, prefix=prefix, rps=rps) as tb, \
                HostCluster(tb, slab_size=SLAB, capacity=size, headroom=0, period=0.2,
                            timeout=2.0, lock=True) as cluster, \
                DeviceProcess(cluster, size, SLAB, workdir, hot_slab=1.0) as device:
            st = device.stats()

            def meter() -> tuple[float, int]:
                return (sum(cluster.daemon_cpu_seconds()),
                        cluster.served_bytes(cluster.status()))

            links0 = cluster.links()
            result: dict[str, Any] = {
                "link": link, "delay": delay, "congestion": tb.congestion, "rps": tb.rps,
                "device_host": cluster.device_host.name,
                "daemon_hosts": {h.name: d.address for h, d in zip(cluster.daemon_hosts,
                                                                   cluster.daemons)},
                "slabs_mapped": f"{st['slabs_mapped']}/{st['num_slabs']}",
                "transports": sorted({d["transport"] for d in st["daemons"].values()
                                      if d["transport"]}),
                "tests": run_all(device.loop_device, runtime, size, meter)}
            result["link_bytes"] = link_delta(links0, cluster.links())
            result["verify"] = verify_with_a_daemon_killed(cluster, device, size)
            return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _table(result: dict[str, Any]) -> str:
    devices = result["devices"]
    lines = [f"{'test':<24}" + "".join(f"{d:>26}" for d in devices)
             + f"{'daemons s/GB (% core)':>26}"]
    remote = result["remote"]["tests"]
    for name, *_ in TESTS:
        row = "".join(f"{v[name].get('iops', 0):>12} IOPS {v[name].get('MBps', 0):>7} MB/s"
                      for v in devices.values())
        cpu = remote[name]
        lines.append(f"{name:<24}{row}{cpu.get('daemon_cpu_s_per_GB')!s:>18} "
                     f"({cpu.get('daemon_core_percent')}%)")
    lines.append(f"remote transports: {result['remote']['transports']}")
    if "verify" in result["remote"]:
        v = result["remote"]["verify"]
        passes = ", ".join(f"{k} rc {p['rc']} error {p['error']}" for k, p in v["passes"].items())
        lines.append(f"verify across hosts with daemon {v['killed']} SIGKILLed: "
                     f"{'zero errors' if v['ok'] else 'FAILED'} ({passes})")
        lines.append("bytes over each host's link during the tests (sent/received): " + ", ".join(
            f"{h} {b['sent'] / 1e9:.2f}/{b['received'] / 1e9:.2f} GB"
            for h, b in result["remote"]["link_bytes"].items()))
    if "targets" in result:
        lines.append(f"targets: {result['targets']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runtime", type=float, default=10.0, help="seconds per test")
    ap.add_argument("--size", default="512M", help="device size")
    ap.add_argument("--num-daemons", type=int, default=2, metavar="N", help="daemon processes")
    ap.add_argument("--emulate-hosts", action="store_true",
                    help="daemons and the device on emulated hosts, over TCP (root)")
    ap.add_argument("--link", default="10gbit", help="with --emulate-hosts: link rate")
    ap.add_argument("--delay", default=None, help="with --emulate-hosts: one-way link delay")
    add_rps_option(ap, "with --emulate-hosts: ")
    ap.add_argument("--json", default=os.path.join("bench", "results", "infiniswap_fio.json"))
    args = ap.parse_args(argv)
    exit_on_sigterm()                 # stopped by SIGTERM: the testbed and the processes still go
    why = demo.missing() or (None if shutil.which("fio") else "`fio` is not installed")
    if why:
        print(f"skipped: {why}")
        return 0
    size = parse_size(args.size)
    result: dict = {"runtime_s": args.runtime, "size": size, "cpus": os.cpu_count(),
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"), "devices": {}}
    if args.emulate_hosts:
        result["remote"] = _emulated_remote(size, args.runtime, args.num_daemons, args.link,
                                            args.delay, args.rps)
    else:
        result["remote"] = _local_remote(size, args.runtime, args.num_daemons)
    result["devices"]["remote"] = result["remote"]["tests"]
    with demo.Stack(size, SLAB, 0) as st:
        result["devices"]["backup_only"] = run_all(st.loop_device, args.runtime, size)
    with demo.DiskSwap(size) as ds:
        result["devices"]["plain_loop"] = run_all(ds.loop_device, args.runtime, size)
    if not args.emulate_hosts:
        r = result["devices"]["remote"]
        result["targets"] = {
            "randread_4k_qd16_iops>=80k": r["randread_4k_qd16_j1"].get("iops", 0) >= 80_000,
            "seqread_128k_GBps>=2": r["seqread_128k_qd16_j1"].get("MBps", 0) >= 2000}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    print(_table(result))
    return 0 if result["remote"].get("verify", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
