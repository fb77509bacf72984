"""The daemon's TCP data server and the device's pipelined TCP client, on the wire.

* pipelined requests on one connection are answered in order, an error reply in the
  middle of a batch included;
* a reader that does not read makes the server wait for its socket, not block: other
  connections are served meanwhile, and every byte arrives once the reader reads;
* a large WRITE that arrives in pieces (received straight into the slab) lands whole; one
  whose slab is taken back half-way is refused and writes nothing after the revoke;
* many threads sharing one client connection (requests pipelined, replies read by one of
  them for all) read and write the right pages; a server that goes away fails every
  request in flight with an error, never a hang.
"""
from __future__ import annotations

import errno
import socket
import struct
import threading
import time

import pytest

from dlrt.keys import ensure_cluster_secret
from infiniswap.core import PAGE_SIZE, CoreDevice, DataServer
from infiniswap.handshake import client_handshake

from slab_fixtures import lease, server, store  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20
SLAB = 4 * MiB
REQ = struct.Struct("<IHHQIQQ")        # magic, version, op, region, length, request id, generation
REP = struct.Struct("<IiQ")
MAGIC, REPLY_MAGIC, VERSION, READ, WRITE = 0x50575349, 0x52575349, 2, 1, 2


@pytest.fixture
def slab_size() -> int:
    return SLAB


