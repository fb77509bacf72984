"""HeadRoom (thesis §2.5): a daemon whose machine's local usage grows releases its unmapped
slabs, then batch-evicts mapped ones -- the least active first -- until HeadRoom is free
again; devices keep reading every page back.  In-process daemon with an injected memory
reader (the emulated local application), real devices on loopback."""
from __future__ import annotations

import mmap
import os
import struct
import threading
import time

import pytest
import zmq

from infiniswap import Daemon, Device
from infiniswap import protocol as p
from infiniswap.channel import context
from infiniswap_testlib import map_proof, wait_until

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
PAGE = 4096




@pytest.fixture
def pressured_daemon():
    """A daemon on an emulated 32 MiB machine, HeadRoom 4 MiB; ``used[0]`` is the local usage."""
    used = [0]
    d = Daemon(headroom=4 * MiB, slab_size=MiB, capacity=32 * MiB, total_memory=32 * MiB,
               memory_reader=lambda: used[0], period=0.05, timeout=2.0, lock=False,
               e_prime=lambda e: 64)          # E' large: each batch sees every mapped slab
    d.start()
    try:
        yield d, used
    finally:
        d.stop()


def test_growing_local_usage_evicts_least_active_slabs_until_headroom(pressured_daemon, tmp_path):
    daemon, used = pressured_daemon
    wait_until(lambda: daemon.stats()["slabs_free"] == 28, 5, "preallocation above HeadRoom")
    busy = Device(8 * MiB, backup=tmp_path / "busy", daemons=[daemon.address], slab_size=MiB,
                  period=0.05, device_id="busy")
    idle = Device(8 * MiB, backup=tmp_path / "idle", daemons=[daemon.address], slab_size=MiB,
                  period=0.05, device_id="idle")
    stop = threading.Event()
    pattern = {s: os.urandom(PAGE) for s in range(8)}

    def keep_busy() -> None:
        while not stop.is_set():
            for s in range(8):
                busy.write(s * MiB, pattern[s])
                assert busy.read(s * MiB, PAGE) == pattern[s]
            time.sleep(0.002)

    worker = threading.Thread(target=keep_busy)
    try:
        idle_data = os.urandom(8 * MiB)
        idle.write(0, idle_data)
        busy.map_now()
        idle.map_now()
        assert busy.stats()["slabs_mapped"] == 8 and idle.stats()["slabs_mapped"] == 8
        worker.start()
        wait_until(lambda: min(s["activity"] for s in busy.stats()["slabs"]) > 20 and
                   max(s["activity"] for s in idle.stats()["slabs"]) < 1, 10,
                   "the busy device's slabs to be hot and the idle one's cold")
        before = daemon.stats()
        assert before["slabs_mapped"] == 16 and before["evictions"] == 0

        used[0] = 20 * MiB           # the local application grows: 32 - 20 - 4 leaves 8 slabs
        wait_until(lambda: daemon.stats()["slabs_mapped"] == 8 and
                   not daemon.stats()["eviction_in_progress"], 15, "eviction down to 8 slabs")
        time.sleep(0.3)              # nothing more is evicted once HeadRoom is back
        st = daemon.stats()
        assert st["slabs_mapped"] == 8 and st["evictions"] == 8
        assert st["slabs_free"] == 0                       # unmapped slabs went first
        assert st["free_bytes"] >= st["headroom"]
        assert st["devices"] == {"busy": list(range(8))}   # the idle device's slabs went
        assert idle.stats()["slabs_mapped"] == 0 and idle.stats()["evictions"] == 8
        assert busy.stats()["slabs_mapped"] == 8 and busy.stats()["evictions"] == 0
        assert idle.read(0, 8 * MiB) == idle_data         # now from the backup file
    finally:
        stop.set()
        if worker.is_alive():
            worker.join()
        busy.close()
        idle.close()


def _fence_view(shm_path: str) -> tuple[mmap.mmap, int]:
    """The daemon's slab memory mapped here, as a device on its host maps it, and where its
    fence lines begin (docs/infiniswap.md, "Fencing")."""
    with open(shm_path, "r+b") as fh:
        mem = mmap.mmap(fh.fileno(), 0)
    capacity = struct.unpack_from("<Q", mem, len(mem) - 64 + 16)[0]
    return mem, capacity


