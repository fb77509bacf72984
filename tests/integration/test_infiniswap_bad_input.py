"""Errors a user or a peer can cause: bad I/O ranges, bad arguments, an unreachable daemon,
malformed control messages.  Each gets one clear message; nothing crashes a daemon or a
device.  In-process daemons and devices on loopback."""
from __future__ import annotations

import logging
import os
import time

import msgpack
import pytest
import zmq

from infiniswap import Daemon, Device
from infiniswap import protocol as p
from infiniswap.channel import context
from infiniswap_testlib import map_proof, wait_until
from ports import free_port

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
PAGE = 4096


@pytest.fixture
def daemon():
    d = Daemon(headroom=0, slab_size=MiB, capacity=16 * MiB, total_memory=64 * MiB,
               memory_reader=lambda: 0, period=0.05, lock=False)
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def dealer():
    socks = []

    def make(addr: str, identity: bytes | None = None) -> zmq.Socket:
        s = context().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if identity:
            s.setsockopt(zmq.IDENTITY, identity)
        s.connect(addr)
        socks.append(s)
        return s
    try:
        yield make
    finally:
        for s in socks:
            s.close(0)


def reply(sock: zmq.Socket, timeout: float = 5.0) -> p.Message:
    assert sock.poll(int(timeout * 1000)), "no reply"
    return p.decode(sock.recv_multipart()[-1])


# ---- I/O ranges ----

@pytest.mark.parametrize("call, text", [
    (lambda d: d.read(1, PAGE), "offset 1 is not a multiple of the 4096-byte page"),
    (lambda d: d.read(0, 100), "length 100 is not a multiple of the 4096-byte page"),
    (lambda d: d.write(PAGE, b"x" * 10), "length 10 is not a multiple"),
    (lambda d: d.read(4 * MiB, PAGE), "out of range: the device is 4194304 bytes"),
    (lambda d: d.write(4 * MiB - PAGE, b"\0" * 2 * PAGE), "out of range"),
    (lambda d: d.evict_now([4]), "slab 4 is out of range: the device has 4 slabs"),
])
def test_bad_io_gets_a_clear_value_error(tmp_path, call, text):
    with Device(4 * MiB, backup=tmp_path / "b", slab_size=MiB, period=0.05) as dev:
        with pytest.raises(ValueError, match=text):
            call(dev)
        dev.write(0, b"\1" * PAGE)                   # and the device still works
        assert dev.read(0, PAGE) == b"\1" * PAGE


def test_io_after_close_is_a_clear_error(tmp_path):
    dev = Device(MiB, backup=tmp_path / "b", slab_size=MiB)
    dev.close()
    dev.close()
    with pytest.raises(ValueError, match="closed"):
        dev.read(0, PAGE)
    with pytest.raises(ValueError, match="closed"):
        dev.stats()


@pytest.mark.parametrize("kwargs, text", [
    ({"size": 3 * MiB + 1}, "multiple of the slab size"),
    ({"slab_size": 3 * MiB}, "power of two"),
    ({"transport": "infiniband"}, "transport 'infiniband' must be one of auto, shm, tcp, rdma"),
    ({"daemons": ["nonsense"]}, "bad address 'nonsense'"),
    ({"daemons": ["tcp://127.0.0.1:70000"]}, "port 70000 is out of range"),
    ({"period": 0}, "period 0 must be positive"),
])
def test_bad_device_arguments(tmp_path, kwargs, text):
    args = {"size": 4 * MiB, "slab_size": MiB, **kwargs}
    with pytest.raises(ValueError, match=text):
        Device(args.pop("size"), backup=tmp_path / "b", **args)


