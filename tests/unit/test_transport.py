"""The transport interface: which kind reaches a peer, and what each kind carries how."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

from autops.wire import protocol as wire
from autops.transport import PayloadError, Shared, Transport, TransportError
from autops.transport.cma import available as cma_available
from autops.transport.shm import SegmentReserve, SharedMemory, available as shm_available
from autops.transport.shm_channel import ShmFraming
from dlrt.hostid import host_id

needs_shm = pytest.mark.skipif(not shm_available(), reason="memfd_create or /proc/self/fd missing")


@pytest.fixture
def server(ctx):
    transport = Transport(ctx, "auto")
    peer = {"endpoints": transport.listen("127.0.0.1", 0, "127.0.0.1"), "host": host_id()}
    yield transport, peer
    transport.close()


def wait_recv(source, timeout: float = 5.0):
    """The next message at a channel or listener (polled, so no fixed sleep decides anything)."""
    poller = zmq.Poller()
    poller.register(source.pollable, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inbound = source.recv()
        if inbound is not None:
            return inbound
        poller.poll(100)
    raise AssertionError("nothing arrived")


def listener_of(transport: Transport, kind: str):
    return next(listener for listener in transport.listeners if listener.kind == kind)


def as_bytes(buf) -> bytes:
    return bytes(wire.payload_view(buf))


@needs_shm
def test_a_segment_reserve_hands_whole_populated_pieces_to_one_scope_each():
    piece = 1 << 20
    reserve = SegmentReserve(piece=piece)
    try:
        assert reserve.fill(3 * piece + piece // 2) == 3 * piece and reserve.held == 3 * piece   # whole pieces
        assert reserve.fill(3 * piece) == 0                                                      # already there
        # 256 KiB arrays: four to a piece; the 2 MiB one fits none and is left out
        sizes = [(65536, "float32")] * 5 + [(524288, "float32")] + [(65536, "float32")] * 2
        taken = reserve.take(sizes, "job-a")
        assert [indices for _, indices in taken] == [[0, 1, 2, 3], [4, 6, 7]]
        assert all(seg.scope == "job-a" for seg, _ in taken) and reserve.drawn.is_set()
        assert reserve.held == piece
        rest = reserve.take([(65536, "float32")] * 9, "job-b")      # one piece left: four arrays
        assert [indices for _, indices in rest] == [[0, 1, 2, 3]] and reserve.held == 0
        assert reserve.take([(16, "float32")], "job-c") == []
        for seg, _ in taken + rest:
            seg.close()
    finally:
        reserve.close()


@needs_shm
def test_shared_memory_takes_arrays_from_its_reserve_and_creates_the_rest():
    memory = SharedMemory()
    piece = memory.reserve.piece
    try:
        memory.reserve.fill(piece)
        numel = piece // 4 // 3 - 64                  # three float32 arrays to a piece, aligned
        sizes = [(numel, "float32"), (numel, "float32"), (numel, "float32"), (numel, "float32"), (10, "int64")]
        bufs = memory.allocate(sizes, "job")
        assert [b.array.size for b in bufs] == [numel] * 4 + [10]
        assert [str(b.array.dtype) for b in bufs] == ["float32"] * 4 + ["int64"]
        reserved = {b.ref[1] for b in bufs[:3]}
        assert len(reserved) == 1 and bufs[3].ref[1] not in reserved and bufs[4].ref[1] == bufs[3].ref[1]
        assert all(b.ref[0] == "job" for b in bufs)                  # the pieces now carry the job's scope
        assert all(not b.array.any() for b in bufs)                  # zero, as a new segment
        for i, b in enumerate(bufs):
            b.array[:] = i + 1
        assert [int(b.array[0]) for b in bufs] == [1, 2, 3, 4, 5]    # no two arrays overlap
        assert [int(b.array[-1]) for b in bufs] == [1, 2, 3, 4, 5]
        assert len(memory.handles_of(bufs)) == 2
        del bufs
        memory.release("job")
        assert memory.reserve.held == 0                              # a piece is never handed back
    finally:
        memory.close()


@pytest.mark.parametrize("preference, host, offered, kind", [
    ("auto", "here", ("tcp", "ipc", "shm"), "shm"),
    ("auto", "here", ("tcp", "ipc"), "ipc"),
    ("auto", "elsewhere", ("tcp", "ipc", "shm"), "tcp"),
    ("auto", "elsewhere", ("tcp", "stream", "ipc", "shm"), "stream"),
    ("ipc", "here", ("tcp", "ipc", "shm"), "ipc"),
    ("tcp", "here", ("tcp", "ipc", "shm"), "tcp"),
    ("tcp", "here", ("tcp", "stream", "ipc", "shm"), "stream"),
    ("shm", "here", ("tcp", "ipc", "shm"), "shm"),
])
def test_the_kind_follows_host_and_preference(ctx, preference, host, offered, kind):
    if kind == "shm" and not shm_available():
        pytest.skip("no shared memory here")
    transport = Transport(ctx, preference)
    peer = {"endpoints": {k: f"{k}://x" for k in offered}, "host": host_id() if host == "here" else host}
    try:
        assert transport.kind_for(peer) == kind
        assert transport.lends_to(peer) == (kind == "shm")
    finally:
        transport.close()


def test_with_curve_tcp_stays_on_zeromq_and_no_stream_endpoint_is_offered(ctx, tmp_path, monkeypatch):
    """The stream endpoint is plaintext: with the cluster's CURVE keys a service offers only
    ZeroMQ's tcp, and a client reaches a peer over it even where the peer offers a stream."""
    from dlrt.curve import Security
    from dlrt.keys import Keys, init_keys

    security = Security(Keys.load(init_keys(tmp_path / "keys")))
    assert security.curve
    monkeypatch.setenv("AUTOPS_TCP_STREAM", "1")
    transport = Transport(ctx, "auto", local=False, security=security)
    try:
        endpoints = transport.listen("127.0.0.1", 0, "127.0.0.1")
        assert set(endpoints) == {"tcp"}
        assert transport.kind_for({"endpoints": {"tcp": "tcp://x:1", "stream": "tcp://x:2"}, "host": "h"}) == "tcp"
    finally:
        transport.close()