def pattern(tag: int, n: int) -> bytes:
    return (struct.pack("<Q", tag) * (n // 8 + 1))[:n]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def reply(sock: socket.socket) -> tuple[int, int, int]:
    return REP.unpack(recv_exact(sock, REP.size))


def connect(srv: DataServer, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", srv.port()))
    client_handshake(s, ensure_cluster_secret())   # the server's key: the key directory's
    return s


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_pipelined_requests_are_answered_in_order(store, server):
    off, gen = lease(store)
    batch, expect = [], []
    for i in range(40):                    # writes, reads of what was written, one bad region
        data = pattern(i, PAGE_SIZE)
        batch.append(REQ.pack(MAGIC, VERSION, WRITE, off + i * PAGE_SIZE, PAGE_SIZE, 2 * i, gen)
                     + data)
        expect.append((2 * i, 0, b""))
        if i == 17:
            batch.append(REQ.pack(MAGIC, VERSION, READ, store.capacity, PAGE_SIZE, 2 * i + 1, gen))
            expect.append((2 * i + 1, -errno.ERANGE, b""))
        else:
            batch.append(REQ.pack(MAGIC, VERSION, READ, off + i * PAGE_SIZE, PAGE_SIZE, 2 * i + 1,
                                  gen))
            expect.append((2 * i + 1, 0, data))
    with connect(server) as s:
        s.sendall(b"".join(batch))             # all at once: the server sees them pipelined
        for rid, status, data in expect:
            assert reply(s) == (REPLY_MAGIC, status, rid)
            assert recv_exact(s, len(data)) == data
    st = server.stats()
    assert st.requests == 80 and st.errors == 1 and st.bytes_read == 39 * PAGE_SIZE


def test_a_slow_reader_does_not_hold_up_other_connections(store, server):
    off, gen = lease(store)
    store.write(off, pattern(5, SLAB))

    def ask(sock: socket.socket, rid: int) -> None:
        sock.sendall(REQ.pack(MAGIC, VERSION, READ, off, 16, rid, gen))
        assert reply(sock) == (REPLY_MAGIC, 0, rid)
        assert recv_exact(sock, 16) == pattern(5, 16)

    # connections accepted before the slow reader's batch, so some share its worker thread
    others = [connect(server) for _ in range(6)]
    try:
        for i, o in enumerate(others):
            ask(o, 100 + i)
        n = 24                                 # 24 MiB of replies, far more than the socket holds
        with connect(server, rcvbuf=64 << 10) as slow:
            slow.sendall(b"".join(REQ.pack(MAGIC, VERSION, READ, off + (i % 4) * MiB, MiB, i, gen)
                                  for i in range(n)))
            assert wait_until(lambda: server.stats().requests >= 7)
            for i, o in enumerate(others):     # served while the slow reader reads nothing
                ask(o, 200 + i)
            for i in range(n):
                assert reply(slow) == (REPLY_MAGIC, 0, i)
                assert recv_exact(slow, MiB) == pattern(5, SLAB)[(i % 4) * MiB:(i % 4 + 1) * MiB]
    finally:
        for o in others:
            o.close()


def test_a_large_write_arriving_in_pieces_lands_whole(store, server):
    off, gen = lease(store)
    data = pattern(11, 2 * MiB)
    with connect(server) as s:
        s.sendall(REQ.pack(MAGIC, VERSION, WRITE, off, len(data), 1, gen))
        for i in range(0, len(data), 256 << 10):
            s.sendall(data[i:i + (256 << 10)])
            time.sleep(0.002)                  # the server finds the socket empty in between
        assert reply(s) == (REPLY_MAGIC, 0, 1)
    assert store.read(off, len(data)) == data
    assert server.stats().bytes_written == len(data)


def test_a_write_whose_slab_is_taken_back_half_way_is_refused(store, server):
    off, gen = lease(store)
    half = MiB
    with connect(server) as s:
        s.sendall(REQ.pack(MAGIC, VERSION, WRITE, off, 2 * half, 1, gen) + pattern(1, half))
        # the first half is in the slab (written under the lease) before the slab is revoked
        assert wait_until(lambda: store.read(off, half) == pattern(1, half))
        # revoked at once; the server's copy of the first half may still be counted as in
        # progress for an instant after its bytes landed (a busy machine): it drains
        assert store.revoke(off) or wait_until(lambda: store.drained(off))
        s.sendall(pattern(2, half))
        assert reply(s) == (REPLY_MAGIC, -errno.ESTALE, 1)
        # the connection keeps serving; nothing was written after the revoke
        s.sendall(REQ.pack(MAGIC, VERSION, READ, off, 16, 2, store.generation(off)))
        assert reply(s) == (REPLY_MAGIC, 0, 2)
        recv_exact(s, 16)
    assert store.read(off + half, half) == bytes(half)


def test_threads_sharing_one_connection_get_their_own_pages(store, server, tmp_path):
    nslabs, nthreads, rounds = 4, 8, 60
    region_size = nslabs * SLAB // nthreads
    with CoreDevice(nslabs * SLAB, SLAB, tmp_path / "backup.img") as dev:
        rid = dev.add_remote_tcp("127.0.0.1", server.port(), connections=1, timeout=10.0)
        for s in range(nslabs):
            region, gen = lease(store)
            dev.map_slab(s, rid, region, gen)
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                base, room = t * region_size, region_size // PAGE_SIZE - 64
                for r in range(rounds):        # thread t owns [base, base + region_size)
                    npages = 1 + (r * 7 + t) % 64
                    off = base + (r * 13) % room * PAGE_SIZE
                    data = pattern(t * 1000 + r, npages * PAGE_SIZE)
                    dev.write(off, data)
                    assert dev.read(off, len(data)) == data
                    assert dev.read(off, PAGE_SIZE) == data[:PAGE_SIZE]
            except BaseException as exc:       # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        st = dev.stats()
        assert st.bytes_read_remote > 0 and st.bytes_read_disk == 0
        assert not dev.remote_dead(rid)
    assert server.stats().connections == 1


def test_requests_in_flight_fail_when_the_server_goes_away(store, tmp_path):
    srv = DataServer(store, "127.0.0.1", 0)
    with CoreDevice(2 * SLAB, SLAB, tmp_path / "backup.img") as dev:
        rid = dev.add_remote_tcp("127.0.0.1", srv.port(), connections=1, timeout=10.0)
        region, gen = lease(store)
        dev.map_slab(0, rid, region, gen)
        stop = threading.Event()
        done = []

        def worker(t: int) -> None:
            n = 0
            while not stop.is_set():
                dev.write(t * 16 * PAGE_SIZE, pattern(t, 16 * PAGE_SIZE))   # remote or disk
                n += 1
            done.append(n)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        assert wait_until(lambda: srv.stats().requests > 100)
        t0 = time.monotonic()
        srv.stop()
        assert wait_until(lambda: dev.remote_dead(rid), timeout=10)
        stop.set()
        for t in threads:
            t.join(10)
        assert len(done) == 6 and time.monotonic() - t0 < 10
        for t in range(6):                     # every write reached the backup file
            assert dev.read(t * 16 * PAGE_SIZE, 16 * PAGE_SIZE) == pattern(t, 16 * PAGE_SIZE)
