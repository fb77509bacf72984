"""What a lost tail costs an AutoPS TCP data link, with and without its retransmission-timeout
floor lowered (``autops/transport/tcpopts.py``), between two emulated hosts (root).

    python bench/autops_tail_loss.py --json bench/results/autops_tail_loss.json

One host sends a message (``--size``) to a stream listener on the other, over a link shaped
to ``--link``. In each trial the same connection carries the message twice: once as it is,
and once with a blackout of the receiver's download (its link's queue dropping every packet
for ``--blackout`` ms, starting ``--at`` ms after the send) that loses every segment in
flight and the probes after them, so only the sender's retransmission timer can resume the
transfer. Arms, alternated trial by trial: the kernel's floor (``AUTOPS_TCP_RTO_MIN_US=0``,
200 ms) and the links' own (``--rto-min-us``, default the transport's). Per arm: the floor
taken, the message's time without and with the blackout (medians), the difference, and the
sender's retransmissions and timer value (``TCP_INFO``).
"""
from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import struct
import sys
import time

import numpy as np

from autops.transport import tcpopts
from autops.transport.stream import StreamChannel, StreamListener
from dlrt_bench.testbed import Testbed, cleanup
from dlrt_bench import tail_loss_bench
from dlrt_bench.autops_migrate import in_netns

_TCP_INFO = struct.Struct("8B24I")     # struct tcp_info's head: 8 bytes, then u32s from tcpi_rto on


def tcp_info(sock: socket.socket) -> dict:
    """The sender's timer (us) and retransmissions so far."""
    fields = _TCP_INFO.unpack(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size))
    return {"rto_us": fields[8], "total_retrans": fields[8 + 23]}


def connected(channel: StreamChannel) -> StreamChannel:
    """``channel`` with its connection made (from the calling thread's namespace)."""
    channel.open()
    if channel.link is None:
        raise ConnectionError(f"cannot connect to {channel}")
    return channel


def transfer(channel: StreamChannel, listener: StreamListener, payload: np.ndarray, timeout: float,
             at: float | None = None, blackout=None) -> float:
    """Seconds from the send until the listener has the message whole; ``blackout(start)``
    is called ``at`` seconds after the send."""
    start = time.monotonic()
    channel.send(b"m", [payload])
    fired = blackout is None
    while True:
        got = listener.recv()
        if got is not None:
            took = time.monotonic() - start
            assert got.payloads[0].nbytes == payload.nbytes
            return took
        channel.recv()
        now = time.monotonic()
        if not fired and now - start >= at:
            fired = True
            blackout()
        if now - start > timeout:
            raise TimeoutError(f"message not through in {timeout} s")
        select.select([listener.pollable, channel.pollable], [], [], 0.001)


def settle(channel: StreamChannel, listener: StreamListener, seconds: float) -> None:
    """Serve both ends for ``seconds`` (DONE records, nothing else)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert listener.recv() is None and channel.recv() is None
        select.select([listener.pollable, channel.pollable], [], [], 0.005)


def run(args: argparse.Namespace) -> list[dict]:
    tb = Testbed(2, link=args.link, prefix=args.prefix)
    cleanup(tb.prefix)
    payload = np.ones(args.size, np.uint8)
    arms = {"kernel": 0, "links": args.rto_min_us}
    got: dict[str, dict] = {name: {"plain": [], "blackout": [], "rto_us": [], "retrans": [], "taken": None}
                            for name in arms}
    sender, receiver = tb.hosts
    with tb:
        def blackout() -> None:
            tb.blackout(receiver, args.blackout / 1e3)     # the receiver's download

        for trial in range(args.trials):
            for name, floor in arms.items():
                os.environ[tcpopts.RTO_MIN_ENV] = str(floor)
                listener = in_netns(receiver.netns, lambda: StreamListener(f"tcp://{receiver.addr}:0"))
                channel = in_netns(sender.netns, lambda: connected(StreamChannel(listener.address)))
                try:
                    transfer(channel, listener, payload, args.timeout)               # connect, grow the window
                    got[name]["taken"] = channel.link.rto_min_us
                    settle(channel, listener, args.idle)
                    got[name]["plain"].append(transfer(channel, listener, payload, args.timeout))
                    settle(channel, listener, args.idle)
                    before = tcp_info(channel.link.sock)["total_retrans"]
                    got[name]["blackout"].append(transfer(channel, listener, payload, args.timeout,
                                                          args.at / 1e3, blackout))
                    info = tcp_info(channel.link.sock)
                    got[name]["rto_us"].append(info["rto_us"])
                    got[name]["retrans"].append(info["total_retrans"] - before)
                    settle(channel, listener, args.blackout / 1e3 + 0.05)            # the shaping is back
                finally:
                    channel.close()
                    listener.close()
    os.environ.pop(tcpopts.RTO_MIN_ENV, None)
    rows = []
    for name, g in got.items():
        plain, dark = statistics.median(g["plain"]), statistics.median(g["blackout"])
        rows.append({"benchmark": "tail_loss", "arm": name, "rto_min_us_asked": arms[name],
                     "rto_min_us_taken": g["taken"], "link": args.link, "size": args.size,
                     "blackout_ms": args.blackout, "at_ms": args.at, "trials": args.trials,
                     "plain_ms": round(1e3 * plain, 2), "blackout_transfer_ms": round(1e3 * dark, 2),
                     "extra_ms": round(1e3 * (dark - plain), 2),
                     "extra_ms_per_trial": [round(1e3 * (d - p), 2) for p, d in zip(g["plain"], g["blackout"])],
                     "sender_rto_us_median": statistics.median(g["rto_us"]),
                     "retransmitted_segments_median": statistics.median(g["retrans"]),
                     "kernel": os.uname().release})
    return rows


def report_line(r: dict) -> str:
    floor = f"{r['rto_min_us_taken']} us" if r["rto_min_us_taken"] else "the kernel's"
    return (f"{r['arm']:>7}: floor {floor}; {r['size'] >> 20} MiB in {r['plain_ms']} ms, with a "
            f"{r['blackout_ms']:.0f} ms blackout {r['blackout_transfer_ms']} ms (+{r['extra_ms']} ms; per trial "
            f"{r['extra_ms_per_trial']}); sender's timer {r['sender_rto_us_median']} us, "
            f"{r['retransmitted_segments_median']} segments sent again")


def main(argv: list[str] | None = None) -> int:
    p = tail_loss_bench.parser(__doc__.splitlines()[0], "apt", "the message (default 32M)",
                               "ms after the send (default 10)", "s between messages on a connection")
    p.add_argument("--timeout", type=float, default=10.0)
    return tail_loss_bench.run_and_report(p.parse_args(argv), run, report_line)


if __name__ == "__main__":
    sys.exit(main())
