"""Attackers against a live Infiniswap daemon (docs/infiniswap.md, "Security").

* Data server: a raw TCP client without the key, one with a wrong key, a truncated
  handshake, an answer recorded on an earlier connection and replayed, and a peer that sends
  nothing are each refused before a single slab byte is served; every refusal is counted in
  the daemon's report; a victim device's pages read back unchanged, before and after.
* Control channel: a MAP that does not prove the cluster key is refused and counted; a fake
  daemon that cannot prove it never gets its memory used (the same-host shared memory path
  included).
* CURVE: with a key directory from ``dlrt.keys.init_keys``, the control socket refuses a
  client whose key is not authorized, and serves one whose key is.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
import threading

import pytest
import zmq
import zmq.auth

from dlrt.curve import Security, refusal_counts
from dlrt.hostid import host_id
from dlrt.keys import Keys, ensure_cluster_secret, init_keys
from infiniswap import Daemon, Device
from infiniswap import handshake as hs
from infiniswap import protocol as p
from infiniswap.channel import ask, context
from infiniswap.core import CoreDevice, SlabStore
from infiniswap.local import DaemonProcess
from infiniswap_testlib import wait_until

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
PAGE = 4096
REQ = struct.Struct("<IHHQIQQ")


def pages(tag: int, n: int) -> bytes:
    return b"".join(struct.pack("<II", tag, i) * (PAGE // 8) for i in range(n))


def status(addr: str) -> dict:
    reply = ask(addr, p.STATUS, timeout=5)
    assert reply.op == p.REPORT
    return reply["report"]


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = bytearray()
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


@pytest.fixture
def live_daemon():
    d = DaemonProcess(slab_size=MiB, capacity=8 * MiB, period=0.1, timeout=2.0)
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_data_server_attackers_are_refused_counted_and_harmless(live_daemon, tmp_path):
    host, port = live_daemon.data_address.rsplit(":", 1)
    addr = ("127.0.0.1", int(port))
    with Device(4 * MiB, backup=tmp_path / "victim", daemons=[live_daemon.address],
                slab_size=MiB, transport="tcp", hot_slab=1e12, period=0.2) as victim:
        assert victim.map_now() == 4
        for slab in range(4):
            victim.write(slab * MiB, pages(slab, 8))
        served = status(live_daemon.address)["served"]["requests"]

        # 1. no key: a READ request straight away (padded to an answer's size)
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(REQ.pack(0x50575349, 2, 1, 0, PAGE, 1, 1).ljust(hs.ANSWER.size, b"\0"))
            got = read_all(s)
        assert len(got) == hs.HELLO.size + hs.VERDICT.size          # nothing else: no page
        assert hs.VERDICT.unpack(got[hs.HELLO.size:])[1] == -errno.EPROTO
        # 2. a wrong key, through the real client
        with CoreDevice(MiB, MiB, tmp_path / "attacker") as thief:
            with pytest.raises(OSError, match="refused this device's proof") as e:
                thief.add_remote_tcp(host, int(port), connections=1, key=os.urandom(32))
            assert e.value.errno == errno.EACCES
        # 3. a truncated handshake
        with socket.create_connection(addr, timeout=10) as s:
            nonce_s = hs.parse_hello(hs.recv_exact(s, hs.HELLO.size))
            s.sendall(hs.answer(os.urandom(32), nonce_s, os.urandom(16))[:20])
        # 4. an answer recorded from a legitimate handshake, replayed on a new connection
        with socket.create_connection(addr, timeout=10) as s:
            nonce_s = hs.parse_hello(hs.recv_exact(s, hs.HELLO.size))
            recorded = hs.answer(ensure_cluster_secret(), nonce_s, os.urandom(16))
            s.sendall(recorded)
            assert hs.VERDICT.unpack(hs.recv_exact(s, hs.VERDICT.size))[1] == 0
        with socket.create_connection(addr, timeout=10) as s:
            hs.recv_exact(s, hs.HELLO.size)
            s.sendall(recorded + REQ.pack(0x50575349, 2, 1, 0, PAGE, 1, 1))
            got = read_all(s)
        assert len(got) == hs.VERDICT.size and hs.VERDICT.unpack(got)[1] == -errno.EACCES
        # 5. a peer that sends nothing: closed at the handshake deadline
        with socket.create_connection(addr, timeout=10) as s:
            assert len(read_all(s)) == hs.HELLO.size

        def counted() -> bool:
            auth = status(live_daemon.address)["auth"]
            return auth["data_refusals"] == 5 and auth["data_timeouts"] == 1
        wait_until(counted, 10, "the five refusals in the daemon's report")
        report = status(live_daemon.address)
        assert report["auth_refusals"] >= 5
        assert report["served"]["requests"] == served                # not one request served
        for slab in range(4):                                        # the victim's pages
            assert victim.read(slab * MiB, 8 * PAGE) == pages(slab, 8)
            victim.write(slab * MiB + 8 * PAGE, pages(100 + slab, 2))
            assert victim.read(slab * MiB + 8 * PAGE, 2 * PAGE) == pages(100 + slab, 2)
        assert victim.stats()["slabs_mapped"] == 4
        assert victim.stats()["io"]["remote_errors"] == 0


def test_control_channel_refuses_a_map_without_proof(live_daemon):
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(live_daemon.address)
        for i, extra in enumerate([{}, {"proof": "00" * 32}]):
            sock.send(p.encode(p.MAP, id=i, device_id="intruder", slab=0, **extra))
            assert sock.poll(5000)
            msg = p.decode(sock.recv())
            assert msg.op == p.ERROR and msg["code"] == "unauthenticated"
    finally:
        sock.close(0)
    report = status(live_daemon.address)
    assert report["auth"]["control_refusals"] == 2 and report["slabs_mapped"] == 0


def _fake_daemon(store: SlabStore, stop: threading.Event) -> tuple[str, threading.Thread]:
    """A ROUTER that speaks the protocol and offers ``store``'s memory on this host, with a
    proof made with another key: a daemon outside the cluster."""
    router = context().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    region = store.alloc_slab(lock=False)
    other_key = os.urandom(32)

    def serve() -> None:
        from infiniswap.ctlauth import offer_proof
        try:
            while not stop.is_set():
                if not router.poll(50):
                    continue
                peer, data = router.recv_multipart()
                msg = p.decode(data)
                if msg.op == p.PING:
                    reply = p.reply_to(msg, p.PONG, instance="fake", challenge="11" * 16)
                elif msg.op == p.QUERY_MEM:
                    reply = p.reply_to(msg, p.FREE_MEM, free_bytes=8 * MiB, slab_size=MiB,
                                       slabs_free=8, slabs_mapped=0, host_id=host_id(),
                                       instance="fake", challenge="11" * 16)
                elif msg.op == p.MAP:
                    offer = dict(slab=msg["slab"], region=region, size=MiB,
                                 generation=store.generation(region), host_id=host_id(),
                                 host="127.0.0.1", data_port=None, shm_path=store.path(),
                                 instance="fake")
                    reply = p.reply_to(msg, p.MR_INFO, **offer,
                                       proof=offer_proof(other_key, msg["nonce"], offer))
                else:
                    reply = p.reply_to(msg, p.DONE, slabs=msg.get("slabs", []))
                router.send_multipart([peer, reply])
        finally:
            router.close(0)
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return address, th


def test_device_never_maps_the_memory_of_a_daemon_that_cannot_prove_the_key(tmp_path):
    stop = threading.Event()
    with SlabStore(4 * MiB, MiB, lock=False) as store:
        address, th = _fake_daemon(store, stop)
        try:
            with Device(MiB, backup=tmp_path / "b", daemons=[address], slab_size=MiB,
                        hot_slab=1e12, period=0.2) as dev:
                assert dev.map_now() == 0
                report = dev.stats()
                assert report["auth_refusals"] == 1 and report["slabs_mapped"] == 0
                assert report["daemons"][address]["transport"] is None     # never opened
                dev.write(0, pages(7, 4))
                assert dev.read(0, 4 * PAGE) == pages(7, 4)              # the backup file
            assert store.read(0, 4 * PAGE) == bytes(4 * PAGE)            # nothing leaked
        finally:
            stop.set()
            th.join(5)


def test_curve_refuses_a_client_whose_key_is_not_authorized(tmp_path):
    keys_dir = init_keys(tmp_path / "keys")
    cluster = Security(Keys.load(keys_dir))
    assert cluster.curve
    intruder_dir = tmp_path / "intruder"
    intruder_dir.mkdir()
    public_file, secret_file = zmq.auth.create_certificates(str(intruder_dir), "intruder")
    public, secret = zmq.auth.load_certificate(secret_file)
    intruder = Security(Keys(keys_dir, cluster.keys.server_public, None, public, secret))
    with Daemon(headroom=0, slab_size=MiB, capacity=4 * MiB, total_memory=64 * MiB,
                memory_reader=lambda: 0, lock=False, period=0.1, security=cluster,
                cluster_key=ensure_cluster_secret(keys_dir)) as d:
        before = refusal_counts().get("curve_not_authorized", 0)
        with pytest.raises(TimeoutError):
            ask(d.address, p.PING, timeout=1.0, security=intruder)
        wait_until(lambda: refusal_counts().get("curve_not_authorized", 0) > before, 10,
                   "the CURVE refusal to be counted")
        assert d.stats()["auth"]["curve_refusals"] >= 1
        assert ask(d.address, p.PING, timeout=5.0, security=cluster).op == p.PONG
