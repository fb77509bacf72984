"""The rdma transport end to end on loopback, its queue pairs on a fake fabric: what a
``Transport("rdma")`` offers and picks, every kind of payload both ways (inline, lent,
registered on the fly, staged), ``DONE`` releasing what the sender kept, broken
connections, a peer's garbage; and device discovery -- here there is no RDMA device, so
``rdma`` fails at once with the message the CLIs print."""
from __future__ import annotations

import socket
import sys
import time

import numpy as np
import pytest
import zmq

from autops.transport import PayloadError, Transport, TransportError
from autops.transport.rdma import parse_address
from autops.transport.rdma_layout import INLINE_MAX
from autops.transport.rdma_verbs import NO_DEVICE, RdmaUnavailable, device_names, require_device
from dlrt.hostid import host_id
from rdma_fake import FakeFabric, FakeVerbs


def _device_here() -> bool:
    try:
        return bool(device_names())
    except RdmaUnavailable:
        return False


no_device_here = pytest.mark.skipif(_device_here(), reason="an RDMA device is present: the no-device path cannot run")
needs_device = pytest.mark.skipif(not _device_here(), reason="no RDMA device (ibv_get_device_list returned none)")


@pytest.fixture
def fabric():
    return FakeFabric()


@pytest.fixture
def server(ctx, fabric):
    verbs = FakeVerbs(fabric, "server0")
    transport = Transport(ctx, "rdma", verbs=verbs)
    peer = {"endpoints": transport.listen("127.0.0.1", 0, "127.0.0.1"), "host": "elsewhere"}
    yield transport, peer, verbs
    transport.close()


@pytest.fixture
def client(ctx, fabric):
    verbs = FakeVerbs(fabric, "client0")
    transport = Transport(ctx, "rdma", verbs=verbs)
    yield transport, verbs
    transport.close()


def wait_recv(source, *others, timeout: float = 5.0):
    """The next message at a channel or listener, polled on its pollable as the services
    do; ``others`` (the peer's side, in this one thread) are served meanwhile and must have
    no message of their own."""
    poller = zmq.Poller()
    for s in (source, *others):
        poller.register(s.pollable, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inbound = source.recv()
        if inbound is not None:
            return inbound
        for other in others:
            assert other.recv() is None
        poller.poll(100)
    raise AssertionError("nothing arrived")


def settle(*sources, rounds: int = 20) -> None:
    """Let queued records (DONE) be read: poll each source until it reports nothing."""
    poller = zmq.Poller()
    for source in sources:
        poller.register(source.pollable, zmq.POLLIN)
    for _ in range(rounds):
        for source in sources:
            assert source.recv() is None
        if not poller.poll(20):
            return


def listener_of(transport: Transport):
    return next(listener for listener in transport.listeners if listener.kind == "rdma")


# --- discovery --------------------------------------------------------------------------

def test_no_device_is_a_runtime_error_that_says_what_to_do():
    with pytest.raises(RdmaUnavailable) as caught:
        require_device(list_devices=lambda: [])
    assert str(caught.value) == NO_DEVICE == ("no RDMA device found (ibv_get_device_list returned none): "
                                              "use --transport tcp")
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, TransportError)


def test_a_named_device_must_exist(monkeypatch):
    class Dev:
        def __init__(self, name: bytes) -> None:
            self.name = name
    devices = lambda: [Dev(b"mlx5_0"), Dev(b"mlx5_1")]   # noqa: E731
    assert require_device(list_devices=devices) == "mlx5_0"
    assert require_device("mlx5_1", list_devices=devices) == "mlx5_1"
    monkeypatch.setenv("AUTOPS_RDMA_DEVICE", "mlx5_1")
    assert require_device(list_devices=devices) == "mlx5_1"
    with pytest.raises(RdmaUnavailable, match="'rxe0' not found .found: mlx5_0, mlx5_1"):
        require_device("rxe0", list_devices=devices)


def test_without_pyverbs_the_message_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)         # import pyverbs -> ImportError
    with pytest.raises(RdmaUnavailable, match="install python3-pyverbs and run `make setup`"):
        require_device()


