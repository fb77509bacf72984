"""Which running job is a guest on which host's GPUs (GPU sharing under an allocation policy).

A two-way map kept in step: ``guests[g] = h`` pairs guest ``g`` with host ``h``; a host
has at most one guest, so ``guest_on(h)`` is a lookup, not a scan of the pairs."""
from __future__ import annotations

from typing import Iterator, Mapping


class Guests(Mapping[int, int]):
    """guest job id -> host job id, with the reverse lookup ``guest_on``."""

    def __init__(self) -> None:
        self._host: dict[int, int] = {}
        self._guest: dict[int, int] = {}

    def __getitem__(self, guest: int) -> int:
        return self._host[guest]

    def __iter__(self) -> Iterator[int]:
        return iter(self._host)

    def __len__(self) -> int:
        return len(self._host)

    def __setitem__(self, guest: int, host: int) -> None:
        if self._guest.get(host, guest) != guest:
            raise ValueError(f"job {host} already hosts job {self._guest[host]}")
        self.pop(guest)
        self._host[guest] = host
        self._guest[host] = guest

    def __delitem__(self, guest: int) -> None:
        del self._guest[self._host.pop(guest)]

    def pop(self, guest: int, default: int | None = None) -> int | None:
        """Unpair ``guest``; its host (``default`` when it was no guest)."""
        host = self._host.pop(guest, None)
        if host is None:
            return default
        del self._guest[host]
        return host

    def guest_on(self, host: int) -> int | None:
        """The guest on ``host``'s GPUs (None: none)."""
        return self._guest.get(host)
