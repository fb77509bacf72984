"""``infiniswap bench``: remote memory (shared memory, TCP) against the backup file alone.

Owns the benchmark: it starts ``--num-daemons`` daemon processes (``infiniswap daemon``
children, so their CPU time is measured honestly with psutil), then for each mode --

* ``shm``  -- remote memory over shared memory (the daemon's memfd mapped by the device),
* ``tcp``  -- remote memory over the daemons' TCP data servers,
* ``disk`` -- no daemons: the backup file only (the peer every ratio is taken against) --

creates a ``Device`` of ``--size`` and, through the Python API from ``--threads`` threads:

1. maps every slab (``map_now``; each mapping is timed), then fills the device with
   sequential 128 KiB writes (so every page is valid in remote memory) -- the sequential
   write bandwidth;
2. drops the backup file's page cache (``posix_fadvise DONTNEED``, after a flush), so reads
   that go to the backup file really go to the disk;
3. runs 4 KiB random reads, 4 KiB random writes and 128 KiB sequential reads for
   ``--seconds`` each: IOPS / bandwidth and latency p50/p99 per call;
4. (remote modes) makes the daemons' emulated local usage jump so they batch-evict every
   slab (CHECK_ACTIVITY / EVICT / DONE) and reports the time to evict a slab, on the device
   (mark unmapped, clear bits, drain) and end to end on the daemon (EVICT -> DONE);
5. checks that sampled blocks still hold what was written (the random writes rewrite the
   same content, so the device's content is known at every point).

The daemons' CPU time is measured over steps 1-3 and for each phase, with the bytes moved
to and from remote memory: CPU seconds per GB and % of one core (target for ``shm``: near
zero, as with RDMA; for ``tcp``: as little as TCP allows, see docs/infiniswap.md).

``--emulate-hosts`` runs the same across emulated hosts (``dlrt_bench.testbed``, root): the
daemons on their own hosts, the device side (this module again, ``--attach FILE``) on
another, over links shaped to ``--link`` (``--delay``); modes ``tcp`` (the device's
``auto`` transport, which must pick TCP) and ``disk``.  It adds the bytes each host sent and
received over its link, so the traffic is seen to cross the shaped links.

The result is printed as a table; ``--json FILE`` also writes it as JSON (``-``: stdout,
instead of the table).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import psutil

from infiniswap.device import Device
from infiniswap.local import LocalDaemons
from dlrt.sizes import format_size, parse_size
from infiniswap.timings import summarize
from dlrt import cli
from dlrt.procs import exit_on_sigterm

__all__ = ["run", "run_emulated", "format_table", "main"]

PAGE = 4096
BLOCK = 128 << 10
MODES = ("shm", "tcp", "disk")
HOST_MODES = ("tcp", "disk")
PHASES = ("seq_write_128k", "rand_read_4k", "rand_write_4k", "seq_read_128k")


class _Content:
    """What the device holds after the fill: block ``b`` is ``base`` with its first 8 bytes
    set to ``b``; any page can be rewritten with exactly its own content."""

    def __init__(self, seed: int = 7) -> None:
        self.base = np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
        self._views = [memoryview(self.base)[o:o + PAGE] for o in range(0, BLOCK, PAGE)]

    def block(self, b: int, buf: bytearray) -> bytearray:
        buf[0:8] = b.to_bytes(8, "little")
        return buf

    def page(self, off: int, first: bytearray) -> Any:
        o = off % BLOCK
        if o:
            return self._views[o // PAGE]
        first[0:8] = (off // BLOCK).to_bytes(8, "little")
        return first

    def expected_block(self, b: int) -> bytes:
        return b.to_bytes(8, "little") + self.base[8:]


def _phase(dev: Device, threads: int, seconds: float, kind: str, content: _Content,
           one_pass: bool = False) -> dict[str, Any]:
    """``kind``: rand_read_4k | rand_write_4k | seq_read_128k | seq_write_128k."""
    size = dev.size
    block = PAGE if kind.endswith("4k") else BLOCK
    region = size // threads // BLOCK * BLOCK
    lat: list[list[int]] = [[] for _ in range(threads)]
    nbytes = [0] * threads
    barrier = threading.Barrier(threads + 1)
    start_box: list[float] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            rng = np.random.default_rng(1000 + i)
            buf = bytearray(block)
            first = bytearray(content.base[:PAGE])
            fill = bytearray(content.base)
            my = lat[i]
            if kind.startswith("rand"):
                offs = (rng.integers(0, size // PAGE, 1 << 16) * PAGE).tolist()
            else:
                offs = list(range(i * region, (i + 1) * region, BLOCK))
            n = len(offs)
            op: Callable[[int], None]
            if kind == "rand_read_4k" or kind == "seq_read_128k":
                def op(off: int) -> None:
                    dev.read_into(off, buf)
            elif kind == "rand_write_4k":
                def op(off: int) -> None:
                    dev.write(off, content.page(off, first))
            else:
                def op(off: int) -> None:
                    dev.write(off, content.block(off // BLOCK, fill))
            perf = time.perf_counter_ns
            barrier.wait()
            deadline = start_box[0] + seconds
            k = 0
            while True:
                off = offs[k % n]
                t0 = perf()
                op(off)
                my.append(perf() - t0)
                k += 1
                if one_pass and k == n:
                    break
                if k & 63 == 0 and time.perf_counter() >= deadline:
                    break
            nbytes[i] = k * block
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            try:
                barrier.abort()
            except threading.BrokenBarrierError:
                pass

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    start_box.append(time.perf_counter())
    barrier.wait()
    t_start = time.perf_counter()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t_start
    if errors:
        raise errors[0]
    all_lat = np.concatenate([np.asarray(x, dtype=np.float64) for x in lat]) / 1000.0
    ops = int(all_lat.size)
    return {"ops": ops, "seconds": round(wall, 3), "iops": round(ops / wall, 1),
            "MiB_s": round(sum(nbytes) / wall / (1 << 20), 1),
            "p50_us": round(float(np.percentile(all_lat, 50)), 2),
            "p99_us": round(float(np.percentile(all_lat, 99)), 2),
            "mean_us": round(float(all_lat.mean()), 2)}


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _verify(dev: Device, content: _Content, samples: int = 64) -> bool:
    rng = np.random.default_rng(3)
    for b in rng.integers(0, dev.size // BLOCK, samples).tolist():
        if dev.read(b * BLOCK, BLOCK) != content.expected_block(b):
            return False
    return True


def _cpu(daemons: Any) -> list[float]:
    return [d.cpu_seconds() for d in daemons.daemons] if daemons else []


class _Meter:
    """The daemons' CPU time and the bytes the device moved to and from remote memory
    between two readings: CPU seconds per GB and % of one core."""

    def __init__(self, daemons: Any, dev: Device) -> None:
        self.daemons, self.dev = daemons, dev

    def read(self) -> tuple[float, float, int]:
        io = self.dev.stats()["io"]
        return (time.perf_counter(), sum(_cpu(self.daemons)),
                io["bytes_read_remote"] + io["bytes_written_remote"])

    @staticmethod
    def between(a: tuple[float, float, int], b: tuple[float, float, int]) -> dict[str, Any]:
        wall, cpu, moved = b[0] - a[0], b[1] - a[1], b[2] - a[2]
        return {"daemon_cpu_s": round(cpu, 3), "remote_bytes": moved,
                "daemon_cpu_s_per_GB": round(cpu / (moved / 1e9), 3) if moved else None,
                "daemon_core_percent": round(100 * cpu / wall, 1) if wall > 0 else None}


def _ms(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v * 1000, 3) if isinstance(v, float) else v) for k, v in summary.items()}


def _evict_all(dev: Device, daemons: LocalDaemons, timeout: float = 60.0) -> dict[str, Any]:
    """Emulated local usage jumps on every daemon: they batch-evict all of this device's slabs."""
    from infiniswap import protocol as p
    from infiniswap.channel import ask

    before = len(dev.evict_times())
    for d in daemons.daemons:
        d.set_usage(d.capacity * 2)
    deadline = time.monotonic() + timeout
    while dev.stats()["slabs_mapped"] and time.monotonic() < deadline:
        time.sleep(0.05)
    left = dev.stats()["slabs_mapped"]
    round_trips: list[float] = []
    for d in daemons.daemons:
        rep = ask(d.address, p.STATUS, timeout=5.0)["report"]
        s = rep["evict_time_s"]
        if s["count"]:
            round_trips.append(s["mean"])
        d.set_usage(0)
    dev_times = dev.evict_times()[before:]
    return {"slabs_evicted": dev.stats()["evictions"], "slabs_left_mapped": left,
            "device_ms": _ms(summarize(dev_times)),
            "daemon_evict_to_done_ms_mean_per_daemon": [round(x * 1000, 3) for x in round_trips]}