def test_the_stream_endpoint_listens_on_the_next_port_and_says_so_when_it_is_taken(ctx):
    import socket

    for _ in range(20):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] - 1
        transport = Transport(ctx, "auto", local=False)
        try:
            with pytest.raises(TransportError, match="AUTOPS_TCP_STREAM=0"):
                transport.listen("127.0.0.1", port, "127.0.0.1")
        except zmq.ZMQError:
            continue                         # the port below was not free either: another pair
        finally:
            transport.close()
            taken.close()
        break
    else:
        pytest.fail("no free port with a taken one above it")
    for _ in range(20):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        transport = Transport(ctx, "auto", local=False)
        try:
            endpoints = transport.listen("127.0.0.1", port, "127.0.0.1")
        except (zmq.ZMQError, TransportError):
            continue                         # that port or the next was not free: another
        finally:
            transport.close()
        assert endpoints == {"tcp": f"tcp://127.0.0.1:{port}", "stream": f"tcp://127.0.0.1:{port + 1}"}
        break
    else:
        pytest.fail("no free pair of ports")


@pytest.mark.parametrize("preference, text", [("shm", "transport shm asked for"), ("ipc", "another host"),
                                              ("cma", "another host")])
def test_same_host_kinds_refuse_a_peer_elsewhere(ctx, preference, text):
    if preference == "cma" and cma_available() is not None:
        pytest.skip(f"cma unavailable: {cma_available()}")
    transport = Transport(ctx, preference)
    try:
        with pytest.raises(TransportError, match=text):
            transport.kind_for({"endpoints": {"tcp": "tcp://x:1", "ipc": "ipc://x", "shm": "ipc://y",
                                              "cma": "cma://x:1"}, "host": "elsewhere"})
    finally:
        transport.close()


def test_unknown_preference_is_refused(ctx):
    with pytest.raises(TransportError, match="unknown transport 'carrier-pigeon'"):
        Transport(ctx, "carrier-pigeon")


@pytest.mark.parametrize("preference, zmq_tcp, endpoint", [("tcp", False, "stream"), ("tcp", True, "tcp"),
                                                           ("ipc", False, "ipc")])
def test_socket_kinds_carry_every_payload_by_value_both_ways(ctx, server, monkeypatch, preference, zmq_tcp,
                                                             endpoint):
    agg, peer = server
    assert peer["endpoints"]["stream"].startswith("tcp://127.0.0.1:")    # offered next to ZeroMQ's, CURVE off
    monkeypatch.setenv("AUTOPS_TCP_STREAM", "0" if zmq_tcp else "1")
    client = Transport(ctx, preference)
    try:
        channel = client.connect(peer)
        assert channel.kind == preference and not channel.lends
        assert channel.address == peer["endpoints"][endpoint]
        assert client.connect(peer) is channel                      # one channel per address
        shared = client.memory.allocate([(4, "float64")], "job")[0]
        shared.array[:] = 2.5
        plain = np.arange(10, dtype=np.float32)
        channel.send(b"head", [plain, shared])
        inbound = wait_recv(listener_of(agg, endpoint))
        assert as_bytes(inbound.header) == b"head" and inbound.lent == frozenset()
        assert as_bytes(inbound.payloads[0]) == plain.tobytes()
        assert as_bytes(inbound.payloads[1]) == shared.array.tobytes()
        inbound.reply.send(b"back", [plain[:3]])
        answer = wait_recv(channel)
        assert as_bytes(answer.header) == b"back" and as_bytes(answer.payloads[0]) == plain[:3].tobytes()
    finally:
        client.close()