@no_device_here
def test_transport_rdma_fails_at_once_without_a_device(ctx):
    try:
        device_names()
    except RdmaUnavailable as exc:           # no pyverbs: that message instead
        print(f"pyverbs not importable: {exc}")
    with pytest.raises(RdmaUnavailable, match="no RDMA device found|pyverbs"):
        Transport(ctx, "rdma")


# --- choosing and offering the kind ------------------------------------------------------

def test_rdma_listens_next_to_tcp_and_is_forced_for_every_peer(server, client):
    transport, peer, _ = server
    endpoints = peer["endpoints"]
    assert endpoints["rdma"].startswith("rdma://127.0.0.1:") and "tcp" in endpoints
    assert "shm" not in endpoints                                # its memory is registered, not shared
    assert parse_address(endpoints["rdma"]) == ("127.0.0.1", int(endpoints["rdma"].rsplit(":", 1)[1]))
    mine, _ = client
    assert mine.kind_for(peer) == "rdma"
    assert mine.kind_for({**peer, "host": host_id()}) == "rdma"
    with pytest.raises(TransportError, match="offers no rdma endpoint"):
        mine.kind_for({"endpoints": {"tcp": "tcp://x:1"}, "host": "elsewhere"})


def test_auto_never_picks_rdma(ctx, server):
    _, peer, _ = server
    plain = Transport(ctx, "auto")
    try:
        assert plain.kind_for(peer) == "stream"          # plain tcp (CURVE off), never rdma
    finally:
        plain.close()


@pytest.mark.parametrize("address", ["tcp://h:1", "rdma://nohost", "rdma://h:notaport"])
def test_bad_rdma_addresses(address):
    with pytest.raises(TransportError):
        parse_address(address)


# --- messages both ways ------------------------------------------------------------------

def test_every_kind_of_payload_arrives_and_replies_come_back(server, client):
    transport, peer, server_verbs = server
    mine, client_verbs = client
    channel = mine.connect(peer)
    assert channel.kind == "rdma" and mine.connect(peer) is channel
    small = np.arange(100, dtype=np.float32)                    # inline
    big = np.arange(300_000, dtype=np.float32)                 # registered on the fly
    lent = mine.memory.allocate([(200_000, "float64")], "job")[0]
    lent.array[:] = np.linspace(0, 1, lent.array.size)
    staged = bytes(range(256)) * 1000                          # bytes: copied to registered memory
    channel.send(b"header-1", [small, big, lent, staged, b""])
    listener = listener_of(transport)
    inbound = wait_recv(listener, channel)
    assert inbound.header == b"header-1" and inbound.lent == frozenset()
    got = [bytes(p) for p in inbound.payloads]
    assert got == [small.tobytes(), big.tobytes(), lent.array.tobytes(), staged, b""]
    assert set(channel.link.kept) == {1}                       # kept alive until DONE
    settle(channel)
    assert channel.link.kept == {}

    reply = transport.memory.allocate([(INLINE_MAX, "uint8")], "job")[0]
    reply.array[:] = 7
    inbound.reply.send(b"reply-1", [reply, np.full(10, 3, np.int16)])
    back = wait_recv(channel, listener)
    assert back.header == b"reply-1" and bytes(back.payloads[0]) == reply.array.tobytes()
    assert bytes(back.payloads[1]) == np.full(10, 3, np.int16).tobytes()
    assert back.reply is channel
    # the registrations: the big array once, the lent arena once, staging and landing blocks
    assert client_verbs.registered and server_verbs.registered
    channel.send(b"again", [big])
    assert bytes(wait_recv(listener, channel).payloads[0]) == big.tobytes()
    assert sum(r.addr == big.__array_interface__["data"][0] for r in client_verbs.registered) == 1


