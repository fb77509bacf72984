"""Stream sockets (``autops/transport/stream.py``): messages over a unix (``ipc``) or a TCP
stream socket (plain ``tcp``), large payloads spliced from the sender's pages, read straight
into the receiver's arrays. Most tests run over both."""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import socket
import struct
import time

import numpy as np
import pytest

from autops.transport import TransportError, stream
from autops.transport.stream import SPLICE_MIN, StreamChannel, StreamListener


@pytest.fixture(params=["ipc", "tcp"])
def pair(request, tmp_path):
    listener = StreamListener(f"ipc://{tmp_path}/agg.sock" if request.param == "ipc" else "tcp://127.0.0.1:0")
    channel = StreamChannel(listener.address)
    assert channel.kind == request.param
    try:
        yield listener, channel
    finally:
        channel.close()
        listener.close()


def wait(target, *others, timeout: float = 10.0):
    """The next message ``target`` receives; ``others`` are served meanwhile (their output
    flushed, the DONE records they get read), as a service's poll loop would."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = target.recv()
        if got is not None:
            return got
        for other in others:
            assert other.recv() is None
        select.select([target.pollable, *(o.pollable for o in others)], [], [], 0.05)
    raise AssertionError("no message within the timeout")


def settle(*ends, rounds: int = 20) -> None:
    for _ in range(rounds):
        for end in ends:
            assert end.recv() is None
        time.sleep(0.005)


def test_spliced_pages_are_taken_as_they_are_from_linux_6_5():
    assert stream.splices_pages("6.18.44-fc-v669") and stream.splices_pages("6.5.0") and stream.splices_pages("7.0")
    assert not stream.splices_pages("6.4.16-generic") and not stream.splices_pages("5.15.0-91-generic")
    assert not stream.splices_pages("weird")


def test_a_message_arrives_whole_and_the_reply_comes_back_on_its_connection(pair):
    listener, channel = pair
    big = np.arange(3 << 20, dtype=np.float32)             # 12 MiB: spliced
    small = np.arange(100, dtype=np.float64)               # copied
    channel.send(b"header", [big, small, b""])
    got = wait(listener, channel)
    assert got.header == b"header" and got.lent == frozenset()
    assert np.array_equal(np.frombuffer(got.payloads[0], np.float32), big)
    assert np.array_equal(np.frombuffer(got.payloads[1], np.float64), small)
    assert len(got.payloads[2]) == 0
    got.reply.send(b"reply", [got.payloads[0]])
    back = wait(channel, listener)
    assert back.header == b"reply" and np.array_equal(np.frombuffer(back.payloads[0], np.float32), big)
    settle(listener, channel)
    # every spliced payload was released by the peer's DONE, on both sides
    assert channel.link.kept == {} and all(link.kept == {} for link in listener.links.values())


def test_a_listener_is_sending_while_a_reply_waits_for_its_reader(pair):
    """What an aggregator's background work asks before each step: replies still queued
    to be sent are the communication phase too."""
    listener, channel = pair
    channel.send(b"pull")
    got = wait(listener, channel)
    assert not listener.sending()
    got.reply.send(b"reply", [np.ones(16 << 20, dtype=np.float32)])   # 64 MiB: more than the sockets hold
    assert listener.sending()
    assert listener.recv() is None and listener.sending()               # the reader has not read yet
    back = wait(channel, listener)
    assert back.header == b"reply" and len(back.payloads[0]) == 64 << 20
    assert not listener.sending()


def test_messages_sent_back_to_back_arrive_in_order_and_intact(pair):
    listener, channel = pair
    rng = np.random.default_rng(7)
    sent = []
    for i in range(24):
        size = int(rng.choice([0, 100, SPLICE_MIN - 1, SPLICE_MIN, 1 << 20, 3 << 20]))
        payload = rng.integers(0, 255, size, dtype=np.uint8)
        sent.append((f"m{i}".encode(), payload))
        channel.send(sent[-1][0], [payload, payload[: size // 3]])
    for header, payload in sent:
        got = wait(listener, channel)
        assert got.header == header
        assert bytes(got.payloads[0]) == payload.tobytes()
        assert bytes(got.payloads[1]) == payload[: len(payload) // 3].tobytes()


def test_a_header_larger_than_the_read_ahead_buffer_arrives(pair):
    listener, channel = pair
    header = os.urandom(stream._READ_AHEAD * 3 + 5)
    channel.send(header, [np.ones(10, np.uint8)])
    channel.send(b"next", [])
    assert wait(listener, channel).header == header
    assert wait(listener, channel).header == b"next"


@pytest.mark.skipif(not stream.SPLICING, reason="unix sockets take spliced pages as they are from Linux 6.5 "
                    f"(this kernel: {platform.release()})")
def test_a_spliced_payload_is_the_senders_pages_until_the_receiver_reads_it(pair):
    """What makes the send zero-copy, and why the sender keeps a payload until DONE: a
    change to the sender's array after ``send`` but before the receiver's read shows up at
    the receiver (a copied send would deliver the old bytes)."""
    listener, channel = pair
    payload = np.zeros(SPLICE_MIN * 2, np.uint8)      # fits the socket's buffer: all of it is sent at once
    channel.send(b"h", [payload])
    assert not channel.link.out, "the payload did not go into the socket at once"
    assert len(channel.link.kept) == 1                 # kept until the receiver's DONE
    payload[:] = 7                                     # the caller breaks the rule: the receiver sees it
    got = wait(listener, channel)
    assert set(bytes(got.payloads[0])) == {7}
    settle(listener, channel)
    assert channel.link.kept == {}


def test_where_vmsplice_is_refused_the_link_sends_by_copy(pair, monkeypatch):
    def refused(fd, iov, count, flags):
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(stream, "_VMSPLICE", refused)
    listener, channel = pair
    payload = np.arange(1 << 20, dtype=np.uint32)
    channel.send(b"a", [payload])
    channel.send(b"b", [payload])
    for header in (b"a", b"b"):
        got = wait(listener, channel)
        assert got.header == header and np.array_equal(np.frombuffer(got.payloads[0], np.uint32), payload)
    assert channel.link.splicing is False


def raw_connection(listener: StreamListener) -> socket.socket:
    if listener.path is None:
        return socket.create_connection(("127.0.0.1", int(listener.address.rsplit(":", 1)[1])), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(listener.path)
    return sock


@pytest.mark.parametrize("garbage", [
    struct.pack("<BxxxIIQ", 9, 0, 0, 0),                        # an unknown record
    struct.pack("<BxxxIIQ", 1, stream.MAX_HEADER + 1, 0, 0),     # a header over the limit
    struct.pack("<BxxxIIQ", 1, 0, 1, 0) + struct.pack("<Q", 1 << 50),   # a payload over the limit
])
def test_a_malformed_record_ends_that_connection_only(pair, garbage):
    listener, channel = pair
    rogue = raw_connection(listener)
    try:
        rogue.sendall(garbage)
        settle(listener)
        assert not listener.links or all(link.broken is None for link in listener.links.values())
        rogue.settimeout(5)
        assert rogue.recv(16) == b""                   # the listener closed it
    finally:
        rogue.close()
    channel.send(b"still served", [np.ones(SPLICE_MIN, np.uint8)])
    assert wait(listener, channel).header == b"still served"


def test_a_peer_gone_mid_message_delivers_nothing_of_it(pair):
    listener, _ = pair
    rogue = raw_connection(listener)
    rogue.sendall(struct.pack("<BxxxIIQ", 1, 1, 1, 0) + struct.pack("<Q", 1000) + b"h" + b"x" * 10)
    rogue.close()
    settle(listener)
    assert listener.recv() is None and not listener.links


def test_a_channel_connects_again_after_its_connection_broke(tmp_path):
    address = f"ipc://{tmp_path}/agg.sock"
    listener = StreamListener(address)
    channel = StreamChannel(address)
    try:
        channel.send(b"one", [])
        assert wait(listener, channel).header == b"one"
        listener.close()                                  # the peer restarts at the same address
        settle(channel)
        assert channel.link.broken is not None
        channel.send(b"lost", [])                         # no listener: dropped (the caller's timeout takes over)
        listener = StreamListener(address)
        channel.send(b"two", [])
        assert wait(listener, channel).header == b"two"
    finally:
        channel.close()
        listener.close()
    assert not os.path.exists(str(tmp_path / "agg.sock"))


def test_open_connects_ahead_and_the_first_send_uses_that_connection(pair):
    listener, channel = pair
    assert channel.link is None
    channel.open()
    link = channel.link
    assert link is not None and link.broken is None
    deadline = time.monotonic() + 10
    while not listener.links and time.monotonic() < deadline:        # accepted before any message
        assert listener.recv() is None
        time.sleep(0.005)
    assert len(listener.links) == 1
    channel.open()                                                     # connected: nothing to do
    channel.send(b"first", [np.arange(SPLICE_MIN, dtype=np.uint8)])
    assert channel.link is link
    got = wait(listener, channel)
    assert got.header == b"first" and len(listener.links) == 1


def test_open_to_a_peer_not_there_yet_does_not_raise_and_send_tries_again(tmp_path):
    address = f"ipc://{tmp_path}/agg.sock"
    channel = StreamChannel(address)
    try:
        channel.open()
        assert channel.link is None
        listener = StreamListener(address)
        try:
            channel.send(b"late", [])
            assert wait(listener, channel).header == b"late"
        finally:
            listener.close()
    finally:
        channel.close()


def test_a_payload_this_process_cannot_hold_ends_that_connection_only(pair, monkeypatch):
    listener, channel = pair

    def no_memory(nbytes):
        if nbytes > 1 << 30:
            raise MemoryError
        return np.empty(nbytes, np.uint8)

    monkeypatch.setattr(stream, "new_array", no_memory)
    rogue = raw_connection(listener)
    try:
        rogue.sendall(struct.pack("<BxxxIIQ", 1, 1, 1, 0) + struct.pack("<Q", 1 << 39) + b"h")
        settle(listener)
        rogue.settimeout(5)
        assert rogue.recv(16) == b""
    finally:
        rogue.close()
    channel.send(b"still served", [np.ones(SPLICE_MIN, np.uint8)])
    assert wait(listener, channel).header == b"still served"


def test_a_tcp_listener_advertises_the_host_it_is_reached_at_and_the_port_it_bound():
    listener = StreamListener("tcp://127.0.0.1:0", advertise_host="localhost")
    try:
        host, port = listener.address[len("tcp://"):].rsplit(":", 1)
        assert listener.kind == "stream" and host == "localhost" and int(port) > 0
        channel = StreamChannel(listener.address)
        try:
            assert channel.kind == "tcp"
            payload = np.arange(SPLICE_MIN, dtype=np.uint8)
            channel.send(b"over tcp", [payload])
            got = wait(listener, channel)
            assert got.header == b"over tcp" and bytes(got.payloads[0]) == payload.tobytes()
            link = next(iter(listener.links.values()))
            assert link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)       # replies go at once
            assert channel.link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            channel.close()
    finally:
        listener.close()


@pytest.mark.parametrize("address", ["udp://h:1", "tcp://nohost", "tcp://h:notaport", "ipc://"])
def test_bad_stream_addresses_are_refused(address):
    with pytest.raises(TransportError):
        StreamChannel(address)


def test_over_tcp_the_reader_wakes_for_a_payloads_rest_not_for_every_piece():
    """SO_RCVLOWAT follows the payload being read: while its rest is awaited the socket is
    not readable for a few bytes more, and after the message it is at the first byte again."""
    import fcntl
    import termios

    listener = StreamListener("tcp://127.0.0.1:0")
    sender = raw_connection(listener)
    size = 4 * stream.RECV_LOWAT
    try:
        sender.sendall(struct.pack("<BxxxIIQ", 1, 1, 1, 0) + struct.pack("<Q", size) + b"h" + b"a" * (size // 2))
        deadline = time.monotonic() + 10
        while not listener.links or next(iter(listener.links.values())).incoming is None \
                or next(iter(listener.links.values())).incoming.got < size // 2:
            assert listener.recv() is None and time.monotonic() < deadline
            select.select([listener.pollable], [], [], 0.05)
        link = next(iter(listener.links.values()))
        assert link.lowat == stream.RECV_LOWAT
        assert link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == stream.RECV_LOWAT
        sender.sendall(b"a" * 1000)
        queued = bytearray(4)
        while int.from_bytes(queued, "little") < 1000:          # arrived, not yet read
            fcntl.ioctl(link.fd, termios.FIONREAD, queued)
            assert time.monotonic() < deadline
        assert select.select([link.fd], [], [], 0)[0] == []      # ... and no wake-up for it
        sender.sendall(b"a" * (size - size // 2 - 1000))
        got = wait(listener)
        assert got.header == b"h" and bytes(got.payloads[0]) == b"a" * size
        assert link.lowat == 1 and link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        sender.close()
        listener.close()


# --- limits on connections nobody vouched for (sockpoll.LinkListener) --------------------

def _closed_by_peer(sock: socket.socket, timeout: float = 0.05) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def test_a_connection_without_a_whole_message_is_closed_at_the_handshake_deadline():
    listener = StreamListener("tcp://127.0.0.1:0", handshake_s=0.3, idle_s=60)
    channel = StreamChannel(listener.address)
    try:
        silent = raw_connection(listener)
        partial = raw_connection(listener)
        partial.sendall(struct.pack("<BxxxIIQ", stream.DATA, 100, 0, 0) + b"x" * 10)   # never finished
        channel.send(b"hello")
        got = wait(listener)
        got.reply.vouch()                       # the service served it: a job's channel
        assert listener.recv() is None and len(listener.links) == 3
        time.sleep(0.4)
        listener.recv()
        assert _closed_by_peer(silent) and _closed_by_peer(partial)
        assert list(listener.links.values())[0].broken is None and len(listener.links) == 1
        assert listener.limit_counts["handshake_timeouts"] == 2
        channel.send(b"still served")
        assert bytes(wait(listener).header) == b"still served"
        silent.close()
        partial.close()
    finally:
        channel.close()
        listener.close()


def test_a_connection_that_never_became_a_jobs_channel_is_closed_when_idle():
    listener = StreamListener("tcp://127.0.0.1:0", handshake_s=30, idle_s=0.3)
    vouched, unvouched = StreamChannel(listener.address), StreamChannel(listener.address)
    try:
        vouched.send(b"a job's request")
        wait(listener).reply.vouch()
        unvouched.send(b"garbage")
        wait(listener)
        time.sleep(0.4)
        listener.housekeep()
        assert len(listener.links) == 1 and listener.limit_counts["idle_timeouts"] == 1
        vouched.send(b"again")
        assert bytes(wait(listener).header) == b"again"
    finally:
        vouched.close()
        unvouched.close()
        listener.close()


def test_at_the_cap_the_oldest_idle_connection_makes_room_and_job_channels_stay():
    listener = StreamListener("tcp://127.0.0.1:0", max_links=3, handshake_s=30, idle_s=60)
    job = StreamChannel(listener.address)
    idle = []
    try:
        job.send(b"a job's request")
        wait(listener).reply.vouch()
        for _ in range(6):
            idle.append(raw_connection(listener))
            listener.recv()
        assert len(listener.links) == 3 and listener.limit_counts["evicted"] == 4
        assert [_closed_by_peer(s) for s in idle] == [True] * 4 + [False] * 2
        job.send(b"served")
        assert bytes(wait(listener).header) == b"served"
        for fd in list(listener.links):
            listener.vouch(listener.links[fd])  # every one a job's channel: a new one is refused
        extra = raw_connection(listener)
        listener.recv()
        assert _closed_by_peer(extra, 1.0) and listener.limit_counts["refused_over_cap"] == 1
        extra.close()
    finally:
        for s in idle:
            s.close()
        job.close()
        listener.close()


def test_out_of_descriptors_the_listener_pauses_accepting_and_logs_once(monkeypatch, caplog):
    from autops.transport import sockpoll
    listener = StreamListener("tcp://127.0.0.1:0")
    real = listener.sock

    class Exhausted:
        def __getattr__(self, name):
            return getattr(real, name)

        def accept(self):
            raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(sockpoll, "ACCEPT_PAUSE_S", 0.2)
    listener.sock = Exhausted()
    waiting = socket.create_connection(real.getsockname()[:2], timeout=2)
    try:
        with caplog.at_level("WARNING", logger="autops.transport"):
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                listener.recv()
                time.sleep(0.01)
        said = [r for r in caplog.records if "cannot accept" in r.getMessage()]
        assert len(said) == 1                       # not once per turn of the loop
        assert 2 <= listener.limit_counts["accept_pauses"] <= 8    # paused, not spinning
        listener.sock = real                        # descriptors free again: accepted
        deadline = time.monotonic() + 2.0
        while not listener.links and time.monotonic() < deadline:
            listener.recv()
            time.sleep(0.05)
        assert len(listener.links) == 1
    finally:
        waiting.close()
        listener.sock = real
        listener.close()
