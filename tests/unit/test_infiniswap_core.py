"""The Infiniswap C core through its Python wrappers: page I/O routing (backup file, shared-memory
remote, TCP remote), eviction and remote failure with read-after-write, the daemon's slab store and
its data server.  Everything runs in this process; the multi-process cases are in
tests/integration/test_infiniswap_core_io.py."""
from __future__ import annotations

import errno
import mmap
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dlrt.keys import ensure_cluster_secret
from infiniswap.core import PAGE_SIZE, CoreDevice, DataServer, SlabState, SlabStore
from infiniswap.handshake import client_handshake, server_handshake

from slab_fixtures import lease, server, store  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(20)

MiB = 1 << 20
SLAB = MiB
PAGES_PER_SLAB = SLAB // PAGE_SIZE


def page(tag: int, version: int = 0) -> bytes:
    """A page whose content names it, so a misplaced page is obvious."""
    return struct.pack("<QQ", tag, version) * (PAGE_SIZE // 16)


def pages(first: int, n: int, version: int = 0) -> bytes:
    return b"".join(page(first + i, version) for i in range(n))


@pytest.fixture
def device(tmp_path):
    d = CoreDevice(8 * SLAB, SLAB, tmp_path / "backup.img", writer_threads=3)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def slab_size() -> int:
    return SLAB


def map_slabs(dev: CoreDevice, st: SlabStore, remote: int, slabs: list[int]) -> dict[int, int]:
    regions = {}
    for s in slabs:
        regions[s], gen = lease(st)
        dev.map_slab(s, remote, regions[s], gen)
    return regions


# ---------------------------------------------------------------- read-after-write, three paths

def test_backup_only_read_after_write(device, tmp_path):
    assert os.path.getsize(tmp_path / "backup.img") == device.size
    model = {}
    rng = random.Random(1)
    for v in range(200):
        first = rng.randrange(0, device.size // PAGE_SIZE - 40)
        n = rng.randrange(1, 40)
        device.write(first * PAGE_SIZE, pages(first, n, v))
        for i in range(n):
            model[first + i] = page(first + i, v)
    for p, data in model.items():
        assert device.read(p * PAGE_SIZE, PAGE_SIZE) == data
    assert device.read(0, PAGE_SIZE) == model.get(0, bytes(PAGE_SIZE))
    st_ = device.stats()
    assert st_.bytes_written_remote == 0 and st_.bytes_read_remote == 0
    assert st_.bytes_written_disk_sync > 0 and st_.slabs_mapped == 0
    device.flush()
    with open(tmp_path / "backup.img", "rb") as f:       # the backup file holds the data
        for p, data in list(model.items())[:50]:
            f.seek(p * PAGE_SIZE)
            assert f.read(PAGE_SIZE) == data


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_remote_read_after_write_spanning_mapped_and_unmapped(device, store, server, kind):
    rid = (device.add_remote_shm(store.path(), store.capacity) if kind == "shm"
           else device.add_remote_tcp("127.0.0.1", server.port(), connections=2))
    regions = map_slabs(device, store, rid, [1, 2, 5])
    # One request over slabs 0 (unmapped), 1, 2 (mapped), 3 (unmapped): starts mid-slab 0.
    first = PAGES_PER_SLAB - 3
    n = 3 * PAGES_PER_SLAB + 5
    data = pages(first, n, 1)
    device.write(first * PAGE_SIZE, data)
    assert device.read(first * PAGE_SIZE, len(data)) == data
    # The mapped slabs' pages are really in the daemon's memory, with their bits set.
    assert store.read(regions[1], SLAB) == pages(PAGES_PER_SLAB, PAGES_PER_SLAB, 1)
    assert store.read(regions[2], SLAB) == pages(2 * PAGES_PER_SLAB, PAGES_PER_SLAB, 1)
    for s in (1, 2):
        info = device.slab_info(s)
        assert info.state is SlabState.MAPPED and info.remote_id == rid
        assert info.bits_set == PAGES_PER_SLAB and info.bytes_written_remote == SLAB
    assert device.slab_info(0).bits_set == 0 and device.slab_info(0).state is SlabState.UNMAPPED
    # A mapped slab whose pages were written before mapping reads them from disk.
    device.write(5 * SLAB + 8 * PAGE_SIZE, page(7, 7))        # mapped: remote
    assert device.read(5 * SLAB, 16 * PAGE_SIZE) == bytes(8 * PAGE_SIZE) + page(7, 7) + bytes(7 * PAGE_SIZE)
    assert device.slab_info(5).bits_set == 1
    device.flush()
    s = device.stats()
    assert s.pending_disk_bytes == 0
    assert s.bytes_written_remote == 2 * SLAB + PAGE_SIZE
    assert s.bytes_written_disk_async == s.bytes_written_remote   # every remote write hit disk
    assert s.bytes_read_remote >= 2 * SLAB
    assert s.remote_errors == 0 and device.failed_slabs() == []
    if kind == "tcp":
        assert server.stats().bytes_written == 2 * SLAB + PAGE_SIZE


def test_bad_arguments_are_clear_value_errors(device, store):
    with pytest.raises(ValueError, match="offset 100 is not a multiple of the 4096-byte page"):
        device.write(100, bytes(PAGE_SIZE))
    with pytest.raises(ValueError, match="length 100 is not a multiple"):
        device.write(0, bytes(100))
    with pytest.raises(ValueError, match="length 4097 is not a multiple"):
        device.read(0, PAGE_SIZE + 1)
    with pytest.raises(ValueError, match="out of range: the device is 8388608 bytes"):
        device.read(device.size - PAGE_SIZE, 2 * PAGE_SIZE)
    with pytest.raises(ValueError, match="out of range"):
        device.write(device.size, bytes(PAGE_SIZE))
    with pytest.raises(ValueError, match="offset must be in"):
        device.read(-PAGE_SIZE, PAGE_SIZE)
    with pytest.raises(ValueError, match="slab 8 is out of range: the device has 8 slabs"):
        device.begin_evict(8)
    with pytest.raises(OSError, match="no remote with id 3") as e:
        device.map_slab(0, 3, 0, 1)
    assert e.value.errno == errno.ENOENT
    rid = device.add_remote_shm(store.path(), store.capacity)
    with pytest.raises(ValueError, match="outside remote"):
        device.map_slab(0, rid, store.capacity, 1)
    with pytest.raises(ValueError, match="not page aligned"):
        device.map_slab(0, rid, 100, 1)
    device.map_slab(0, rid, *lease(store))
    with pytest.raises(OSError, match="slab 0 is mapped; evict it first") as e:
        device.map_slab(0, rid, 0, 1)
    assert e.value.errno == errno.EBUSY
    with pytest.raises(OSError, match="cannot open shared memory"):
        device.add_remote_shm("/nonexistent/mem", SLAB)
    with pytest.raises(OSError, match="connect to 127.0.0.1:1 failed") as e:
        device.add_remote_tcp("127.0.0.1", 1)
    assert e.value.errno == errno.ECONNREFUSED


def test_bad_construction(tmp_path):
    with pytest.raises(ValueError, match="power of two"):
        CoreDevice(3 * MiB, 3 * MiB, tmp_path / "b")
    with pytest.raises(ValueError, match=">= 1048576"):
        CoreDevice(MiB, 64 * 1024, tmp_path / "b")
    with pytest.raises(ValueError, match="multiple of slab_size"):
        CoreDevice(3 * MiB, 2 * MiB, tmp_path / "b")
    with pytest.raises(OSError, match="cannot create backup file"):
        CoreDevice(MiB, MiB, tmp_path / "missing-dir" / "b")
    with pytest.raises(ValueError, match="writer_threads"):
        CoreDevice(MiB, MiB, tmp_path / "b", writer_threads=0)
    with pytest.raises(ValueError, match="multiple of slab_size"):
        SlabStore(3 * MiB, 2 * MiB)


def test_closed_objects_raise(tmp_path):
    d = CoreDevice(2 * SLAB, SLAB, tmp_path / "b")
    d.write(0, page(0))
    d.close()
    d.close()                                   # idempotent
    with pytest.raises(ValueError, match="device is closed"):
        d.read(0, PAGE_SIZE)
    with CoreDevice(2 * SLAB, SLAB, tmp_path / "c") as d2:
        d2.write(0, page(1))
    assert d2.closed


# ---------------------------------------------------------------- concurrency

def test_concurrent_threads_on_disjoint_ranges_match_a_model(device, store, server):
    """Threads do random writes/reads on their own page ranges of a device with shm-mapped,
    TCP-mapped and unmapped slabs; every read matches the thread's model."""
    shm = device.add_remote_shm(store.path(), store.capacity)
    tcp = device.add_remote_tcp("127.0.0.1", server.port(), connections=3)
    map_slabs(device, store, shm, [0, 3])
    map_slabs(device, store, tcp, [1, 4, 6])
    nthreads = 6
    span = device.size // PAGE_SIZE // nthreads
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            rng = random.Random(t)
            lo = t * span
            model: dict[int, bytes] = {}
            for v in range(150):
                first = lo + rng.randrange(0, span - 16)
                n = rng.randrange(1, 16)
                if rng.random() < 0.6:
                    device.write(first * PAGE_SIZE, pages(first, n, v))
                    model.update({first + i: page(first + i, v) for i in range(n)})
                else:
                    got = device.read(first * PAGE_SIZE, n * PAGE_SIZE)
                    want = b"".join(model.get(first + i, bytes(PAGE_SIZE)) for i in range(n))
                    assert got == want, f"thread {t} mismatch at page {first}"
            for p, data in model.items():
                assert device.read(p * PAGE_SIZE, PAGE_SIZE) == data
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(15)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors[0]
    s = device.stats()
    assert s.bytes_read_remote > 0 and s.bytes_written_remote > 0 and s.remote_errors == 0


def test_gil_is_released_during_blocking_io(device):
    """Timing-free proof that page I/O releases the GIL: the remote is a data server written in
    Python and run by *this* thread while another thread is inside the C write/read.  With the
    GIL held the C call could only time out (and fall back to disk); instead it gets the Python
    server's replies."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    conn = None
    accepted: list[socket.socket] = []

    def accept_proven() -> None:                        # the cluster-key handshake (isw_auth.h)
        c, _ = lsock.accept()
        c.settimeout(10)
        accepted.append(c)
        server_handshake(c, ensure_cluster_secret())

    lsock.settimeout(10)
    hs = threading.Thread(target=accept_proven)
    hs.start()
    try:
        rid = device.add_remote_tcp("127.0.0.1", lsock.getsockname()[1], connections=1,
                                    timeout=10.0)
        hs.join(10)
        conn = accepted[0]
        device.map_slab(0, rid, 0, 1)
        result: dict[str, object] = {}

        def io() -> None:
            try:
                device.write(0, page(1))
                result["read"] = device.read(0, PAGE_SIZE)
            except BaseException as e:  # noqa: BLE001
                result["error"] = e

        th = threading.Thread(target=io)
        th.start()
        for _ in range(2):                              # serve the WRITE, then the READ
            magic, ver, op, off, length, req, gen = REQ.unpack(_recv_exact(conn, REQ.size))
            assert (magic, ver, off, length, gen) == (MAGIC, VERSION, 0, PAGE_SIZE, 1)
            if op == 2:
                assert _recv_exact(conn, length) == page(1)
                conn.sendall(REP.pack(REPLY_MAGIC, 0, req))
            else:
                conn.sendall(REP.pack(REPLY_MAGIC, 0, req) + b"P" * length)
        th.join(10)
        assert "error" not in result, result.get("error")
        assert result["read"] == b"P" * PAGE_SIZE       # served by the Python thread
        assert not device.remote_dead(rid)
    finally:
        if conn is not None:
            conn.close()
        lsock.close()


def test_close_waits_for_io_in_other_threads(tmp_path):
    d = CoreDevice(2 * SLAB, SLAB, tmp_path / "b")
    d.write(0, page(1))
    outcome: list[str] = []
    started = threading.Event()

    def reader() -> None:
        try:
            while True:
                assert d.read(0, PAGE_SIZE) == page(1)
                started.set()
        except ValueError as e:
            outcome.append(str(e))

    th = threading.Thread(target=reader)
    th.start()
    started.wait(10)
    d.close()
    th.join(10)
    assert outcome and "closed" in outcome[0]


# ---------------------------------------------------------------- eviction

@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_evict_while_writing_keeps_every_page(device, store, server, kind):
    rid = (device.add_remote_shm(store.path(), store.capacity) if kind == "shm"
           else device.add_remote_tcp("127.0.0.1", server.port()))
    regions = map_slabs(device, store, rid, [2, 3])
    last: dict[int, int] = {}
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            rng = random.Random(5)
            v = 0
            while not stop.is_set() or v < 400:
                p = 2 * PAGES_PER_SLAB + rng.randrange(0, 2 * PAGES_PER_SLAB - 4)
                n = rng.randrange(1, 5)
                device.write(p * PAGE_SIZE, pages(p, n, v))
                last.update({p + i: v for i in range(n)})
                v += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=writer)
    th.start()
    try:
        time.sleep(0.05)
        assert device.begin_evict(2) is True        # drains in-flight writes of slab 2
        store.free_slab(regions[2])                 # DONE: the daemon may release it now
        time.sleep(0.05)
        assert device.begin_evict(3) is True
        device.map_slab(3, rid, *lease(store))      # and remap under load
        time.sleep(0.05)
    finally:
        stop.set()
        th.join(15)
    assert not errors, errors[0]
    assert device.slab_info(2).state is SlabState.UNMAPPED
    assert device.slab_info(2).bits_set == 0 and device.slab_info(2).remote_id is None
    assert device.begin_evict(2) is False           # idempotent
    for p, v in last.items():
        assert device.read(p * PAGE_SIZE, PAGE_SIZE) == page(p, v), p
    device.begin_evict(3)
    for p, v in last.items():                       # everything is now read from disk
        assert device.read(p * PAGE_SIZE, PAGE_SIZE) == page(p, v), p
    assert device.slab_info(3).bits_set == 0


def test_map_states_and_activity_sampling(device, store):
    rid = device.add_remote_shm(store.path(), store.capacity)
    device.begin_map(4)
    assert device.slab_info(4).state is SlabState.MAPPING
    with pytest.raises(OSError, match="slab 4 is mapping, not unmapped"):
        device.begin_map(4)
    device.write(4 * SLAB, page(1))                 # MAPPING: still disk
    assert device.slab_info(4).bits_set == 0
    device.abort_map(4)
    assert device.slab_info(4).state is SlabState.UNMAPPED
    device.begin_map(4)
    device.map_slab(4, rid, *lease(store))
    device.write(4 * SLAB, pages(0, 3))
    device.read(4 * SLAB, 2 * PAGE_SIZE)
    device.read(0, PAGE_SIZE)
    act = device.sample_activity()
    assert len(act) == device.num_slabs
    assert act[4] == 1 + 3 + 2 and act[0] == 1 and sum(act) == 7
    assert device.sample_activity() == [0] * device.num_slabs


# ---------------------------------------------------------------- remote failure

def test_remote_dies_while_disk_write_pending_read_after_write_holds(tmp_path, store):
    """The thesis §2.4.5 case: a page is in remote memory and still queued for disk when the
    remote dies; the read must wait for the queued write and return that data."""
    srv = DataServer(store, "127.0.0.1", 0)
    path = tmp_path / "b"
    d = CoreDevice(4 * SLAB, SLAB, path, writer_threads=2)
    try:
        rid = d.add_remote_tcp("127.0.0.1", srv.port(), connections=2, timeout=2.0)
        map_slabs(d, store, rid, [1])
        d.write(SLAB, pages(PAGES_PER_SLAB, 8, 0))   # reaches disk
        d.flush()
        d.set_debug_writer_delay(1_500_000)          # the next disk writes wait 1.5 s
        new = pages(PAGES_PER_SLAB, 8, 1)
        d.write(SLAB, new)
        assert d.slab_info(1).pending_disk_writes == 1
        with open(path, "rb") as f:                  # disk still has the old version
            f.seek(SLAB)
            assert f.read(len(new)) == pages(PAGES_PER_SLAB, 8, 0)
        srv.stop()                                   # the daemon's data server vanishes
        assert d.read(SLAB, len(new)) == new         # remote READ fails → waits → disk
        info = d.slab_info(1)
        assert info.failed and info.state is SlabState.EVICTING and info.bits_set == 0
        assert info.pending_disk_writes == 0
        assert d.failed_slabs() == [1]
        assert d.remote_dead(rid) and "READ" in d.remote_error(rid)
        s = d.stats()
        assert s.remote_errors == 1 and s.bytes_read_disk >= len(new)
        d.set_debug_writer_delay(0)
        # Writes to the failed slab go to disk synchronously; the control loop unmaps it.
        d.write(SLAB + 8 * PAGE_SIZE, page(99))
        assert d.unmap_remote(rid) == 1
        assert d.failed_slabs() == [] and d.slab_info(1).state is SlabState.UNMAPPED
        assert d.read(SLAB, 9 * PAGE_SIZE) == new + page(99)
        with pytest.raises(OSError, match="is dead"):
            d.map_slab(2, rid, 0, 1)
        d.remove_remote(rid)
        with pytest.raises(OSError, match="no remote"):
            d.remote_dead(rid)
    finally:
        d.close()
        srv.stop()


def test_remote_write_failure_falls_back_to_disk(device, store, server):
    rid = device.add_remote_tcp("127.0.0.1", server.port(), connections=1)
    map_slabs(device, store, rid, [0, 1])
    device.write(0, pages(0, 4, 0))
    server.stop()
    device.write(0, pages(0, 4, 1))             # remote WRITE fails → sync disk write
    assert device.read(0, 4 * PAGE_SIZE) == pages(0, 4, 1)
    # Slab 1 never failed itself but its remote is dead: reported and served from disk.
    assert sorted(device.failed_slabs()) == [0, 1]
    device.write(SLAB, page(5))
    assert device.read(SLAB, PAGE_SIZE) == page(5)
    assert device.stats().remote_errors == 1
    assert device.unmap_remote(rid) == 2


def test_server_side_region_error_fails_only_that_slab(device, store, server):
    rid = device.add_remote_tcp("127.0.0.1", server.port(), connections=1)
    regions = map_slabs(device, store, rid, [0, 1])
    device.write(0, page(1))
    store.free_slab(regions[0])                 # the daemon released it (no EVICT/DONE)
    device.write(0, page(2))                    # WRITE answered "not allocated"
    assert device.read(0, PAGE_SIZE) == page(2)
    assert device.failed_slabs() == [0]
    assert not device.remote_dead(rid)          # the connection is fine
    assert "not an allocated slab" in device.remote_error(rid)
    device.write(SLAB, page(3))                 # slab 1 still uses the remote
    assert device.slab_info(1).bits_set == 1
    assert device.read(SLAB, PAGE_SIZE) == page(3)


def test_mark_remote_dead_sends_io_to_disk(device, store):
    rid = device.add_remote_shm(store.path(), store.capacity)
    regions = map_slabs(device, store, rid, [0])
    device.write(0, page(1))
    assert store.read(regions[0], PAGE_SIZE) == page(1)
    device.mark_remote_dead(rid)
    device.write(0, page(2))
    assert store.read(regions[0], PAGE_SIZE) == page(1)     # not touched any more
    assert device.read(0, PAGE_SIZE) == page(2)
    assert device.failed_slabs() == [0]


def test_pending_disk_writes_are_bounded(tmp_path, store):
    cap = 2 * MiB
    d = CoreDevice(4 * SLAB, SLAB, tmp_path / "b", writer_threads=2, pending_cap=cap)
    try:
        rid = d.add_remote_shm(store.path(), store.capacity)
        map_slabs(d, store, rid, [0, 1, 2, 3])
        d.set_debug_writer_delay(2000)
        peak = 0
        chunk = 64 * 1024
        for i in range(200):
            off = (i * chunk) % d.size
            d.write(off, bytes([i % 251]) * chunk)
            peak = max(peak, d.stats().pending_disk_bytes)
        assert 0 < peak <= cap
        d.set_debug_writer_delay(0)
        d.flush()
        assert d.stats().pending_disk_bytes == 0
    finally:
        d.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["w", "r", "map", "evict"]), st.integers(0, 4 * PAGES_PER_SLAB - 1),
                          st.integers(1, PAGES_PER_SLAB + 2)), min_size=1, max_size=40))
def test_every_page_written_reads_back(tmp_path_factory, ops):
    """Property: under any mix of writes, reads, maps and evictions every page reads back as last
    written."""
    st_ = SlabStore(8 * SLAB, SLAB, lock=False)
    d = CoreDevice(4 * SLAB, SLAB, tmp_path_factory.mktemp("p") / "b", writer_threads=2)
    try:
        rid = d.add_remote_shm(st_.path(), st_.capacity)
        regions = [lease(st_) for _ in range(d.num_slabs)]
        model: dict[int, bytes] = {}
        npages = d.size // PAGE_SIZE
        for v, (op, first, n) in enumerate(ops):
            n = min(n, npages - first)
            slab = first // PAGES_PER_SLAB
            if op == "w":
                d.write(first * PAGE_SIZE, pages(first, n, v))
                model.update({first + i: page(first + i, v) for i in range(n)})
            elif op == "r":
                want = b"".join(model.get(first + i, bytes(PAGE_SIZE)) for i in range(n))
                assert d.read(first * PAGE_SIZE, n * PAGE_SIZE) == want
            elif op == "map" and d.slab_info(slab).state is SlabState.UNMAPPED:
                d.map_slab(slab, rid, *regions[slab])
            elif op == "evict":
                d.begin_evict(slab)
        for p, data in model.items():
            assert d.read(p * PAGE_SIZE, PAGE_SIZE) == data
    finally:
        d.close()
        st_.close()


# ---------------------------------------------------------------- slab store

def test_store_alloc_free_returns_memory():
    s = SlabStore(4 * SLAB, SLAB, lock=False)
    try:
        assert s.resident_bytes() == 0
        offs = [s.alloc_slab() for _ in range(4)]
        assert sorted(offs) == [0, SLAB, 2 * SLAB, 3 * SLAB]
        assert s.allocated_bytes() == 4 * SLAB and s.resident_bytes() >= 4 * SLAB
        with pytest.raises(OSError, match="all 4 slabs of the store are allocated") as e:
            s.alloc_slab()
        assert e.value.errno == errno.ENOSPC
        s.write(offs[1], b"x" * PAGE_SIZE)
        assert s.read(offs[1], 3) == b"xxx"
        s.free_slab(offs[1])
        assert s.allocated_bytes() == 3 * SLAB and s.resident_bytes() <= 3 * SLAB
        with pytest.raises(ValueError, match="is not an allocated slab"):
            s.free_slab(offs[1])
        with pytest.raises(ValueError, match="not an allocated slab"):
            s.free_slab(123)
        with pytest.raises(OSError, match="not allocated"):
            s.read(offs[1], 3)
        assert s.alloc_slab() == offs[1]
        assert s.read(offs[1], 3) == b"\0\0\0"      # a fresh slab is zeroed
        with pytest.raises(ValueError, match="crosses a slab boundary"):
            s.read(SLAB - 8, 16)
    finally:
        s.close()
    with pytest.raises(ValueError, match="slab store is closed"):
        s.alloc_slab()


def test_allocation_does_not_hold_up_other_store_calls(store):
    """Allocating a slab (fallocate + mlock: seconds for a GiB) runs without the store's mutex:
    while an allocation is held inside it by the test hook, every other store call -- another
    allocation included -- completes, and the two allocations get different slabs."""
    first = store.alloc_slab()
    store.debug_hold_allocations(1)
    held: dict[str, int] = {}
    allocating = threading.Thread(target=lambda: held.update(region=store.alloc_slab()))
    allocating.start()
    others: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 10
        while store.debug_allocations_held() != 1:
            assert time.monotonic() < deadline, "the allocation never reached the test hook"
            time.sleep(0.005)

        def other_calls() -> None:
            others["region"] = store.alloc_slab()
            others["allocated"] = store.allocated_bytes()
            others["locked"] = store.locked_bytes()
            others["resident"] = store.resident_bytes()
            store.write(first, page(1))
            others["read"] = store.read(first, PAGE_SIZE)
            others["gen"] = store.generation(first)
            others["revoked"] = store.revoke(first)
            store.free_slab(first)
            others["done"] = True

        caller = threading.Thread(target=other_calls)
        caller.start()
        caller.join(10)           # returns at once; only a call blocked on the allocation stays
        assert not caller.is_alive(), "a store call waited for the allocation in progress"
        assert others.get("done"), others
        assert store.debug_allocations_held() == 1 and "region" not in held
        assert others["allocated"] == 2 * SLAB      # the held allocation is not published yet
        assert others["read"] == page(1) and others["revoked"] is True
    finally:
        store.debug_hold_allocations(0)
        allocating.join(10)
    assert held["region"] not in (others["region"], first)
    assert store.allocated_bytes() == 2 * SLAB


def _fence_line(store: SlabStore, region: int) -> tuple[mmap.mmap, int]:
    """The store's memfd mapped here, and the offset of the fence line of ``region``'s slab
    (docs/infiniswap.md, "Fencing": [slabs][64-byte lines: u64 generation, i64 users]...)."""
    with open(store.path(), "r+b") as fh:
        mem = mmap.mmap(fh.fileno(), 0)
    magic, version, slab_size, capacity, nslots = struct.unpack_from("<IIQQQ", mem, len(mem) - 64)
    assert (magic, version, slab_size, capacity) == (0x46575349, 1, SLAB, store.capacity)
    return mem, capacity + (region // SLAB) * 64


def test_revoke_waits_for_an_access_in_progress(store):
    """What a device's copy does to the fence line (users + 1 while it copies) keeps a revoked
    slab from being lent again or freed until the copy is over; a count left by a process that
    died inside a copy can be forgotten."""
    region, gen = lease(store)
    mem, line = _fence_line(store, region)
    try:
        assert struct.unpack_from("<Qq", mem, line) == (gen, 0)
        struct.pack_into("<q", mem, line + 8, 1)            # a device is inside its memcpy
        assert store.revoke(region) is False and not store.drained(region)
        assert struct.unpack_from("<Q", mem, line)[0] == gen + 1 == store.generation(region)
        with pytest.raises(OSError, match="still being accessed") as e:
            store.free_slab(region)
        assert e.value.errno == errno.EBUSY and store.allocated_bytes() == SLAB
        struct.pack_into("<q", mem, line + 8, 0)            # ... and leaves it
        assert store.drained(region)
        store.free_slab(region)
        assert store.allocated_bytes() == 0
        again = store.alloc_slab()
        assert again == region and store.generation(again) > gen + 1    # a new life
        struct.pack_into("<q", mem, line + 8, 1)            # left by a process that died
        assert store.revoke(again) is False
        store.reset_users(again)
        assert store.drained(again)
    finally:
        mem.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_slab_taken_back_is_never_touched_by_its_old_device(tmp_path, store, server, kind):
    """The fence: the daemon takes a slab back from a device that has not heard of it yet and
    lends it to another device.  The old device's reads and writes on its old mapping are
    refused (-ESTALE), fail over to its backup file and read back right; the new device's
    data in the slab is untouched."""
    def remote(dev: CoreDevice) -> int:
        return (dev.add_remote_shm(store.path()) if kind == "shm"
                else dev.add_remote_tcp("127.0.0.1", server.port(), connections=1))

    with CoreDevice(2 * SLAB, SLAB, tmp_path / "old") as old, \
            CoreDevice(2 * SLAB, SLAB, tmp_path / "new") as new:
        r_old = remote(old)
        region, gen = lease(store)
        old.map_slab(0, r_old, region, gen)
        old.write(0, pages(0, 4, 1))                        # remote, and disk in the background
        assert store.read(region, 4 * PAGE_SIZE) == pages(0, 4, 1)
        assert store.revoke(region) is True                 # taken back; nothing in progress
        new_gen = store.generation(region)
        assert new_gen != gen
        new.map_slab(0, remote(new), region, new_gen)
        theirs = pages(100, PAGES_PER_SLAB, 2)
        new.write(0, theirs)
        info = old.slab_info(0)
        assert (info.state, info.generation, info.bits_set) == (SlabState.MAPPED, gen, 4)
        assert old.read(0, 4 * PAGE_SIZE) == pages(0, 4, 1)    # refused remotely, from disk
        old.write(0, pages(0, 8, 3))                        # refused remotely, to disk
        assert old.read(0, 8 * PAGE_SIZE) == pages(0, 8, 3)
        assert store.read(region, SLAB) == theirs and new.read(0, SLAB) == theirs
        assert old.failed_slabs() == [0] and not old.remote_dead(r_old)
        assert "took the slab back" in old.remote_error(r_old)
        assert old.stats().bytes_read_remote == 0 and old.stats().remote_errors == 1
        assert old.slab_info(0).state is SlabState.EVICTING


def test_store_locked_slabs():
    s = SlabStore(2 * SLAB, SLAB, lock=True)
    try:
        off = s.alloc_slab()
        assert s.locked_bytes() == SLAB
        s.alloc_slab(lock=False)
        assert s.locked_bytes() == SLAB and s.allocated_bytes() == 2 * SLAB
        s.free_slab(off)
        assert s.locked_bytes() == 0
    finally:
        s.close()


MLOCK_CHILD = r"""
import resource, sys
from infiniswap.core import SlabStore
resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
s = SlabStore(4 << 20, 1 << 20)
s.alloc_slab()
try:
    s.alloc_slab()
except OSError as e:
    print("ERR", e.errno, e)
    assert s.allocated_bytes() == 1 << 20
    s.alloc_slab(lock=False)
    print("UNLOCKED-OK", s.allocated_bytes())
    sys.exit(0)
print("NO-ERROR")
"""


def test_store_mlock_failure_is_reported():
    cmd = [sys.executable, "-c", MLOCK_CHILD]
    if os.geteuid() == 0:       # root ignores RLIMIT_MEMLOCK unless CAP_IPC_LOCK is dropped
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv is not available to drop CAP_IPC_LOCK")
        cmd = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    if "NO-ERROR" in out.stdout:
        pytest.skip("this environment lets the process mlock past RLIMIT_MEMLOCK")
    assert out.returncode == 0, out.stderr
    assert "RLIMIT_MEMLOCK is 1024 KiB" in out.stdout and "lock=False" in out.stdout
    assert "UNLOCKED-OK 2097152" in out.stdout


# ---------------------------------------------------------------- data server, bad input

REQ = struct.Struct("<IHHQIQQ")        # magic, version, op, region, length, request id, generation
REP = struct.Struct("<IiQ")
MAGIC, REPLY_MAGIC, VERSION = 0x50575349, 0x52575349, 2


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _connect(srv: DataServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port()), timeout=5)
    client_handshake(s, ensure_cluster_secret())      # the server's key: the key directory's
    return s


def test_data_server_answers_bad_requests_and_keeps_serving(store, server, tmp_path):
    off = store.alloc_slab()
    gen = store.generation(off)
    store.write(off, b"hello" + bytes(PAGE_SIZE - 5))
    with _connect(server) as s:
        # Out-of-range and unallocated regions: error reply, the connection stays usable.
        s.sendall(REQ.pack(MAGIC, VERSION, 1, store.capacity, PAGE_SIZE, 7, gen))
        magic, status, rid = REP.unpack(_recv_exact(s, REP.size))
        assert (magic, status, rid) == (REPLY_MAGIC, -errno.ERANGE, 7)
        s.sendall(REQ.pack(MAGIC, VERSION, 2, off + SLAB, PAGE_SIZE, 8, gen) + b"z" * PAGE_SIZE)
        assert REP.unpack(_recv_exact(s, REP.size)) == (REPLY_MAGIC, -errno.EFAULT, 8)
        s.sendall(REQ.pack(MAGIC, VERSION, 1, off + SLAB - 8, 16, 9, gen))
        assert REP.unpack(_recv_exact(s, REP.size))[1] == -errno.ERANGE
        # A generation the slab no longer has (taken back): refused, nothing written.
        s.sendall(REQ.pack(MAGIC, VERSION, 2, off, 5, 12, gen - 1) + b"zzzzz")
        assert REP.unpack(_recv_exact(s, REP.size)) == (REPLY_MAGIC, -errno.ESTALE, 12)
        s.sendall(REQ.pack(MAGIC, VERSION, 1, off, 5, 10, gen))
        assert REP.unpack(_recv_exact(s, REP.size)) == (REPLY_MAGIC, 0, 10)
        assert _recv_exact(s, 5) == b"hello"
    for bad, code in [(REQ.pack(0xDEADBEEF, VERSION, 1, off, 5, 11, gen), errno.EPROTO),
                      (REQ.pack(MAGIC, 9, 1, off, 5, 11, gen), errno.EPROTONOSUPPORT),
                      (REQ.pack(MAGIC, VERSION, 77, off, 5, 11, gen), errno.EOPNOTSUPP),
                      (REQ.pack(MAGIC, VERSION, 1, off, 1 << 30, 11, gen), errno.EMSGSIZE)]:
        with _connect(server) as s:
            s.sendall(bad)
            assert REP.unpack(_recv_exact(s, REP.size))[1] == -code
            assert s.recv(1) == b""                 # ... and that connection is closed
    with _connect(server) as s:                     # garbage then hang-up: no crash
        s.sendall(b"\x01\x02\x03")
    st_ = server.stats()
    assert st_.errors == 8 and st_.bytes_read == 5
    # The server still serves devices.
    with CoreDevice(2 * SLAB, SLAB, tmp_path / "b") as d:
        rid = d.add_remote_tcp("127.0.0.1", server.port(), connections=1)
        d.map_slab(0, rid, off, store.generation(off))
        d.write(0, page(3))
        assert d.read(0, PAGE_SIZE) == page(3) and d.stats().bytes_read_remote == PAGE_SIZE


def test_store_cannot_close_under_a_running_server(store):
    srv = DataServer(store)
    try:
        with pytest.raises(OSError, match="used by a running data server") as e:
            store.close()
        assert e.value.errno == errno.EBUSY
    finally:
        srv.stop()
    srv.stop()
    with pytest.raises(ValueError, match="data server is closed"):
        srv.port()
    with pytest.raises(OSError, match="cannot listen on 127.0.0.1"):
        other = DataServer(store)
        try:
            DataServer(store, "127.0.0.1", other.port())
        finally:
            other.stop()


# ---------------------------------------------------------------- the cdef comes from the headers

def test_cdef_is_the_public_section_of_the_headers():
    """_build_core reads the cdef from the /* cffi:begin */ ... /* cffi:end */ sections of the
    C headers: comments and other preprocessor lines dropped, integer #defines become `...`;
    every function declared there is in the built module, and SlabState is the C's values."""
    from infiniswap import _build_core
    from infiniswap._core import lib

    section = """
    #include <stdint.h>
    /* cffi:begin */
    #define ISW_X (1u << 3)   /* a constant */
    #define ISW_F(a) ((a) + 1)
    #ifdef SOMETHING
    int isw_f(int a);       // kept
    #endif
    /* cffi:end */
    int isw_hidden(void);
    """
    assert _build_core._cdef_lines(_build_core._public_section("t.h", section)) == [
        "#define ISW_X ...", "    int isw_f(int a);"]
    with pytest.raises(SystemExit, match="no /\\* cffi:begin \\*/"):
        _build_core._public_section("t.h", "int isw_g(void);")

    cdef = _build_core.build_cdef()
    functions = re.findall(r"\b(isw_\w+)\s*\(", cdef)
    assert "isw_device_read" in functions and "isw_fuse_start" in functions
    assert "isw_fail" not in functions and "isw_store_base" not in functions   # internal
    assert [name for name in functions if not hasattr(lib, name)] == []
    assert {s.name: s.value for s in SlabState} == {
        "UNMAPPED": lib.ISW_SLAB_UNMAPPED, "MAPPING": lib.ISW_SLAB_MAPPING,
        "MAPPED": lib.ISW_SLAB_MAPPED, "EVICTING": lib.ISW_SLAB_EVICTING}
    assert lib.ISW_PAGE_SIZE == PAGE_SIZE == 4096
