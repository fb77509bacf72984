"""When a daemon may lend a slab region again (docs/infiniswap.md, "Fencing").

Owns the daemon's bookkeeping around its store's fence: for every region, the devices that
may still access it (they were lent it and have neither given it back nor disconnected),
and the regions taken back whose last accesses are still copying.  The mechanism is the
store's (``SlabStore.revoke`` / ``drained`` / ``reset_users``, in C, ``isw_fence.h``): a
revoke bumps the region's generation, so no access with an older lease starts any more,
and the region is safe to lend or free once no access is in progress.  This module is
the policy around it, so it is unit-tested with a fake store.

An access count that never drains was left by a process that died inside a copy.  It is
forgotten only when no device that may still access the region is connected: a device
closes its control connection only after it dropped the daemon's memory, or by dying.
"""
from __future__ import annotations

import logging
from typing import Protocol

__all__ = ["FenceStore", "RegionFence", "RELEASE", "REUSE"]

log = logging.getLogger("infiniswap.daemon")

REUSE = "reuse"          # once drained: lend it again
RELEASE = "release"      # once drained: give the memory back to the OS


class FenceStore(Protocol):
    """What the fence needs of a slab store (``infiniswap.core.SlabStore``)."""

    def revoke(self, region: int) -> bool: ...

    def drained(self, region: int) -> bool: ...

    def reset_users(self, region: int) -> None: ...


class RegionFence:
    """The daemon's view of who may still touch each region, and which regions wait."""

    def __init__(self, store: FenceStore) -> None:
        self._store = store
        self._holders: dict[int, set[bytes]] = {}    # region -> devices that may access it
        self._draining: dict[int, str] = {}           # region -> REUSE or RELEASE once drained

    def lent(self, region: int, peer: bytes) -> None:
        """``region`` is lent to ``peer`` (MR_INFO)."""
        self._holders.setdefault(region, set()).add(peer)

    def let_go(self, region: int, peer: bytes) -> None:
        """``peer`` confirmed it no longer uses ``region`` (DONE, UNMAP): it drained its I/O."""
        holders = self._holders.get(region)
        if holders is not None:
            holders.discard(peer)
            if not holders:
                del self._holders[region]

    def gone(self, peer: bytes) -> None:
        """``peer``'s connection is gone: it cannot access any region any more."""
        for region in [r for r, h in self._holders.items() if peer in h]:
            self.let_go(region, peer)

    def take_back(self, region: int, then: str) -> bool:
        """Revoke ``region``.  True when it may be reused (or released) now; False when an
        access is still copying: ``settle`` hands it back once that is over."""
        if self._store.revoke(region):
            return True
        self._draining[region] = then
        return False

    def wait(self, region: int, then: str) -> None:
        """Hold an already revoked ``region`` until no access to it is in progress."""
        self._draining[region] = then

    def settle(self) -> list[tuple[int, str]]:
        """The waiting regions that may be used now, each with what to do with it."""
        ready = []
        for region, then in list(self._draining.items()):
            if not self._store.drained(region):
                if self._holders.get(region):
                    continue                        # someone still connected may be copying
                self._store.reset_users(region)
                log.warning("daemon: region %d kept an access count of a device that is gone; "
                            "forgot it", region)
            del self._draining[region]
            ready.append((region, then))
        return ready

    @property
    def draining(self) -> int:
        """How many regions wait for accesses in progress (held: neither lent nor freed)."""
        return len(self._draining)

    def holders(self) -> set[bytes]:
        """Every device that may still access some region."""
        return set().union(*self._holders.values()) if self._holders else set()
