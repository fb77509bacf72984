"""The daemon's fence bookkeeping (``infiniswap.fencing``) over a fake store: when a slab taken
back may be reused or released, and when an access count that never drains is forgotten."""
from __future__ import annotations

from infiniswap.fencing import RELEASE, REUSE, RegionFence


class FakeStore:
    """Generations and access counts per region, as the C store keeps them."""

    def __init__(self) -> None:
        self.gen: dict[int, int] = {}
        self.users: dict[int, int] = {}
        self.resets: list[int] = []

    def revoke(self, region: int) -> bool:
        self.gen[region] = self.gen.get(region, 0) + 1
        return self.drained(region)

    def drained(self, region: int) -> bool:
        return self.users.get(region, 0) == 0

    def reset_users(self, region: int) -> None:
        self.users[region] = 0
        self.resets.append(region)


def test_a_drained_region_is_usable_at_once():
    store = FakeStore()
    fence = RegionFence(store)
    fence.lent(0, b"a")
    fence.let_go(0, b"a")
    assert fence.take_back(0, REUSE) is True and store.gen[0] == 1
    assert fence.draining == 0 and fence.settle() == [] and fence.holders() == set()


def test_a_region_being_copied_waits_until_the_copy_ends():
    store = FakeStore()
    fence = RegionFence(store)
    fence.lent(5, b"slow")
    store.users[5] = 1                          # the slow device is inside a memcpy
    assert fence.take_back(5, RELEASE) is False and store.gen[5] == 1
    assert fence.draining == 1 and fence.settle() == []
    store.users[5] = 0
    assert fence.settle() == [(5, RELEASE)] and fence.draining == 0
    assert store.resets == []


def test_a_count_that_never_drains_is_forgotten_only_when_no_holder_is_connected():
    store = FakeStore()
    fence = RegionFence(store)
    fence.lent(2, b"old")                       # timed out, still connected
    fence.lent(2, b"crashed")                   # lent later, died inside a copy
    store.users[2] = 1
    assert fence.take_back(2, REUSE) is False
    fence.gone(b"crashed")
    assert fence.settle() == [] and fence.holders() == {b"old"}     # "old" may be copying
    fence.let_go(2, b"old")                                         # its late DONE
    assert fence.settle() == [(2, REUSE)] and store.resets == [2]


def test_wait_holds_an_already_revoked_region():
    store = FakeStore()
    fence = RegionFence(store)
    fence.lent(1, b"a")
    store.users[1] = 1                          # the store refused to free it (EBUSY)
    fence.wait(1, RELEASE)
    assert fence.settle() == [] and fence.draining == 1
    store.users[1] = 0
    assert fence.settle() == [(1, RELEASE)]
    assert fence.holders() == {b"a"}            # waiting does not change who may access it
