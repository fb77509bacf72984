"""The retransmission-timeout floor of AutoPS's TCP data connections
(``autops/transport/tcpopts.py``): the setting, and what the kernel takes of it."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import zmq

from autops.config import rto_min_us
from autops.transport import TransportError, tcpopts
from autops.transport.links import Transport
from autops.transport.stream import SPLICE_MIN, StreamChannel, StreamListener
from dlrt.tcpopts import unsupported


def test_the_floor_comes_from_the_environment_within_the_kernels_range(monkeypatch):
    monkeypatch.delenv(tcpopts.RTO_MIN_ENV, raising=False)
    assert rto_min_us() == tcpopts.RTO_MIN_US == 10_000
    monkeypatch.setenv(tcpopts.RTO_MIN_ENV, "0")
    assert rto_min_us() == 0
    monkeypatch.setenv(tcpopts.RTO_MIN_ENV, " 200000 ")
    assert rto_min_us() == tcpopts.KERNEL_RTO_MIN_US
    for bad in ("200001", "-1", "5ms", "1e4"):
        monkeypatch.setenv(tcpopts.RTO_MIN_ENV, bad)
        with pytest.raises(ValueError, match=tcpopts.RTO_MIN_ENV):
            rto_min_us()
        assert rto_min_us(strict=False) == tcpopts.RTO_MIN_US


def test_a_transport_refuses_a_bad_floor_when_it_starts(monkeypatch):
    monkeypatch.setenv(tcpopts.RTO_MIN_ENV, "fast")
    ctx = zmq.Context()
    try:
        with pytest.raises(TransportError, match=tcpopts.RTO_MIN_ENV):
            Transport(ctx, "tcp", local=False)
    finally:
        ctx.term()


class FakeSocket:
    """Takes the option at or above ``least`` (the kernel's two clock ticks), in ticks of ``tick``."""

    def __init__(self, least: int, tick: int, errno_below: int = 22) -> None:
        self.least, self.tick, self.errno_below = least, tick, errno_below
        self.asked: list[int] = []
        self.value: int | None = None

    def setsockopt(self, level: int, name: int, value: int) -> None:
        assert (level, name) == (socket.IPPROTO_TCP, tcpopts.TCP_RTO_MIN_US)
        self.asked.append(value)
        if value < self.least or value > tcpopts.KERNEL_RTO_MIN_US:
            raise OSError(self.errno_below, "refused")
        self.value = -(-value // self.tick) * self.tick

    def getsockopt(self, level: int, name: int) -> int:
        return self.value


def test_a_floor_below_the_kernels_clock_is_raised_to_the_least_it_takes():
    hz100 = FakeSocket(least=20_000, tick=10_000)             # HZ=100: two ticks are 20 ms
    assert tcpopts.set_rto_min(hz100, 5_000) == 20_000 and hz100.asked == [5_000, 10_000, 20_000]
    hz250 = FakeSocket(least=8_000, tick=4_000)
    assert tcpopts.set_rto_min(hz250, 10_000) == 12_000 and hz250.asked == [10_000]
    assert tcpopts.set_rto_min(hz250, 0) is None and hz250.asked == [10_000]      # 0: the kernel's own
    old = FakeSocket(least=0, tick=1, errno_below=92)         # ENOPROTOOPT: a kernel before 6.15
    old.least = tcpopts.KERNEL_RTO_MIN_US + 1
    assert tcpopts.set_rto_min(old, 10_000) is None and old.asked == [10_000]


def test_both_ends_of_a_tcp_link_lower_their_floor_and_zero_leaves_the_kernels(monkeypatch):
    reason = unsupported()
    if reason:
        pytest.skip(reason)
    for setting, floors in (("10000", None), ("0", (None, tcpopts.KERNEL_RTO_MIN_US))):
        monkeypatch.setenv(tcpopts.RTO_MIN_ENV, setting)
        listener = StreamListener("tcp://127.0.0.1:0")
        channel = StreamChannel(listener.address)
        try:
            channel.send(b"hello", [np.arange(SPLICE_MIN, dtype=np.uint8)])
            deadline = time.monotonic() + 10
            while (got := listener.recv()) is None:
                assert channel.recv() is None and time.monotonic() < deadline
                time.sleep(0.005)
            assert got.header == b"hello"
            links = [channel.link, *listener.links.values()]
            assert len(links) == 2
            for link in links:
                taken = link.sock.getsockopt(socket.IPPROTO_TCP, tcpopts.TCP_RTO_MIN_US)
                if floors is None:         # 10 ms, or the kernel's least above it (whole ticks)
                    assert 10_000 <= link.rto_min_us == taken < 20_000
                else:
                    assert (link.rto_min_us, taken) == floors
        finally:
            channel.close()
            listener.close()
