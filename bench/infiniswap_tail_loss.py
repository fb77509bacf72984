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
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid

from dlrt import cli, tcpopts
from dlrt.testbed import Testbed, available, cleanup
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="10gbit")
    p.add_argument("--size", type=cli.size, default="32M", metavar="SIZE",
                   help="the span read and written, whole 4 MiB slabs (default 32M)")
    p.add_argument("--connections", type=int, default=4, help="the device's connections to the daemon")
    p.add_argument("--blackout", type=float, default=30.0, metavar="MS", help="ms of dropped packets (default 30)")
    p.add_argument("--at", type=float, default=10.0, metavar="MS", help="ms into the I/O (default 10)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--idle", type=float, default=0.3, help="s between I/Os on the connections")
    p.add_argument("--rto-min-us", type=int, default=tcpopts.RTO_MIN_US, help="the connections' floor asked for")
    p.add_argument("--prefix", default=f"ist{uuid.uuid4().hex[:4]}")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows (-: stdout)")
    args = p.parse_args(argv)
    if args.size < SLAB or args.size % (1 << 20):
        p.error(f"--size must be whole MiB, at least {SLAB >> 20} MiB")
    reason = available()
    if reason:
        print(f"emulated hosts unavailable: {reason}", file=sys.stderr)
        return 2
    rows = run(args)
    for r in rows:
        floor = f"{r['rto_min_us_taken_device']} us" if r["rto_min_us_taken_device"] else "the kernel's"
        print(f"{r['arm']:>7} {r['direction']:>5}: floor {floor}; {r['size'] >> 20} MiB in {r['plain_ms']} ms, "
              f"with a {r['blackout_ms']:.0f} ms blackout {r['blackout_io_ms']} ms (+{r['extra_ms']} ms; per "
              f"trial {r['extra_ms_per_trial']})", file=sys.stderr)
    if args.json:
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            with open(args.json, "w") as fh:
                fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
