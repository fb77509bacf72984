"""The fence (docs/infiniswap.md, "Fencing"), end to end: a device whose control thread stalls
past the daemon's EVICT timeout loses its slab, the daemon lends the same memory to another
device, and the stalled device's I/O on its old mapping never reaches that memory -- over
shared memory and over TCP.  In-process daemon with an injected memory reader (so memory
pressure is caused on purpose), real devices on loopback."""
from __future__ import annotations

import os
import threading

import pytest

from infiniswap import Daemon, Device
from infiniswap.core import SlabState
from infiniswap_testlib import wait_until

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_stalled_device_never_touches_a_slab_lent_to_another(tmp_path, transport):
    used = [0]                      # the emulated machine: 8 MiB, HeadRoom 4 MiB, one slab to lend
    with Daemon(headroom=4 * MiB, slab_size=MiB, capacity=MiB, total_memory=8 * MiB,
                memory_reader=lambda: used[0], period=0.05, timeout=0.3, lock=False) as daemon:
        wait_until(lambda: daemon.stats()["slabs_free"] == 1, 5, "preallocation")
        opts = dict(daemons=[daemon.address], slab_size=MiB, period=0.05, transport=transport,
                    hot_slab=1e12)                  # no automatic remapping: the test maps
        stalled = Device(2 * MiB, backup=tmp_path / "stalled", device_id="stalled", **opts)
        other = Device(2 * MiB, backup=tmp_path / "other", device_id="other", **opts)
        in_stall, resume = threading.Event(), threading.Event()

        def stall() -> None:        # (test hook) occupy the stalled device's control thread
            in_stall.set()
            resume.wait(30)
        staller = threading.Thread(target=lambda: stalled._ctl.call(stall))
        try:
            assert stalled.map_now([0]) == 1
            mine = os.urandom(MiB)
            stalled.write(0, mine)                  # in the daemon's memory (and on disk)
            before = stalled.core.slab_info(0)
            assert before.bytes_written_remote == MiB
            staller.start()
            assert in_stall.wait(5)

            used[0] = 8 * MiB       # the machine needs its memory: the slab must go, and the
            wait_until(lambda: daemon.stats()["devices_lost"] == 1 and     # device never answers
                       daemon.stats()["allocated_bytes"] == 0, 10,
                       "the daemon to take the slab back and release its memory")
            used[0] = 0
            wait_until(lambda: daemon.stats()["slabs_free"] == 1, 10, "memory to lend again")
            assert other.map_now([0]) == 1
            theirs = os.urandom(MiB)
            other.write(0, theirs)
            lent = other.core.slab_info(0)
            assert lent.region_offset == before.region_offset       # the same memory, lent again
            assert lent.generation != before.generation

            # The stalled device has heard nothing: it still maps the slab, old generation.
            old = stalled.core.slab_info(0)
            assert (old.state, old.region_offset, old.generation, old.bits_set) == (
                SlabState.MAPPED, before.region_offset, before.generation, MiB // 4096)
            assert stalled.read(0, MiB) == mine         # refused remotely: its backup file
            newer = os.urandom(MiB)
            stalled.write(0, newer)                     # refused remotely: its backup file
            assert stalled.read(0, MiB) == newer
            io = stalled.stats()["io"]
            assert io["bytes_read_remote"] == 0 and io["remote_errors"] == 1
            assert other.read(0, MiB) == theirs         # from the daemon's memory, intact
            assert other.stats()["io"]["bytes_read_remote"] == MiB
        finally:
            resume.set()
            staller.join(10)
        try:
            wait_until(lambda: stalled.stats()["slabs_mapped"] == 0 and
                       stalled.core.slab_info(0).state is SlabState.UNMAPPED, 10,
                       "the stalled device to give the slab up once it resumes")
            assert stalled.read(0, MiB) == newer and other.read(0, MiB) == theirs
            assert daemon.stats()["devices"] == {"other": [0]}
        finally:
            stalled.close()
            other.close()