def _line(capacity: int, region: int) -> int:
    return capacity + (region // MiB) * 64          # u64 generation, i64 accesses in progress


def _silent_device(daemon: Daemon, identity: bytes, slabs: int) -> tuple[zmq.Socket, list]:
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(daemon.address)
    leases = []
    proof = map_proof(sock, identity)
    for slab in range(slabs):
        sock.send(p.encode(p.MAP, id=slab, device_id=identity.decode(), slab=slab, slab_size=MiB,
                           **proof))
        assert sock.poll(5000)
        info = p.decode(sock.recv())
        assert info.op == p.MR_INFO
        leases.append(info)
    return sock, leases


def test_device_that_never_answers_evict_is_fenced_and_its_memory_released(pressured_daemon):
    """A device that took slabs and then stays silent loses them after ``timeout``.  It may only
    be slow, so the daemon takes them back through the fence: their generations change, so the
    device's accesses would be refused; a slab it is copying right now (its fence count raised,
    as a device's memcpy does) is held -- neither lent nor freed -- until that copy ends, or
    until the device disconnects; the others are released at once."""
    daemon, used = pressured_daemon
    daemon.timeout = 0.3
    wait_until(lambda: daemon.stats()["slabs_free"] > 0, 5, "preallocation")
    sock, leases = _silent_device(daemon, b"silent", 3)
    mem, capacity = _fence_view(leases[0]["shm_path"])
    lines = [_line(capacity, info["region"]) for info in leases]
    try:
        assert daemon.stats()["devices"] == {"silent": [0, 1, 2]}
        for info, line in zip(leases, lines):
            assert struct.unpack_from("<Qq", mem, line) == (info["generation"], 0)
        struct.pack_into("<q", mem, lines[0] + 8, 1)        # slab 0: inside a memcpy
        used[0] = 30 * MiB
        wait_until(lambda: daemon.stats()["slabs_mapped"] == 0, 10, "the silent device's slabs")
        wait_until(lambda: daemon.stats()["allocated_bytes"] == MiB, 10,
                   "the memory of the slabs nobody copies to be released")
        st = daemon.stats()
        assert st["devices_lost"] == 1 and st["evictions"] == 0
        assert st["slabs_quarantined"] == 1                 # the one being copied
        for info, line in zip(leases, lines):               # every lease is fenced
            assert struct.unpack_from("<Q", mem, line)[0] != info["generation"]
        asked = {}
        while sock.poll(0):
            msg = p.decode(sock.recv())
            asked[msg.op] = msg
        assert p.CHECK_ACTIVITY in asked and p.EVICT in asked   # it was asked, never answered
        struct.pack_into("<q", mem, lines[0] + 8, 0)        # the copy ends
        wait_until(lambda: daemon.stats()["slabs_quarantined"] == 0 and
                   daemon.stats()["allocated_bytes"] == 0, 5, "the copy in progress to end")
        # Late, harmless; it says the device let go, so it can no longer be copying either.
        sock.send(p.encode(p.DONE, id=asked[p.EVICT].id, slabs=[0, 1, 2]))
        used[0] = 0
        wait_until(lambda: daemon.stats()["slabs_free"] > 0, 5, "preallocation again")

        # A count that never drains (its device died inside a copy) is forgotten once no
        # device that may still access the slab is connected, and not before.
        other, [lease] = _silent_device(daemon, b"crashed", 1)
        line = _line(capacity, lease["region"])
        struct.pack_into("<q", mem, line + 8, 1)
        used[0] = 30 * MiB
        wait_until(lambda: daemon.stats()["slabs_quarantined"] == 1, 10, "the eviction timeout")
        other.close(0)                                      # and it goes away
        wait_until(lambda: daemon.stats()["slabs_quarantined"] == 0, 10, "the disconnection")
        assert struct.unpack_from("<q", mem, line + 8)[0] == 0
    finally:
        sock.close(0)
        mem.close()


def test_slow_device_keeps_reading_its_data_while_its_slabs_are_fenced(pressured_daemon,
                                                                             tmp_path):
    """The device's control thread stalls past the daemon's EVICT timeout while its I/O goes
    on: the daemon takes the slabs back through the fence, so the device's accesses are
    refused from then on and every read stays right (from the backup file); once the device
    resumes it gives the slabs up."""
    daemon, used = pressured_daemon
    daemon.timeout = 0.3
    dev = Device(4 * MiB, backup=tmp_path / "b", daemons=[daemon.address], slab_size=MiB,
                 period=0.05, device_id="slow")
    try:
        assert dev.map_now() == 4
        data = os.urandom(4 * MiB)
        dev.write(0, data)
        assert dev.stats()["io"]["bytes_written_remote"] == 4 * MiB
        stalled = threading.Event()

        def stall() -> None:            # (test hook) occupy the device's control thread
            stalled.set()
            time.sleep(2.0)
        staller = threading.Thread(target=lambda: dev._ctl.call(stall))
        staller.start()
        assert stalled.wait(5)
        used[0] = 30 * MiB
        while staller.is_alive():
            assert dev.read(0, 4 * MiB) == data
            time.sleep(0.05)
        staller.join()
        assert daemon.stats()["devices_lost"] == 1          # it did time out meanwhile
        wait_until(lambda: daemon.stats()["slabs_quarantined"] == 0 and
                   dev.stats()["slabs_mapped"] == 0, 10, "the late DONE")
        assert dev.read(0, 4 * MiB) == data
    finally:
        dev.close()
