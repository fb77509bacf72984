"""What a lost tail costs Infiniswap's remote reads and writes over TCP, with and without the
connections' retransmission-timeout floor lowered (``$INFINISWAP_TCP_RTO_MIN_US``,
``dlrt/tcpopts.py``), between two emulated hosts (root).

    python bench/infiniswap_tail_loss.py --json bench/results/infiniswap_tail_loss.json

A device on one host maps ``--size`` bytes of slabs on a daemon's data server on the other,
over links shaped to ``--link``. In each trial the same device reads (and writes) that span
twice: once as it is, and once with a blackout (``Testbed.blackout``: the link's queue drops
every packet for ``--blackout`` ms, starting ``--at`` ms into the I/O) of the direction that
carries the data -- the device's download for a read (the daemon's replies), the daemon's for
a write (the device's requests) -- so only the sender's retransmission timer resumes the
transfer. Arms, alternated trial by trial: the kernel's floor (0: 200 ms) and the
connections' own (``--rto-min-us``, default 10 ms), set on both ends. Per arm and direction:
the floor both ends took, the I/O's time without and with the blackout (medians) and the
difference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

from dlrt_bench.testbed import Testbed, cleanup
from dlrt_bench import tail_loss_bench
from dlrt_bench.autops_migrate import in_netns
from infiniswap.core import CoreDevice, DataServer, SlabStore

SLAB = 4 << 20


def timed(io, blackout=None, at: float = 0.0) -> float:
    """Seconds ``io()`` took; ``blackout()`` is called ``at`` seconds after it started."""
    timer = threading.Timer(at, blackout) if blackout is not None else None
    start = time.monotonic()
    if timer is not None:
        timer.start()
    io()
    took = time.monotonic() - start
    if timer is not None:
        timer.join()
    return took


def trial(tb: Testbed, floor: int, args: argparse.Namespace, workdir: str) -> dict:
    """One arm's trial on fresh connections: {direction: (plain s, blackout s)} and the floors."""
    device_host, daemon_host = tb.hosts
    nslabs = args.size // SLAB
    store = SlabStore((nslabs + 1) * SLAB, SLAB, lock=False)
    server = in_netns(daemon_host.netns, lambda: DataServer(store, daemon_host.addr, 0, rto_min_us=floor))
    dev = CoreDevice(nslabs * SLAB, SLAB, os.path.join(workdir, "backup.img"))
    blackouts: list[threading.Timer] = []
    try:
        rid = in_netns(device_host.netns, lambda: dev.add_remote_tcp(
            daemon_host.addr, server.port(), connections=args.connections, timeout=10.0, rto_min_us=floor))
        for slab in range(nslabs):
            region = store.alloc_slab()
            dev.map_slab(slab, rid, region, store.generation(region))
        data = os.urandom(1 << 20) * (args.size >> 20)
        out = bytearray(args.size)

        def write() -> None:
            dev.write(0, data)

        def read() -> None:
            dev.read_into(0, out)

        def dark(host):
            return lambda: blackouts.append(tb.blackout(host, args.blackout / 1e3))

        got = {}
        for name, io, host in (("write", write, daemon_host), ("read", read, device_host)):
            timed(io)                                      # grow the windows
            time.sleep(args.idle)
            plain = timed(io)
            time.sleep(args.idle)
            through = timed(io, dark(host), args.at / 1e3)
            for timer in blackouts:
                timer.join()                               # the shaping is back
            time.sleep(args.idle)
            got[name] = (plain, through)
        if bytes(out) != data:
            raise AssertionError("the pages read back differ from those written")
        got["floors"] = (dev.remote_rto_min_us(rid), server.stats().rto_min_us)
        dev.flush()
        return got
    finally:
        for timer in blackouts:
            timer.join()
        dev.close()
        server.stop()
        store.close()


def run(args: argparse.Namespace) -> list[dict]:
    tb = Testbed(2, link=args.link, prefix=args.prefix)
    cleanup(tb.prefix)
    arms = {"kernel": 0, "links": args.rto_min_us}
    got = {(arm, d): {"plain": [], "blackout": []} for arm in arms for d in ("read", "write")}
    floors: dict[str, tuple] = {}
    with tb, tempfile.TemporaryDirectory(prefix="isw-tail-") as workdir:
        for _ in range(args.trials):
            for arm, floor in arms.items():
                result = trial(tb, floor, args, workdir)
                floors[arm] = result.pop("floors")
                for direction, (plain, through) in result.items():
                    got[(arm, direction)]["plain"].append(plain)
                    got[(arm, direction)]["blackout"].append(through)
    rows = []
    for (arm, direction), g in got.items():
        plain, dark = statistics.median(g["plain"]), statistics.median(g["blackout"])
        rows.append({"benchmark": "infiniswap_tail_loss", "arm": arm, "direction": direction,
                     "rto_min_us_asked": arms[arm], "rto_min_us_taken_device": floors[arm][0],
                     "rto_min_us_taken_server": floors[arm][1], "link": args.link, "size": args.size,
                     "connections": args.connections, "blackout_ms": args.blackout, "at_ms": args.at,
                     "trials": args.trials, "plain_ms": round(1e3 * plain, 2),
                     "blackout_io_ms": round(1e3 * dark, 2), "extra_ms": round(1e3 * (dark - plain), 2),
                     "extra_ms_per_trial": [round(1e3 * (d - p), 2) for p, d in zip(g["plain"], g["blackout"])],
                     "kernel": os.uname().release})
    return rows


def report_line(r: dict) -> str:
    floor = f"{r['rto_min_us_taken_device']} us" if r["rto_min_us_taken_device"] else "the kernel's"
    return (f"{r['arm']:>7} {r['direction']:>5}: floor {floor}; {r['size'] >> 20} MiB in {r['plain_ms']} ms, "
            f"with a {r['blackout_ms']:.0f} ms blackout {r['blackout_io_ms']} ms (+{r['extra_ms']} ms; per "
            f"trial {r['extra_ms_per_trial']})")


def main(argv: list[str] | None = None) -> int:
    p = tail_loss_bench.parser(__doc__.splitlines()[0], "ist", "the span read and written, whole 4 MiB slabs "
                               "(default 32M)", "ms into the I/O (default 10)", "s between I/Os on the connections")
    p.add_argument("--connections", type=int, default=4, help="the device's connections to the daemon")
    args = p.parse_args(argv)
    if args.size < SLAB or args.size % (1 << 20):
        p.error(f"--size must be whole MiB, at least {SLAB >> 20} MiB")
    return tail_loss_bench.run_and_report(args, run, report_line)


if __name__ == "__main__":
    sys.exit(main())