def test_bad_daemon_arguments():
    with pytest.raises(ValueError, match="power of two"):
        Daemon(slab_size=3 * MiB)
    with pytest.raises(ValueError, match="bad address"):
        Daemon(bind="not an address")
    with Daemon(headroom=0, slab_size=MiB, capacity=4 * MiB, lock=False) as d:
        taken = Daemon(bind=d.address, headroom=0, slab_size=MiB, capacity=4 * MiB, lock=False)
        with pytest.raises(OSError, match="cannot bind the daemon's control socket"):
            taken.start()


# ---- an unreachable daemon ----

def test_unreachable_daemon_device_starts_pages_to_disk_and_warns(tmp_path, caplog):
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    caplog.set_level(logging.WARNING, logger="infiniswap.device")
    with Device(4 * MiB, backup=tmp_path / "b", daemons=[addr], slab_size=MiB, period=0.05,
                timeout=0.3) as dev:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(addr in w and "unreachable" in w for w in warnings), warnings
        data = os.urandom(4 * MiB)
        for _ in range(3):                           # hot, but nowhere to go
            dev.write(0, data)
            time.sleep(0.06)
        assert dev.read(0, 4 * MiB) == data
        st = dev.stats()
        assert st["slabs_mapped"] == 0 and not st["daemons"][addr]["reachable"]
        assert st["io"]["bytes_written_disk_sync"] >= 3 * 4 * MiB
        assert st["io"]["bytes_written_remote"] == 0

        # the daemon comes up at that address: the device notices and uses it
        with Daemon(bind=addr, headroom=0, slab_size=MiB, capacity=8 * MiB,
                    total_memory=64 * MiB, memory_reader=lambda: 0, period=0.05, lock=False):
            def hot_and_mapped() -> bool:
                dev.write(0, data)
                return dev.stats()["slabs_mapped"] == 4
            wait_until(hot_and_mapped, 10, "the device to map its hot slabs on the new daemon")
            assert dev.read(0, 4 * MiB) == data
            assert dev.stats()["daemons"][addr]["reachable"]


def test_daemon_with_another_slab_size_is_not_used(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="infiniswap.device")
    with Daemon(headroom=0, slab_size=2 * MiB, capacity=8 * MiB, total_memory=64 * MiB,
                memory_reader=lambda: 0, lock=False) as d:
        with Device(4 * MiB, backup=tmp_path / "b", daemons=[d.address], slab_size=MiB) as dev:
            assert dev.map_now() == 0
            assert any("slab size" in r.getMessage() and d.address in r.getMessage()
                       for r in caplog.records)
            dev.write(0, b"\2" * PAGE)
            assert dev.read(0, PAGE) == b"\2" * PAGE


# ---- malformed control messages ----

@pytest.mark.parametrize("payload, text", [
    (b"\xc1garbage", "not msgpack"),
    (msgpack.packb([1, 2, 3]), "not a dict"),
    (msgpack.packb({"v": 2, "op": "FORMAT_DISK"}), "unknown op"),
    (msgpack.packb({"v": 9, "op": "PING"}), "unsupported protocol version"),
    (msgpack.packb({"v": 2, "op": "MAP", "slab": 1}), "missing field 'device_id'"),
    (msgpack.packb({"v": 2, "op": "MAP", "device_id": "x", "slab": -1}), "wrong type"),
    (msgpack.packb({"v": 2, "op": "UNMAP", "device_id": "x", "slabs": "all"}), "wrong type"),
    (p.encode(p.FREE_MEM, free_bytes=1, slab_size=1, slabs_free=1, slabs_mapped=0,
              host_id="h"), "does not accept FREE_MEM"),
    (p.encode(p.EVICT, slabs=[1]), "does not accept EVICT"),
    (p.encode(p.MAP, device_id="x", slab=0), "prove the cluster key"),
], ids=["garbage", "list", "unknown-op", "version", "missing-field", "negative-slab",
        "slabs-not-list", "reply-op", "daemon-op", "unproven-map"])
