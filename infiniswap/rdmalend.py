"""The daemon's side of Infiniswap over RDMA (``docs/rdma.md``): lending slabs as memory regions.

Owns, for a daemon started with ``--transport rdma``: the memory region of every slab it
lends (registered when the slab is lent -- MAP -- and deregistered before the slab is taken
back: the rkey is the lease, ``isw_rdma.h``), and one RC queue pair per device, connected
when the device sends RDMA_CONNECT and destroyed when the device is gone or connects again.
The daemon (``daemon.py``) calls it from its control thread; it does no I/O itself: the
devices' NICs READ and WRITE the registered slabs without this process.

The RDMA device and the slab store are given (``RdmaDevice``, ``SlabStore``, or anything
with their methods), so this is unit-tested on the core's fake fabric.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

from infiniswap.rdma import QueuePair

__all__ = ["RdmaLending", "SlabAddresses", "Verbs"]


class SlabAddresses(Protocol):
    """What lending needs of a slab store (``infiniswap.core.SlabStore``)."""

    def slab_address(self, region_offset: int) -> int: ...


class Verbs(Protocol):
    """What lending needs of an RDMA device (``infiniswap.rdma.RdmaDevice``)."""

    def register(self, addr: int, nbytes: int, writable: bool = True) -> tuple[int, int]: ...

    def deregister(self, addr: int, nbytes: int) -> None: ...

    def queue_pair(self) -> QueuePair: ...


class RdmaLending:
    """The registered slabs and the devices' queue pairs of one daemon."""

    def __init__(self, verbs: Verbs, store: SlabAddresses, slab_size: int) -> None:
        self._verbs = verbs
        self._store = store
        self._slab_size = slab_size
        self._regions: dict[int, tuple[int, int]] = {}      # region offset -> (addr, rkey)
        self._queue_pairs: dict[bytes, QueuePair] = {}      # device (routing id) -> its QP

    def lend(self, region: int) -> dict[str, int]:
        """The MR_INFO fields of a lent slab: registered now (writable: the devices WRITE
        pages into it), or the registration it already has (a retried MAP).  Raises the
        device's ``RdmaUnavailable`` when it cannot be registered (e.g. ``ulimit -l``)."""
        known = self._regions.get(region)
        if known is None:
            addr = self._store.slab_address(region)
            _, rkey = self._verbs.register(addr, self._slab_size, writable=True)
            known = self._regions[region] = (addr, rkey)
        return {"rdma_addr": known[0], "rdma_rkey": known[1]}

    def take_back(self, region: int) -> None:
        """Deregister the slab's region: from now on no device's NIC can touch it (a late
        access fails with a remote access error).  Call before the slab is revoked, reused
        or freed.  Nothing when it was not registered."""
        known = self._regions.pop(region, None)
        if known is not None:
            self._verbs.deregister(known[0], self._slab_size)

    def accept(self, peer: bytes, device_qp: Mapping[str, Any]) -> dict[str, Any]:
        """A queue pair for ``peer`` connected to ``device_qp`` (its RDMA_CONNECT); returns
        this side's address for RDMA_ACCEPT.  Replaces the peer's previous queue pair (a
        device that connects again dropped its side).  ``OSError`` when refused."""
        qp = self._verbs.queue_pair()
        try:
            qp.connect(device_qp)
        except BaseException:
            qp.close()
            raise
        old = self._queue_pairs.pop(peer, None)
        if old is not None:
            old.close()
        self._queue_pairs[peer] = qp
        return dict(qp.info)

    def peer_gone(self, peer: bytes) -> None:
        """``peer``'s control connection is gone: destroy its queue pair."""
        qp = self._queue_pairs.pop(peer, None)
        if qp is not None:
            qp.close()

    def close(self) -> None:
        """Deregister every slab and destroy every queue pair (before the store is closed)."""
        for region in list(self._regions):
            self.take_back(region)
        for peer in list(self._queue_pairs):
            self.peer_gone(peer)

    @property
    def registered(self) -> int:
        """Slabs registered now (lent over RDMA)."""
        return len(self._regions)

    @property
    def connected(self) -> int:
        """Devices with a queue pair now."""
        return len(self._queue_pairs)
