"""Memory-registration bookkeeping of the rdma transport (``autops.transport.rdma_memory``)
over a fake verbs layer: register once and reuse, look up by address range, deregister
when the owner is freed or its scope released, landing blocks reused."""
from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autops.transport.rdma_memory import LANDING_MIN, LandingPool, NotRegistrable, RdmaMemory, Registrations, locate
from rdma_fake import FakeFabric, FakeVerbs


@pytest.fixture
def verbs():
    return FakeVerbs(FakeFabric())


def test_a_buffer_is_registered_whole_once_and_found_by_any_range_inside(verbs):
    regions = Registrations(verbs)
    owner = np.zeros(1 << 20, np.uint8)
    first = regions.register(owner[4096:8192])
    addr, nbytes = locate(owner)
    assert (first.addr, first.nbytes) == (addr, nbytes)          # the owner, not just the slice
    assert regions.register(owner[100:200].view(np.float32)) is first
    assert regions.register(memoryview(owner)[5:50]) is first
    assert regions.lookup(addr + 10, 100) is first
    assert regions.lookup(addr, nbytes) is first
    assert regions.lookup(addr + nbytes - 1, 2) is None         # runs past the end
    assert regions.lookup(addr - 1, 1) is None
    assert len(verbs.registered) == 1 and len(regions) == 1


def test_writable_lookups_need_a_writable_region(verbs):
    regions = Registrations(verbs)
    frozen = np.zeros(4096, np.uint8)
    frozen.flags.writeable = False
    region = regions.register(frozen)
    addr, _ = locate(frozen)
    assert regions.lookup(addr, 10) is region
    assert regions.lookup(addr, 10, writable=True) is None
    with pytest.raises(NotRegistrable, match="read-only"):
        regions.register(frozen, writable=True)


def test_the_region_goes_when_its_owner_is_freed(verbs):
    regions = Registrations(verbs)
    owner = np.ones(1 << 16, np.float64)
    view = owner[10:20]
    region = regions.register(view)
    addr, _ = locate(view)
    del owner
    gc.collect()
    assert regions.lookup(addr, 8) is region                    # a view keeps the owner alive
    del view
    gc.collect()
    assert verbs.deregistered == [region] and verbs.live == []
    assert regions.lookup(addr, 8) is None and len(regions) == 0


def test_memory_not_owned_by_a_numpy_array_is_not_registered(verbs):
    regions = Registrations(verbs)
    mapped = mmap.mmap(-1, 1 << 16)                     # closable while it lives
    for buf in (b"x" * 100_000, bytearray(100_000), np.frombuffer(mapped, np.uint8)):
        with pytest.raises(NotRegistrable, match="cannot be registered"):
            regions.register(buf)
    with pytest.raises(NotRegistrable, match="contiguous"):
        regions.register(np.zeros((64, 64))[:, ::2])
    assert verbs.registered == []


def test_explicit_deregistration_and_close(verbs):
    regions = Registrations(verbs)
    a, b = np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)
    ra, rb = regions.register(a), regions.register(b)
    regions.deregister(ra)
    regions.deregister(ra)                                      # twice: nothing more happens
    assert regions.lookup(*locate(a)) is None and regions.lookup(*locate(b)) is rb
    regions.close()
    assert verbs.live == [] and len(regions) == 0
    del a, b
    gc.collect()                                                # the finalizers were detached
    assert sorted(r.rkey for r in verbs.deregistered) == sorted([ra.rkey, rb.rkey])


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=8),
       slices=st.lists(st.tuples(st.integers(0, 7), st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=12),
       probes=st.lists(st.tuples(st.integers(0, 7), st.integers(-64, 5100), st.integers(1, 300)), max_size=25))
def test_lookup_finds_exactly_the_ranges_a_registered_owner_holds(sizes, slices, probes):
    """Slices of several arrays registered in any order: a probe (anywhere near any of
    them) is found iff a registered owner holds it all, and the region found holds it."""
    verbs = FakeVerbs(FakeFabric())
    regions = Registrations(verbs)
    owners = [np.zeros(n, np.uint8) for n in sizes]
    registered = set()
    for index, a, b in slices:
        owner = owners[index % len(owners)]
        lo, hi = sorted((int(a * owner.nbytes), int(b * owner.nbytes)))
        regions.register(owner[lo:max(hi, lo + 1)] if lo < owner.nbytes else owner)
        registered.add(index % len(owners))
    assert len(verbs.registered) == len(registered)              # once per owner
    spans = [locate(owners[i]) for i in registered]
    for index, offset, length in probes:
        addr = locate(owners[index % len(owners)])[0] + offset
        found = regions.lookup(addr, length)
        holds = any(start <= addr and addr + length <= start + n for start, n in spans)
        assert (found is not None) == holds
        if found is not None:
            assert found.addr <= addr and addr + length <= found.addr + found.nbytes


def test_landing_blocks_come_back_when_their_last_view_is_freed(verbs):
    pool = LandingPool(Registrations(verbs), idle_max=4 * LANDING_MIN)
    first, region = pool.take(1000)
    assert first.nbytes == 1000 and region.nbytes == LANDING_MIN
    assert region.lkey in {r.lkey for r in verbs.live}
    addr, _ = locate(first)
    kept = memoryview(first)[10:20]                             # a view handed on by the consumer
    del first
    gc.collect()
    assert pool.idle_bytes == 0                                 # still in use through `kept`
    del kept
    gc.collect()
    assert pool.idle_bytes == LANDING_MIN
    again, region2 = pool.take(LANDING_MIN)                    # same size class: the same block
    assert locate(again)[0] == addr and region2 is region
    assert len(verbs.registered) == 1


def test_landing_pool_keeps_at_most_its_idle_limit_registered(verbs):
    pool = LandingPool(Registrations(verbs), idle_max=LANDING_MIN)
    blocks = [pool.take(LANDING_MIN)[0] for _ in range(3)]
    assert len(verbs.live) == 3
    del blocks
    gc.collect()
    assert pool.idle_bytes == LANDING_MIN and len(verbs.live) == 1


def test_rdma_memory_lends_registered_arrays_and_releases_them_by_scope(verbs):
    memory = RdmaMemory(verbs)
    arrays = memory.allocate([(1000, "float32"), (3, "int64"), (0, "float64")], scope="job-a")
    other = memory.allocate([(10, "float32")], scope="job-b")
    assert memory.lends and memory.slow_to_allocate(8 << 20) and not memory.slow_to_allocate(4096)
    for shared in arrays:
        addr, nbytes, rkey = shared.ref
        assert (addr, nbytes) == locate(shared.array)
        assert addr % 64 == locate(arrays[0].array)[0] % 64    # aligned like the shm arena
        region = memory.regions.lookup(addr, nbytes, writable=True)
        assert region is not None and region.rkey == rkey
    memory.release("job-a")
    assert memory.regions.lookup(*locate(arrays[0].array)) is None
    assert memory.regions.lookup(*locate(other[0].array)) is not None
    memory.close()
    assert verbs.live == []