def _wait_prealloc(daemons: LocalDaemons, slabs_each: int, timeout: float = 60.0) -> None:
    from infiniswap import protocol as p
    from infiniswap.channel import ask

    deadline = time.monotonic() + timeout
    for d in daemons.daemons:
        while time.monotonic() < deadline:
            rep = ask(d.address, p.STATUS, timeout=5.0)["report"]
            if rep["slabs_free"] + rep["slabs_mapped"] >= slabs_each:
                break
            time.sleep(0.05)


def _run_mode(mode: str, size: int, slab_size: int, threads: int, seconds: float,
              daemons: Any, workdir: str, content: _Content, log: Callable[[str], None],
              tcp_transport: str = "tcp") -> dict[str, Any]:
    backup = os.path.join(workdir, f"backup-{mode}.img")
    addrs = daemons.addresses if daemons is not None and mode != "disk" else []
    dev = Device(size, backup=backup, daemons=addrs, slab_size=slab_size, period=1.0,
                 timeout=5.0, transport=tcp_transport if mode == "tcp" else "auto")
    out: dict[str, Any] = {"mode": mode}
    try:
        if addrs:
            t0 = time.perf_counter()
            dev.map_now()
            out["map_all_s"] = round(time.perf_counter() - t0, 3)
            st = dev.stats()
            out["slabs_mapped"] = st["slabs_mapped"]
            out["slabs_per_daemon"] = {a: len(s) for a, s in st["mapped"].items()}
            out["transports"] = sorted({d["transport"] for d in st["daemons"].values()
                                        if d["transport"]})
            out["map_time_ms"] = _ms(summarize(dev.map_times()))
            if st["slabs_mapped"] != dev.num_slabs:
                log(f"  warning: only {st['slabs_mapped']} of {dev.num_slabs} slabs mapped")
        meter = _Meter(daemons if addrs else None, dev)
        cpu0, t0, start = _cpu(daemons if addrs else None), time.perf_counter(), meter.read()
        for kind in PHASES:
            log(f"  {mode}: {kind}")
            before = meter.read()
            if kind == "seq_write_128k":        # the fill
                out[kind] = _phase(dev, threads, 1e9, kind, content, one_pass=True)
            else:
                out[kind] = _phase(dev, threads, seconds, kind, content)
            if addrs:
                out[kind].update(meter.between(before, meter.read()))
            if kind == "seq_write_128k":
                dev.flush()
                _drop_cache(backup)
        wall = time.perf_counter() - t0
        cpu1 = _cpu(daemons if addrs else None)
        if addrs:
            used = [b - a for a, b in zip(cpu0, cpu1)]
            out["daemon_cpu_s"] = [round(x, 3) for x in used]
            out["daemon_cpu_percent_of_one_core"] = round(100 * sum(used) / wall, 2)
            out["daemon_cpu_s_per_GB"] = meter.between(start, meter.read())["daemon_cpu_s_per_GB"]
        io = dev.stats()["io"]
        reads = io["pages_read_remote"] + io["pages_read_disk"]
        out["remote_read_fraction"] = round(io["pages_read_remote"] / reads, 4) if reads else 0.0
        out["measured_wall_s"] = round(wall, 2)
        out["verified"] = _verify(dev, content)
        if addrs:
            log(f"  {mode}: eviction of every slab")
            out["evict"] = _evict_all(dev, daemons)
            out["verified_after_eviction"] = _verify(dev, content)
    finally:
        dev.close()
        try:
            os.unlink(backup)
        except OSError:
            pass
    return out


