"""Infiniswap over RDMA end to end on the core's fake fabric (docs/rdma.md): a daemon and
devices in one process, each on its own fake verbs device, whose queue pairs do READ/WRITE as
memcpys checked against the registration tables as a NIC checks them.  Pages go to the
daemon's memory one-sidedly (the daemon runs no data server), a slab given back is
deregistered, and a device too slow to give a slab back hits the deregistered rkey: its
remote goes dead, its pages come from its backup file, and the memory lent to the next device
is never touched."""
from __future__ import annotations

import os

import pytest

from infiniswap import Daemon, Device, rdma
from infiniswap_testlib import stalled_device_loses_its_lease, wait_until

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _daemon(verbs: rdma.RdmaDevice, used: list[int], capacity: int, **kw) -> Daemon:
    return Daemon(headroom=4 * MiB, slab_size=MiB, capacity=capacity, total_memory=8 * MiB,
                  memory_reader=lambda: used[0], period=0.05, lock=False, data_host=None,
                  rdma=verbs, **kw)


def test_pages_cross_the_fake_fabric_both_ways(tmp_path):
    with rdma.RdmaDevice(fake=True) as daemon_verbs, rdma.RdmaDevice(fake=True) as device_verbs, \
            _daemon(daemon_verbs, [0], 3 * MiB) as daemon:
        wait_until(lambda: daemon.stats()["slabs_free"] == 3, 5, "preallocation")
        with Device(4 * MiB, backup=tmp_path / "backup", daemons=[daemon.address], slab_size=MiB,
                    period=0.05, transport="rdma", rdma=device_verbs, hot_slab=1e12) as dev:
            assert dev.map_now([0, 1, 2]) == 3
            data = os.urandom(4 * MiB)
            dev.write(0, data)
            assert dev.read(0, 4 * MiB) == data
            stats = dev.stats()
            assert stats["daemons"][daemon.address]["transport"] == "rdma"
            assert stats["io"]["bytes_written_remote"] == 3 * MiB        # slab 3 is not mapped
            assert stats["io"]["bytes_read_remote"] == 3 * MiB
            assert stats["io"]["remote_errors"] == 0
            assert daemon.stats()["rdma"] == {"slabs_registered": 3, "devices_connected": 1}
            assert daemon.stats()["served"] is None                      # no data server at all

            assert dev.evict_now([1]) == 1                               # given back: deregistered
            wait_until(lambda: daemon.stats()["rdma"]["slabs_registered"] == 2, 5, "the UNMAP")
            assert daemon_verbs.regions == 2
            assert dev.read(MiB, MiB) == data[MiB:2 * MiB]               # from the backup file
            assert dev.map_now([1]) == 1                                 # lent again: a new rkey
            fresh = os.urandom(MiB)
            dev.write(MiB, fresh)
            assert dev.read(0, 3 * MiB) == data[:MiB] + fresh + data[2 * MiB:3 * MiB]
            assert daemon.stats()["rdma"]["devices_connected"] == 1      # the same queue pair
        wait_until(lambda: daemon.stats()["slabs_mapped"] == 0, 5, "the device's UNMAP at close")
        assert daemon_verbs.regions == 0


def test_a_stalled_device_hits_the_deregistered_rkey_and_never_touches_the_next_lease(tmp_path):
    used = [0]                      # the emulated machine: 8 MiB, HeadRoom 4 MiB, one slab to lend
    with rdma.RdmaDevice(fake=True) as daemon_verbs, rdma.RdmaDevice(fake=True) as device_verbs, \
            _daemon(daemon_verbs, used, MiB, timeout=0.3) as daemon:
        wait_until(lambda: daemon.stats()["slabs_free"] == 1, 5, "preallocation")
        opts = dict(daemons=[daemon.address], slab_size=MiB, period=0.05, transport="rdma",
                    rdma=device_verbs, hot_slab=1e12)
        stalled = Device(2 * MiB, backup=tmp_path / "stalled", device_id="stalled", **opts)
        other = Device(2 * MiB, backup=tmp_path / "other", device_id="other", **opts)

        def deregistered() -> None:
            assert daemon_verbs.regions == 0                     # the rkey is gone: the fence
        stalled_device_loses_its_lease(daemon, stalled, other, used, slab=MiB, taken_back=deregistered,
                                       gave_up=lambda dev: dev.stats()["daemon_failures"] == 1)


def test_rdma_without_a_device_fails_in_the_constructor(tmp_path):
    if rdma.device_count() > 0:
        pytest.skip("an RDMA device is present")
    with pytest.raises(rdma.RdmaUnavailable, match="no RDMA device found|built without libibverbs"):
        Device(2 * MiB, backup=tmp_path / "backup", slab_size=MiB, transport="rdma")
    with pytest.raises(rdma.RdmaUnavailable, match="no RDMA device found|built without libibverbs"):
        rdma.RdmaDevice()
