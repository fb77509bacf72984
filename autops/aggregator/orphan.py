"""When an aggregator without a pMaster gives up: the orphan timeout.

Aggregators outlive pMaster on purpose (training goes on while it is down, and a restarted
pMaster adopts them with what they hold), also the ones pMaster's local provider started.
That is the one deliberate exception to "no orphaned children", so it is bounded: an
aggregator that has heard nothing from any pMaster -- no answer to its heartbeats, no
registration -- for ``timeout`` seconds exits by itself (``autops aggregator
--orphan-timeout``). pMaster answers every heartbeat, so a live pMaster keeps the clock
reset. ``OrphanWatch`` is that decision alone, on a clock it is given.
"""
from __future__ import annotations

import time
from typing import Callable

from ..config import DEFAULT_ORPHAN_TIMEOUT


class OrphanWatch:
    """``seen()`` whenever pMaster is heard from; ``expired()`` once it was not heard from for
    ``timeout`` seconds (never when ``timeout`` is 0)."""

    def __init__(self, timeout: float = DEFAULT_ORPHAN_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout < 0:
            raise ValueError(f"the orphan timeout must be 0 (never) or more seconds, not {timeout}")
        self.timeout = float(timeout)
        self.clock = clock
        self.last = clock()

    def seen(self) -> None:
        """pMaster was heard from now."""
        self.last = self.clock()

    def silent_for(self) -> float:
        """Seconds since pMaster was last heard from."""
        return self.clock() - self.last

    def expired(self) -> bool:
        """True once pMaster was silent for longer than the timeout (0: never)."""
        return self.timeout > 0 and self.silent_for() > self.timeout