def _capacity_each(size: int, slab_size: int, ndaemons: int) -> int:
    """A daemon holds its share of the device's slabs plus one."""
    return (-(-(size // slab_size) // ndaemons) + 1) * slab_size


def run(size: int = 2 << 30, ndaemons: int = 3, *, slab_size: int = 256 << 20, threads: int = 4,
        seconds: float = 5.0, modes: Sequence[str] = MODES, workdir: str | None = None,
        log: Callable[[str], None] = lambda s: None, daemons: Any = None,
        tcp_transport: str = "tcp") -> dict[str, Any]:
    """Run the benchmark; returns a JSON-able dict (see the module docstring).  ``daemons``:
    daemons started by someone else (``AttachedDaemons``, e.g. on emulated hosts) instead of
    ``ndaemons`` started here; ``tcp_transport``: the device's transport in mode ``tcp``."""
    if size % slab_size:
        raise ValueError(f"size {size} must be a multiple of the slab size {slab_size}")
    if size // BLOCK < threads:
        raise ValueError("the device is too small for that many threads")
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="infiniswap-bench-", dir="/var/tmp"
                                          if os.path.isdir("/var/tmp") else None)
    content = _Content()
    attached = daemons is not None
    if attached:
        ndaemons = len(daemons.daemons)
    nslabs = size // slab_size
    share = -(-nslabs // ndaemons)
    each = _capacity_each(size, slab_size, ndaemons) // slab_size
    result: dict[str, Any] = {
        "config": {"size": size, "slab_size": slab_size, "daemons": ndaemons,
                   "threads": threads, "seconds": seconds, "modes": list(modes),
                   "daemon_capacity": each * slab_size,
                   "host": {"cpus": os.cpu_count(), "memory": psutil.virtual_memory().total,
                            "python": platform.python_version(),
                            "kernel": platform.release()}},
        "runs": {}}
    try:
        if any(m != "disk" for m in modes):
            if not attached:
                log(f"starting {ndaemons} daemons ({format_size(each * slab_size)} each)")
                daemons = LocalDaemons(ndaemons, slab_size=slab_size, capacity=each * slab_size,
                                       headroom=0, period=0.2, timeout=5.0, workdir=None)
                daemons.start()
            _wait_prealloc(daemons, each)       # all of it: the baseline must not see allocation
            idle = min(3.0, seconds)
            log(f"measuring the idle daemons' CPU for {idle:g} s (baseline)")
            c0 = _cpu(daemons)
            time.sleep(idle)
            result["daemon_idle_cpu_s_per_s"] = round(
                sum(b - a for a, b in zip(c0, _cpu(daemons))) / idle, 4)
        for mode in modes:
            log(f"mode {mode}")
            result["runs"][mode] = _run_mode(mode, size, slab_size, threads, seconds, daemons,
                                             workdir, content, log, tcp_transport)
            if daemons is not None and mode != "disk" and mode != modes[-1]:
                _wait_prealloc(daemons, share)      # memory back after the evictions
    finally:
        if daemons is not None and not attached:
            result["daemon_exit_codes"] = daemons.stop()
        if own_dir:
            try:
                os.rmdir(workdir)
            except OSError:
                pass
    base = result.get("daemon_idle_cpu_s_per_s")
    for r in result["runs"].values():
        if "daemon_cpu_s" in r and base is not None:
            r["daemon_cpu_s_above_idle"] = round(sum(r["daemon_cpu_s"]) -
                                                 base * r["measured_wall_s"], 3)
    result["ratios_vs_disk"] = _ratios(result["runs"])
    return result


def _ratios(runs: dict[str, Any]) -> dict[str, Any]:
    base = runs.get("disk")
    if not base:
        return {}
    out: dict[str, Any] = {}
    for mode, r in runs.items():
        if mode == "disk":
            continue
        out[mode] = {
            "rand_read_4k_iops": round(r["rand_read_4k"]["iops"] / base["rand_read_4k"]["iops"], 2),
            "rand_write_4k_iops": round(r["rand_write_4k"]["iops"] /
                                        base["rand_write_4k"]["iops"], 2),
            "seq_read_128k_MiB_s": round(r["seq_read_128k"]["MiB_s"] /
                                         base["seq_read_128k"]["MiB_s"], 2),
            "seq_write_128k_MiB_s": round(r["seq_write_128k"]["MiB_s"] /
                                          base["seq_write_128k"]["MiB_s"], 2)}
    return out


def run_emulated(size: int = 2 << 30, ndaemons: int = 3, *, link: str = "10gbit",
                 delay: str | None = None, slab_size: int = 256 << 20, threads: int = 4,
                 seconds: float = 5.0, modes: Sequence[str] = HOST_MODES,
                 workdir: str | None = None, prefix: str = "iswbench",
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The benchmark across emulated hosts (root): ``ndaemons`` daemons on hosts 1..N, the
    device side (``--attach``) on host 0, links shaped to ``link``/``delay`` (``link``
    ``"none"``: not shaped, to see what the shaping costs).  Returns
    :func:`run`'s result plus ``emulated_hosts``: the layout and the bytes each host sent and
    received over its link during the run."""
    from .testbed import Testbed, available, cleanup
    from dlrt_bench.infiniswap_hosts import HostCluster, link_delta

    bad = [m for m in modes if m not in HOST_MODES]
    if bad:
        raise ValueError(f"mode(s) {', '.join(bad)} cannot run across hosts: use tcp, disk")
    why = available(delay=delay is not None)
    if why:
        raise RuntimeError(f"emulated hosts are unavailable here: {why}")
    cleanup(prefix)
    options = dict(slab_size=slab_size, capacity=_capacity_each(size, slab_size, ndaemons),
                   headroom=0, period=0.2, timeout=5.0)
    with Testbed(ndaemons + 1, link=None if link == "none" else link, delay=delay,
                 prefix=prefix) as tb, \
            HostCluster(tb, **options) as cluster, \
            tempfile.TemporaryDirectory(prefix="infiniswap-bench-") as tmp:
        log(f"{ndaemons} daemons on {', '.join(h.name for h in cluster.daemon_hosts)}, the device "
            f"on {cluster.device_host.name}, links {link}" + (f", delay {delay}" if delay else ""))
        cmd = [sys.executable, "-m", "dlrt_bench.infiniswap_bench", "--attach",
               cluster.write_attach_file(os.path.join(tmp, "daemons.json")),
               "--size", str(size), "--slab-size", str(slab_size), "--threads", str(threads),
               "--seconds", str(seconds), "--modes", ",".join(modes), "--json", "-"]
        if workdir:
            cmd += ["--dir", workdir]
        links0 = cluster.links()
        done = cluster.device_host.run(cmd, stdout=subprocess.PIPE)
        links = link_delta(links0, cluster.links())
        if done.returncode != 0:
            raise RuntimeError(f"the device side on {cluster.device_host.name} failed "
                               f"(exit {done.returncode}); see its messages above")
        result = json.loads(done.stdout)
        result["emulated_hosts"] = {
            "link": link, "delay": delay, "congestion": tb.congestion, "device_host": cluster.device_host.name,
            "daemon_hosts": {h.name: d.address for h, d in zip(cluster.daemon_hosts,
                                                               cluster.daemons)},
            "link_bytes": links}
    return result


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    hosts = result.get("emulated_hosts")
    lines = [f"infiniswap bench: {format_size(cfg['size'])} device, "
             f"{format_size(cfg['slab_size'])} slabs, {cfg['daemons']} daemons, "
             f"{cfg['threads']} threads, {cfg['seconds']:g} s per phase, "
             f"{cfg['host']['cpus']} CPUs" +
             (f"; daemons on emulated hosts, links {hosts['link']}" if hosts else ""),
             f"{'mode':<6} {'4K rand read':>22} {'4K rand write':>22} {'128K seq read':>16} "
             f"{'128K seq write':>16} {'remote reads':>12}",
             f"{'':<6} {'IOPS  p50/p99 us':>22} {'IOPS  p50/p99 us':>22} {'MiB/s':>16} "
             f"{'MiB/s':>16} {'':>12}"]
    for mode, r in result["runs"].items():
        def io(k: str) -> str:
            x = r[k]
            return f"{x['iops']:>8.0f} {x['p50_us']:>6.1f}/{x['p99_us']:<6.0f}"
        lines.append(f"{mode:<6} {io('rand_read_4k'):>22} {io('rand_write_4k'):>22} "
                     f"{r['seq_read_128k']['MiB_s']:>16.0f} {r['seq_write_128k']['MiB_s']:>16.0f} "
                     f"{100 * r['remote_read_fraction']:>11.1f}%")
    for mode, r in result["runs"].items():
        if "map_time_ms" not in r:
            continue
        m, e = r["map_time_ms"], r["evict"]["device_ms"]
        lines.append(
            f"{mode}: daemons' CPU {r['daemon_cpu_percent_of_one_core']:.2f}% of one core "
            f"({sum(r['daemon_cpu_s']):.2f} s in {r['measured_wall_s']:.1f} s, "
            f"{r.get('daemon_cpu_s_above_idle', float('nan')):.2f} s above idle); map a slab "
            f"p50 {m['p50']} ms (max {m['max']}); evict a slab on the device p50 {e['p50']} ms "
            f"(max {e['max']}), daemon EVICT->DONE "
            f"{r['evict']['daemon_evict_to_done_ms_mean_per_daemon']} ms; "
            f"data verified: {r['verified'] and r.get('verified_after_eviction', True)}")
    for mode, r in result["runs"].items():
        if "daemon_cpu_s_per_GB" in r:
            lines.append(f"{mode}: daemons' CPU per GB moved (% of one core): " + ", ".join(
                f"{k} {r[k]['daemon_cpu_s_per_GB']} s ({r[k]['daemon_core_percent']}%)"
                for k in PHASES) + f"; whole run {r['daemon_cpu_s_per_GB']} s")
    for mode, ratio in result.get("ratios_vs_disk", {}).items():
        lines.append(f"{mode} / disk: " + ", ".join(f"{k} x{v}" for k, v in ratio.items()))
    if hosts:
        lines.append("bytes over each host's link (sent/received): " + ", ".join(
            f"{h} {format_size(b['sent'])}/{format_size(b['received'])}"
            for h, b in hosts["link_bytes"].items()))
    return "\n".join(lines)


def _bench(args: argparse.Namespace) -> int:
    size, slab = parse_size(args.size), parse_size(args.slab_size)
    allowed = HOST_MODES if args.emulate_hosts or args.attach else MODES
    modes = [m.strip() for m in (args.modes or ",".join(allowed)).split(",") if m.strip()]
    bad = [m for m in modes if m not in allowed]
    if bad or not modes:
        raise cli.UsageError(f"unknown mode(s) {', '.join(bad) or '(none)'}: use "
                             f"{', '.join(allowed)}")
    if args.num_daemons < 1 or args.threads < 1 or not args.seconds > 0:
        raise cli.UsageError("--num-daemons, --threads and --seconds must be positive")
    if (args.link or args.delay) and not args.emulate_hosts:
        raise cli.UsageError("--link and --delay need --emulate-hosts")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.emulate_hosts:
        result = run_emulated(size, args.num_daemons, link=args.link or "10gbit", delay=args.delay,
                              slab_size=slab, threads=args.threads, seconds=args.seconds,
                              modes=modes, workdir=args.dir, log=log)
    else:
        daemons = None
        if args.attach:
            from dlrt_bench.infiniswap_hosts import AttachedDaemons
            daemons = AttachedDaemons.load(args.attach)
        result = run(size, args.num_daemons, slab_size=slab, threads=args.threads,
                     seconds=args.seconds, modes=modes, workdir=args.dir, log=log,
                     daemons=daemons, tcp_transport="auto" if args.attach else "tcp")
    cli.emit(args.json, result, format_table(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = cli.parser("infiniswap bench", __doc__.splitlines()[0])
    ap.add_argument("--size", default="2G", help="device size")
    ap.add_argument("--num-daemons", type=int, default=3, metavar="N", help="daemon processes to start")
    ap.add_argument("--slab-size", default="256M")
    ap.add_argument("--threads", type=int, default=4, help="I/O threads")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per phase")
    ap.add_argument("--modes", default=None,
                    help="comma-separated: shm,tcp,disk (default: all; tcp,disk across hosts)")
    ap.add_argument("--dir", help="where the backup files go (default: a temporary directory)")
    ap.add_argument("--emulate-hosts", action="store_true",
                    help="daemons and the device on emulated hosts (network namespaces, root)")
    ap.add_argument("--link", default=None,
                    help="with --emulate-hosts: link rate (default 10gbit; none: not shaped)")
    ap.add_argument("--delay", default=None, help="with --emulate-hosts: one-way delay, e.g. 50us")
    ap.add_argument("--attach", metavar="FILE", help=argparse.SUPPRESS)  # the device side
    cli.add_log_level(ap, "WARNING")
    cli.add_json(ap, "also write the result as JSON to FILE ('-' for stdout instead of the table)")
    args = ap.parse_args(argv)
    exit_on_sigterm()                 # stopped by SIGTERM: the testbed and the processes still go
    cli.setup_logging(args.log_level)
    return cli.run_main("infiniswap bench", _bench, args)


if __name__ == "__main__":
    raise SystemExit(main())
