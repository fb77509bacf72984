"""The fence (docs/infiniswap.md, "Fencing"), end to end: a device whose control thread stalls
past the daemon's EVICT timeout loses its slab, the daemon lends the same memory to another
device, and the stalled device's I/O on its old mapping never reaches that memory -- over
shared memory and over TCP.  In-process daemon with an injected memory reader (so memory
pressure is caused on purpose), real devices on loopback."""
from __future__ import annotations

import pytest

from infiniswap import Daemon, Device
from infiniswap_testlib import stalled_device_loses_its_lease, wait_until

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
        stalled_device_loses_its_lease(daemon, stalled, other, used, slab=MiB,
                                       gave_up=lambda dev: dev.stats()["slabs_mapped"] == 0)
