"""HeadRoom (thesis §2.5): a daemon whose machine's local usage grows releases its unmapped
slabs, then batch-evicts mapped ones -- the least active first -- until HeadRoom is free
again; devices keep reading every page back.  In-process daemon with an injected memory
reader (the emulated local application), real devices on loopback."""
from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from infiniswap import Daemon, Device
from infiniswap import protocol as p
from infiniswap.channel import context
from infiniswap_testlib import wait_until

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


def test_device_that_never_answers_evict_is_taken_as_gone(pressured_daemon):
    """A device that took slabs and then stays silent loses them after ``timeout``: they are
    no longer lent to it, but held (quarantined) until its late DONE or its disconnection,
    since a device that is only slow may still be using them."""
    daemon, used = pressured_daemon
    daemon.timeout = 0.3
    wait_until(lambda: daemon.stats()["slabs_free"] > 0, 5, "preallocation")
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"silent")
    sock.connect(daemon.address)
    try:
        for slab in range(3):
            sock.send(p.encode(p.MAP, id=slab, device_id="silent", slab=slab, slab_size=MiB))
            assert sock.poll(5000)
            assert p.decode(sock.recv()).op == p.MR_INFO
        assert daemon.stats()["devices"] == {"silent": [0, 1, 2]}
        used[0] = 30 * MiB
        wait_until(lambda: daemon.stats()["slabs_mapped"] == 0, 10, "the silent device's slabs")
        st = daemon.stats()
        assert st["devices_lost"] == 1 and st["evictions"] == 0
        assert st["slabs_quarantined"] == 3 and st["allocated_bytes"] >= 3 * MiB
        asked = {}
        while sock.poll(0):
            msg = p.decode(sock.recv())
            asked[msg.op] = msg
        assert p.CHECK_ACTIVITY in asked and p.EVICT in asked   # it was asked, never answered
        sock.send(p.encode(p.DONE, id=asked[p.EVICT].id, slabs=[0, 1]))     # late, for two
        wait_until(lambda: daemon.stats()["slabs_quarantined"] == 1, 5, "the late DONE")
        sock.close(0)                                                     # and it goes away
        wait_until(lambda: daemon.stats()["slabs_quarantined"] == 0, 10, "the disconnection")
    finally:
        sock.close(0)


def test_slow_device_keeps_reading_its_data_while_its_slabs_are_quarantined(pressured_daemon,
                                                                             tmp_path):
    """The device's control thread stalls past the daemon's EVICT timeout while its I/O goes
    on: the daemon must not hand the memory back to the OS (or to anyone) until the device
    confirms, so every read stays right; the late DONE then frees the slabs."""
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
