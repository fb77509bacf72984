"""A fake verbs layer for the rdma transport's tests: a fabric inside one process.

``FakeVerbs`` stands for one opened device (``autops.transport.rdma_verbs.Verbs``):
``reg_mr`` records a region under a fresh key, ``queue_pair`` makes a ``FakeQueuePair``
that connects to a peer's queue pair by number, and ``read`` does what a NIC's READ does
-- checked the way a NIC checks it (the local key must name a writable region of this
device holding the destination, the remote key a region of the connected peer's device
holding the source), then a ``memmove``. A failed check raises ``TransportError`` like a
completion with a remote access error.
"""
from __future__ import annotations

import ctypes
import itertools
from typing import Sequence

from autops.transport.base import TransportError
from autops.transport.rdma_layout import ConnInfo
from autops.transport.rdma_verbs import MemoryRegion, ReadOp


class FakeFabric:
    def __init__(self) -> None:
        self.keys = itertools.count(0x100)
        self.qpns = itertools.count(1)
        self.regions: dict[int, tuple[MemoryRegion, bool, "FakeVerbs"]] = {}
        self.qps: dict[int, "FakeQueuePair"] = {}


class FakeVerbs:
    pins_memory = True          # as a NIC: only memory whose lifetime is watched is registered

    def __init__(self, fabric: FakeFabric, device: str = "fake0") -> None:
        self.fabric, self.device = fabric, device
        self.registered: list[MemoryRegion] = []     # every reg_mr, in order
        self.deregistered: list[MemoryRegion] = []
        self.fail_reads = False
        self.closed = False

    def reg_mr(self, addr: int, nbytes: int, writable: bool) -> MemoryRegion:
        key = next(self.fabric.keys)
        region = MemoryRegion(addr, nbytes, key, key, None)
        self.fabric.regions[key] = (region, writable, self)
        self.registered.append(region)
        return region

    def dereg_mr(self, region: MemoryRegion) -> None:
        if self.fabric.regions.pop(region.rkey, None) is None:
            raise AssertionError(f"region {region} deregistered twice")
        self.deregistered.append(region)

    @property
    def live(self) -> list[MemoryRegion]:
        return [r for r, _, owner in self.fabric.regions.values() if owner is self]

    def queue_pair(self) -> "FakeQueuePair":
        return FakeQueuePair(self)

    def close(self) -> None:
        self.closed = True


class FakeQueuePair:
    def __init__(self, verbs: FakeVerbs) -> None:
        self.verbs = verbs
        self.qpn = next(verbs.fabric.qpns)
        verbs.fabric.qps[self.qpn] = self
        self.peer: FakeQueuePair | None = None
        self.reads = 0

    def local_info(self) -> ConnInfo:
        return ConnInfo(qpn=self.qpn, psn=self.qpn & 0xFFFFFF, lid=1, gid="", mtu=3, device=self.verbs.device)

    def connect(self, remote: ConnInfo) -> None:
        peer = self.verbs.fabric.qps.get(remote.qpn)
        if peer is None:
            raise TransportError(f"no queue pair {remote.qpn} on the fabric")
        self.peer = peer

    def _region(self, key: int, addr: int, nbytes: int, owner: FakeVerbs, writable: bool) -> None:
        entry = self.verbs.fabric.regions.get(key)
        if entry is None or entry[2] is not owner:
            raise TransportError(f"remote access error: key {key:#x} is not a region of {owner.device}")
        region, can_write, _ = entry
        if addr < region.addr or addr + nbytes > region.addr + region.nbytes or (writable and not can_write):
            raise TransportError(f"remote access error: [{addr:#x}, +{nbytes}) outside region {key:#x}")

    def read(self, ops: Sequence[ReadOp]) -> None:
        peer = self.peer
        if peer is None or peer.verbs.fabric.qps.get(peer.qpn) is not peer:
            raise TransportError("the queue pair is not connected (or the peer's is gone)")
        if self.verbs.fail_reads:
            raise TransportError("injected READ failure")
        for op in ops:
            self._region(op.lkey, op.local_addr, op.nbytes, self.verbs, writable=True)
            self._region(op.rkey, op.remote_addr, op.nbytes, peer.verbs, writable=False)
        for op in ops:
            ctypes.memmove(op.local_addr, op.remote_addr, op.nbytes)
            self.reads += 1

    def close(self) -> None:
        self.verbs.fabric.qps.pop(self.qpn, None)
