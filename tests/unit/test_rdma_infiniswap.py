"""Infiniswap's RDMA pieces in the C core (``csrc/infiniswap/isw_rdma.c`` through
``infiniswap.rdma``): the registration table on the core's fake-fabric device, and
device discovery -- here there is no RDMA device, so opening one fails at once."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from infiniswap import rdma


def _addr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


@pytest.fixture
def device():
    with rdma.RdmaDevice(fake=True) as dev:
        yield dev


def test_a_slab_is_registered_once_and_found_by_any_range_inside(device):
    slab = np.zeros(1 << 20, np.uint8)
    base = _addr(slab)
    keys = device.register(base, slab.nbytes)
    assert device.regions == 1 and device.name == "fake"
    assert device.register(base + 4096, 8192) == keys             # inside: the same region, one more reference
    assert device.lookup(base + 100, 200) == keys
    assert device.lookup(base, slab.nbytes, writable=True) == keys
    assert device.lookup(base + slab.nbytes - 1, 2) is None       # runs past the end
    assert device.lookup(base - 1, 1) is None
    assert device.regions == 1


def test_references_are_counted_and_the_last_deregisters(device):
    slab = np.zeros(65536, np.uint8)
    base = _addr(slab)
    device.register(base, slab.nbytes)
    device.register(base, slab.nbytes)
    device.deregister(base, slab.nbytes)
    assert device.regions == 1 and device.lookup(base, 16) is not None
    device.deregister(base, slab.nbytes)
    assert device.regions == 0 and device.lookup(base, 16) is None
    with pytest.raises(rdma.RdmaUnavailable, match="no registered region"):
        device.deregister(base, slab.nbytes)


def test_read_only_regions_do_not_serve_writable_lookups(device):
    area = np.zeros(8192, np.uint8)
    base = _addr(area)
    ro = device.register(base, 4096, writable=False)
    assert device.lookup(base, 4096) == ro
    assert device.lookup(base, 4096, writable=True) is None
    rw = device.register(base, 4096, writable=True)               # a writable one is registered next to it
    assert rw != ro and device.regions == 2
    assert device.lookup(base, 4096, writable=True) == rw


def test_separate_slabs_get_separate_keys_and_deregistration_keeps_the_others(device):
    slabs = [np.zeros(4096 * (i + 1), np.uint8) for i in range(5)]
    keys = [device.register(_addr(s), s.nbytes) for s in slabs]
    assert len(set(keys)) == 5
    device.deregister(_addr(slabs[2]), slabs[2].nbytes)
    for i, s in enumerate(slabs):
        assert (device.lookup(_addr(s), s.nbytes) == keys[i]) == (i != 2)
    device.close()
    device.close()                                                # idempotent
    with pytest.raises(ValueError, match="closed"):
        device.regions


def test_bad_arguments_are_refused(device):
    with pytest.raises(rdma.RdmaUnavailable, match="an address and a length"):
        device.register(0, 4096)
    buf = ctypes.create_string_buffer(16)
    with pytest.raises(rdma.RdmaUnavailable, match="an address and a length"):
        device.register(ctypes.addressof(buf), 0)


def test_the_selftest_runs_on_the_fake_fabric(device):
    """The fake device's queue pairs do checked memcpys: WRITE, READ, a stale generation
    refused, and the fence (an access after deregistration fails and kills the remote)."""
    device.selftest()
    assert device.regions == 0
    with pytest.raises(rdma.RdmaUnavailable, match="slab size must be in"):
        device.selftest(0)


@pytest.mark.skipif(rdma.device_count() == 0, reason="no RDMA device (ibv_get_device_list returned none)")
def test_a_slab_over_a_looped_back_queue_pair_on_a_real_device():
    with rdma.RdmaDevice() as dev:
        dev.selftest(1 << 20)
        assert dev.regions == 0


def test_opening_a_device_here_fails_at_once_with_what_to_do():
    if rdma.device_count() > 0:
        pytest.skip("an RDMA device is present")
    print("no RDMA device here; core built with libibverbs:", rdma.built())
    with pytest.raises(rdma.RdmaUnavailable) as caught:
        rdma.require_device()
    if rdma.built():
        assert str(caught.value) == "no RDMA device found (ibv_get_device_list returned none): use --transport tcp"
    else:
        assert "built without libibverbs" in str(caught.value)
    with pytest.raises(rdma.RdmaUnavailable):
        rdma.check_transport("rdma")
    rdma.check_transport("tcp")                                   # anything else: nothing to check