def test_over_cma_the_same_protocol_reads_with_process_vm_readv(ctx):
    """The cma verbs in place of the fake ones: both ends in this process (one pid), every
    READ a real process_vm_readv; the sender keeps what it lent until DONE."""
    from autops.transport.cma import available
    if available() is not None:
        pytest.skip(f"cma unavailable: {available()}")
    server, mine = Transport(ctx, "cma"), Transport(ctx, "cma")
    try:
        endpoints = server.listen("127.0.0.1", 0, "aggregator.example")
        # on loopback whatever the tcp endpoint advertises: its peers are on this host
        assert endpoints["cma"].startswith("cma://127.0.0.1:") and "rdma" not in endpoints
        assert endpoints["tcp"].startswith("tcp://aggregator.example:")
        peer = {"endpoints": endpoints, "host": host_id()}
        assert mine.kind_for(peer) == "cma" and mine.lends_to(peer)
        channel = mine.connect(peer)
        assert channel.kind == "cma"
        big = np.arange(1 << 18, dtype=np.float32)                   # 1 MiB, registered on the fly
        lent = mine.memory.allocate([(1 << 16, "float64")], "job")[0]
        lent.array[:] = 2.5
        raw = bytes(range(256)) * 1000                               # not registrable: READ as it is
        torch = pytest.importorskip("torch")
        grad = torch.arange(100_000, dtype=torch.float32)
        view = grad.numpy()                                          # a torch tensor's memory, likewise

        def no_staging(nbytes):
            raise AssertionError("the sender copied a payload into a staging block")

        mine.memory.landing.take = no_staging
        channel.send(b"head", [big, b"tiny", lent, raw, view])
        listener = next(x for x in server.listeners if x.kind == "cma")
        inbound = wait_recv(listener, channel)
        assert inbound.header == b"head" and inbound.lent == frozenset()
        assert [bytes(p) for p in inbound.payloads] == [big.tobytes(), b"tiny", lent.array.tobytes(), raw,
                                                        view.tobytes()]
        del mine.memory.landing.take
        assert set(channel.link.kept) == {1}
        settle(channel)
        assert channel.link.kept == {}
        inbound.reply.send(b"back", [big[::-1].copy()])
        answer = wait_recv(channel, listener)
        assert answer.header == b"back" and bytes(answer.payloads[0]) == big[::-1].tobytes()
    finally:
        mine.close()
        server.close()