def test_malformed_messages_get_error_and_the_daemon_keeps_serving(daemon, dealer, payload,
                                                                    text):
    sock = dealer(daemon.address)
    sock.send(payload)
    msg = reply(sock)
    assert msg.op == p.ERROR and text in msg["reason"]
    sock.send(p.encode(p.QUERY_MEM, id=7))
    msg = reply(sock)
    assert msg.op == p.FREE_MEM and msg.id == 7 and msg["slab_size"] == MiB
    assert daemon.running


def test_map_with_another_slab_size_gets_error(daemon, dealer):
    sock = dealer(daemon.address, identity=b"dev-s")
    sock.send(p.encode(p.MAP, id=1, device_id="x", slab=0, slab_size=4 * MiB,
                       **map_proof(sock, b"dev-s")))
    msg = reply(sock)
    assert msg.op == p.ERROR and "slab size is 1048576" in msg["reason"]
    assert daemon.stats()["slabs_mapped"] == 0


def test_daemon_survives_a_flood_of_junk_and_odd_framing(daemon, dealer):
    sock = dealer(daemon.address)
    for i in range(200):
        sock.send(os.urandom(i % 40))
    sock.send_multipart([b"", b"", b"three frames"])
    sock.send_multipart([b""])
    sock.send(p.encode(p.PING, id=99))
    while True:                                   # every junk message got an ERROR back
        msg = reply(sock)
        if msg.op == p.PONG:
            break
        assert msg.op == p.ERROR
    assert msg.id == 99 and msg["instance"] == daemon.instance
    st = daemon.stats()
    assert st["bad_messages"] >= 200 and daemon.running


def test_daemon_map_unmap_and_ping_list(daemon, dealer):
    """MAP is idempotent per (device, slab); PONG lists the device's slabs; UNMAP frees."""
    sock = dealer(daemon.address, identity=b"dev-a")
    sock.send(p.encode(p.MAP, id=1, device_id="dev-a", slab=3, slab_size=MiB,
                       **map_proof(sock, b"dev-a")))
    first = reply(sock)
    assert first.op == p.MR_INFO and first["slab"] == 3 and first["size"] == MiB
    assert first["shm_path"].startswith("/proc/") and first["data_port"]
    sock.send(p.encode(p.MAP, id=2, device_id="dev-a", slab=3))
    again = reply(sock)
    assert again["region"] == first["region"] and again.id == 2
    assert again["generation"] == first["generation"]          # the same lease
    sock.send(p.encode(p.PING, id=3))
    assert reply(sock)["slabs"] == [3]
    assert daemon.stats()["devices"] == {"dev-a": [3]}
    sock.send(p.encode(p.UNMAP, id=4, device_id="dev-a", slabs=[3, 5]))
    done = reply(sock)
    assert done.op == p.DONE and done["slabs"] == [3, 5]
    sock.send(p.encode(p.PING, id=5))
    assert reply(sock)["slabs"] == []
    assert daemon.stats()["slabs_mapped"] == 0
    sock.send(p.encode(p.MAP, id=6, device_id="dev-a", slab=3))   # a new lease never repeats
    renewed = reply(sock)                                         # (region, generation)
    assert renewed.op == p.MR_INFO
    assert (renewed["region"], renewed["generation"]) != (first["region"], first["generation"])


def test_daemon_refuses_map_at_headroom(dealer):
    with Daemon(headroom=4 * MiB, slab_size=MiB, capacity=16 * MiB, total_memory=16 * MiB,
                memory_reader=lambda: 12 * MiB, lock=False, period=0.05) as d:
        sock = dealer(d.address, identity=b"dev-x")
        sock.send(p.encode(p.QUERY_MEM, id=1))
        free = reply(sock)
        assert free["free_bytes"] == 0 and free["slabs_free"] == 0
        sock.send(p.encode(p.MAP, id=2, device_id="x", slab=0, **map_proof(sock, b"dev-x")))
        msg = reply(sock)
        assert msg.op == p.ERROR and msg["code"] == "no_memory"
