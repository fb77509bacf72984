"""pMaster's messages an aggregator holds back while an earlier one finishes off its loop.

An ``ASSIGN`` of large keys is allocated (and its pages populated) by a helper thread, so the
aggregator's loop keeps serving the other jobs and sending heartbeats meanwhile. pMaster's
later messages may depend on those keys (a ``RELEASE_JOB``, a ``MIGRATE_PREPARE`` of the
job), so they wait here, in arrival order, and are handed back in that order once the keys
exist; if one of them is deferred again, the rest wait behind it.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["HeldMessages"]


class HeldMessages:
    """A queue that is open (``holding``) from ``hold()`` until ``resume()``."""

    def __init__(self) -> None:
        self._held: list | None = None

    @property
    def holding(self) -> bool:
        return self._held is not None

    def hold(self) -> None:
        """Later messages wait, from now until ``resume``."""
        if self._held is None:
            self._held = []

    def offer(self, message: Any) -> bool:
        """Keep ``message`` when holding; whether it was kept (else: handle it now)."""
        if self._held is None:
            return False
        self._held.append(message)
        return True

    def resume(self, handle: Callable[[Any], None]) -> int:
        """Stop holding and ``handle`` the kept messages in order; the ones after a message
        that makes the queue hold again stay kept. The number handled."""
        backlog, self._held = self._held or [], None
        for done, message in enumerate(backlog, 1):
            handle(message)
            if self._held is not None:
                self._held[:0] = backlog[done:]       # before anything that arrived meanwhile
                return done
        return len(backlog)