def test_many_messages_in_flight_arrive_in_order(server, client):
    transport, peer, _ = server
    mine, _ = client
    channel = mine.connect(peer)
    payload = np.ones(INLINE_MAX // 8 + 1, np.float64)         # just over inline: READ each time
    for i in range(200):
        channel.send(f"m{i}".encode(), [payload, str(i).encode()])
    listener = listener_of(transport)
    for i in range(200):
        inbound = wait_recv(listener, channel)
        assert inbound.header == f"m{i}".encode() and bytes(inbound.payloads[1]) == str(i).encode()
        assert bytes(inbound.payloads[0]) == payload.tobytes()
    settle(channel, listener)
    assert channel.link.kept == {}


def test_a_failed_read_fills_the_slots_with_payload_errors_and_the_sender_reconnects(server, client):
    transport, peer, server_verbs = server
    mine, _ = client
    channel = mine.connect(peer)
    listener = listener_of(transport)
    channel.send(b"first", [np.zeros(INLINE_MAX + 1, np.uint8)])
    assert wait_recv(listener, channel).header == b"first"
    server_verbs.fail_reads = True
    channel.send(b"second", [np.zeros(INLINE_MAX + 1, np.uint8), b"inline"])
    inbound = wait_recv(listener, channel)
    assert inbound.header == b"second" and isinstance(inbound.payloads[0], PayloadError)
    assert bytes(inbound.payloads[1]) == b"inline"
    settle(listener)
    assert listener.links == {}                                # that connection is gone
    server_verbs.fail_reads = False
    assert channel.recv() is None and channel.link.broken      # the client saw it close
    channel.send(b"third", [np.ones(INLINE_MAX + 1, np.uint8)])    # a fresh connection
    inbound = wait_recv(listener, channel)
    assert inbound.header == b"third" and bytes(inbound.payloads[0]) == np.ones(INLINE_MAX + 1, np.uint8).tobytes()


def test_a_peer_sending_garbage_is_dropped_and_others_are_served(server, client):
    transport, peer, _ = server
    listener = listener_of(transport)
    host, port = parse_address(peer["endpoints"]["rdma"])
    with socket.create_connection((host, port)) as bad:
        bad.sendall(b"\xff" * 64)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert listener.recv() is None
            if not listener.links:
                break
            time.sleep(0.01)
        assert listener.links == {}
    mine, _ = client
    channel = mine.connect(peer)
    channel.send(b"fine", [])
    assert wait_recv(listener, channel).header == b"fine"


def _until_broken(channel, timeout: float = 5.0) -> str:
    poller = zmq.Poller()
    poller.register(channel.pollable, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while channel.link.broken is None and time.monotonic() < deadline:
        assert channel.recv() is None
        poller.poll(100)
    return channel.link.broken


def test_an_unreachable_peer_drops_the_message_without_raising(ctx, fabric):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]                           # nobody listens there
    transport = Transport(ctx, "rdma", verbs=FakeVerbs(fabric))
    try:
        channel = transport.connect({"endpoints": {"rdma": f"rdma://127.0.0.1:{port}"}, "host": "x"})
        channel.send(b"lost", [np.zeros(INLINE_MAX + 1, np.uint8)])     # no exception
        assert "ECONNREFUSED" in _until_broken(channel)
        assert channel.link.held == [] and channel.link.kept == {} and fabric.qps == {}
    finally:
        transport.close()


def test_a_listener_that_never_answers_fails_the_handshake_at_its_deadline(ctx, fabric):
    from autops.transport.rdma import RdmaChannel
    from autops.transport.rdma_memory import RdmaMemory
    with socket.socket() as mute:                              # accepts (backlog), never speaks
        mute.bind(("127.0.0.1", 0))
        mute.listen(1)
        verbs = FakeVerbs(fabric)
        channel = RdmaChannel(verbs, RdmaMemory(verbs), f"rdma://127.0.0.1:{mute.getsockname()[1]}", timeout=0.0)
        try:
            channel.send(b"lost", [])
            assert "no handshake" in _until_broken(channel)
        finally:
            channel.close()


def test_close_releases_registrations_queue_pairs_and_the_device(ctx, fabric):
    verbs_a, verbs_b = FakeVerbs(fabric, "a"), FakeVerbs(fabric, "b")
    a, b = Transport(ctx, "rdma", verbs=verbs_a), Transport(ctx, "rdma", verbs=verbs_b)
    peer = {"endpoints": b.listen("127.0.0.1", 0, "127.0.0.1"), "host": "x"}
    lent = a.memory.allocate([(INLINE_MAX, "float32")], "job")[0]
    channel = a.connect(peer)
    channel.send(b"x", [lent])
    wait_recv(listener_of(b), channel)
    a.close()
    b.close()
    assert fabric.qps == {} and verbs_a.live == [] and verbs_b.live == []
    assert verbs_a.closed and verbs_b.closed


@needs_device
def test_payloads_both_ways_through_a_real_device(ctx):
    """What the fake fabric stands for, on hardware: pyverbs queue pairs on loopback."""
    server = Transport(ctx, "rdma")
    client = Transport(ctx, "rdma")
    try:
        peer = {"endpoints": server.listen("127.0.0.1", 0, "127.0.0.1"), "host": "elsewhere"}
        channel = client.connect(peer)
        listener = listener_of(server)
        big = np.arange(1 << 20, dtype=np.float32)
        channel.send(b"over-rdma", [big, b"small"])
        inbound = wait_recv(listener, channel)
        assert bytes(inbound.payloads[0]) == big.tobytes() and bytes(inbound.payloads[1]) == b"small"
        lent = server.memory.allocate([(1 << 18, "float64")], "job")[0]
        lent.array[:] = 2.5
        inbound.reply.send(b"back", [lent])
        assert bytes(wait_recv(channel, listener).payloads[0]) == lent.array.tobytes()
    finally:
        client.close()
        server.close()