@needs_shm
def test_shm_lends_shared_buffers_and_sends_the_rest_as_frames(ctx, server):
    agg, peer = server
    client = Transport(ctx, "auto")
    try:
        channel = client.connect(peer)
        assert channel.kind == "shm" and channel.lends
        shared = client.memory.allocate([(8, "float32")], "job-a")[0]
        shared.array[:] = 1.0
        plain = np.arange(5, dtype=np.int64)
        channel.send(b"head", [plain, shared])
        inbound = wait_recv(listener_of(agg, "shm"))
        assert inbound.lent == frozenset({1})
        assert as_bytes(inbound.payloads[0]) == plain.tobytes()
        seen = np.frombuffer(inbound.payloads[1], np.float32)
        shared.array[:] = 7.0                          # by reference: the receiver sees the sender's memory
        np.testing.assert_array_equal(seen, 7.0)
        # published memory of the receiver goes back by reference too
        published = agg.memory.allocate([(3, "float32")], "job-a")[0]
        published.array[:] = 4.0
        inbound.reply.send(b"back", [published])
        answer = wait_recv(channel)
        assert answer.lent == frozenset({0})
        np.testing.assert_array_equal(np.frombuffer(answer.payloads[0], np.float32), 4.0)
        # what the receiver mapped for a scope goes with it
        assert [h[0] for h in agg.memory.mapped_handles("job-a")] == ["job-a"]
        del seen, inbound
        agg.memory.release("job-a")
        assert agg.memory.mapped_handles("job-a") == []
    finally:
        client.close()


@needs_shm
def test_a_reference_that_cannot_be_mapped_becomes_a_payload_error(ctx, server):
    agg, peer = server
    client = Transport(ctx, "shm")
    try:
        bogus = Shared(np.zeros(4, np.float32), ["job", "no-such-segment", os.getpid(), 1 << 20, 64, 0])
        client.connect(peer).send(wire.header(wire.PULL_REPLY, items=[]), [bogus])
        inbound = wait_recv(listener_of(agg, "shm"))
        assert isinstance(inbound.payloads[0], PayloadError)
        msg = wire.parse(inbound.header, inbound.payloads, inbound.lent)
        with pytest.raises(wire.ProtocolError, match="cannot map shared memory"):
            msg.view(0)
    finally:
        client.close()


@needs_shm
def test_premap_maps_a_peers_regions_ahead_of_use(ctx, server):
    agg, _ = server
    client = Transport(ctx, "auto")
    try:
        buffers = client.memory.allocate([(16, "float32"), (4, "int64")], "job-b")
        handles = client.memory.handles_of(buffers)
        assert len(handles) == 1                      # one region holds both
        agg.memory.premap(handles)
        deadline = time.monotonic() + 10
        while not agg.memory.mapped_handles("job-b") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agg.memory.mapped_handles("job-b") == handles
    finally:
        client.close()


def test_without_lent_payloads_shm_frames_are_plain_frames():
    framing = ShmFraming(memory=None)
    head = wire.header(wire.OK, req=1)
    assert framing.pack(head, [b"data"]) == [head, b"data"]
    assert framing.unpack([head, b"data"]) == (head, [b"data"], frozenset())
    # a header that starts like a descriptor gets an empty one in front, and comes back intact
    odd = b"\x92\x01\x02"
    packed = framing.pack(odd, [b"data"])
    assert packed[0] != odd and framing.unpack(packed) == (odd, [b"data"], frozenset())


def test_a_malformed_descriptor_fails_the_payloads_not_the_receiver():
    header, payloads, lent = ShmFraming(memory=None).unpack([b"\x91\x05" + b"head", b"data"])
    assert header == b"head" and lent == frozenset()
    assert payloads and all(isinstance(p, PayloadError) for p in payloads)


def test_tcp_lanes_spread_messages_over_connections_and_replies_come_back(ctx, server, monkeypatch):
    monkeypatch.setenv("AUTOPS_TCP_LANES", "3")
    monkeypatch.setenv("AUTOPS_TCP_STREAM", "0")          # lanes are ZeroMQ's tcp
    agg, peer = server
    client = Transport(ctx, "tcp")
    try:
        channel = client.connect(peer)
        assert len(channel.pollables) == 3
        for i in range(6):
            channel.send(b"m%d" % i, [np.full(4, i, np.int32)])
        senders = []
        for _ in range(6):
            inbound = wait_recv(listener_of(agg, "tcp"))
            senders.append(inbound.reply.identity)
            inbound.reply.send(b"re-" + as_bytes(inbound.header))
        assert sorted(senders.count(s) for s in set(senders)) == [2, 2, 2]   # round-robin over 3 connections
        answers = sorted(as_bytes(wait_recv(channel).header) for _ in range(6))
        assert answers == sorted(b"re-m%d" % i for i in range(6))          # each back on its own connection
    finally:
        client.close()
