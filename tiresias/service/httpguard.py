"""Connection limits of the master's HTTP server: slow clients and file-descriptor exhaustion.

aiohttp waits for a request's header as long as the client keeps the connection open, so a
few hundred clients that send half a header and stall (slow-loris) would hold the master's
file descriptors forever. ``ConnectionGuard`` hooks the aiohttp ``web.Server``'s connection
bookkeeping and

* gives every connection ``header_timeout`` seconds to deliver a complete request header
  (from the connection's start, or from the end of its previous request): then it is closed;
* gives a request being handled ``request_timeout`` seconds (the API's answers are small);
* holds at most ``max_connections`` connections: a new one beyond that closes the oldest
  connection that is waiting for a header (an attacker's stalled socket before a victim's
  request being served); when every connection is busy, the new one is closed instead.

``rate_limited_accept_errors`` installs an event-loop exception handler for the accept
loop's "out of system resource" (EMFILE, ENFILE...): asyncio already pauses accepting for a
second; the handler logs it at most once per ``every`` seconds (with the number left out)
and frees descriptors by closing the oldest connections waiting for a header (at most 16).
``raise_nofile`` lifts the soft limit on open files to the hard one (at most 65536) and
returns it; the server caps connections below it.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import time
from typing import Any

from aiohttp import web

log = logging.getLogger("tiresias.http")

HEADER_TIMEOUT_S = float(os.environ.get("TIRESIAS_HTTP_HEADER_TIMEOUT", "10"))
REQUEST_TIMEOUT_S = float(os.environ.get("TIRESIAS_HTTP_REQUEST_TIMEOUT", "120"))
MAX_CONNECTIONS = int(os.environ.get("TIRESIAS_HTTP_MAX_CONNECTIONS", "512"))
KEEPALIVE_TIMEOUT_S = 15.0
EVICT_ON_EXHAUSTION = 16
RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class ConnectionGuard:
    def __init__(self, max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT_S,
                 request_timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.max_connections = max(1, max_connections)
        self.header_timeout = header_timeout
        self.request_timeout = request_timeout
        self.timers: dict[Any, asyncio.TimerHandle] = {}      # transport -> its deadline
        self.waiting: dict[Any, None] = {}                    # transports waiting for a header, oldest first
        self.counts = {"header_timeout": 0, "request_timeout": 0, "evicted": 0, "refused": 0}

    def install(self, server: web.Server) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport):
            made(handler, transport)
            self.opened(transport)

        def connection_lost(handler, exc=None):
            self.closed(handler.transport if handler.transport is not None else None)
            lost(handler, exc)

        server.connection_made = connection_made          # type: ignore[method-assign]
        server.connection_lost = connection_lost          # type: ignore[method-assign]
        self._transports = server._connections             # handler -> transport (aiohttp's own)

    # -- connections ---------------------------------------------------------------------
    def opened(self, transport) -> None:
        if len(self.timers) >= self.max_connections and not self.evict_oldest_waiting():
            self.counts["refused"] += 1
            transport.abort()
            return
        self._arm(transport, self.header_timeout, waiting=True)

    def closed(self, transport) -> None:
        if transport is None:                              # aiohttp dropped it already: find the stale ones
            live = set(getattr(self, "_transports", {}).values())
            for t in [t for t in self.timers if t not in live or t.is_closing()]:
                self._forget(t)
            return
        self._forget(transport)

    def evict_oldest_waiting(self) -> bool:
        for transport in self.waiting:
            self.counts["evicted"] += 1
            self._forget(transport)
            transport.abort()
            return True
        return False

    # -- requests (the middleware) -------------------------------------------------------
    def started(self, transport) -> None:
        if transport is not None and transport in self.timers:
            self._arm(transport, self.request_timeout, waiting=False)

    def done(self, transport) -> None:
        if transport is not None and transport in self.timers and not transport.is_closing():
            self._arm(transport, self.header_timeout, waiting=True)

    def middleware(self):
        @web.middleware
        async def guard(request: web.Request, handler):
            transport = request.transport
            self.started(transport)
            try:
                return await handler(request)
            finally:
                self.done(transport)
        return guard

    # -- timers --------------------------------------------------------------------------
    def _arm(self, transport, timeout: float, waiting: bool) -> None:
        old = self.timers.pop(transport, None)
        if old is not None:
            old.cancel()
        self.waiting.pop(transport, None)
        reason = "header_timeout" if waiting else "request_timeout"
        self.timers[transport] = asyncio.get_running_loop().call_later(timeout, self._expire, transport, reason)
        if waiting:
            self.waiting[transport] = None

    def _expire(self, transport, reason: str) -> None:
        self.counts[reason] += 1
        self._forget(transport)
        transport.abort()

    def _forget(self, transport) -> None:
        handle = self.timers.pop(transport, None)
        if handle is not None:
            handle.cancel()
        self.waiting.pop(transport, None)


def rate_limited_accept_errors(loop: asyncio.AbstractEventLoop, guard: ConnectionGuard | None = None,
                               every: float = 60.0) -> None:
    """Log the accept loop's resource errors at most once per ``every`` seconds (see above)."""
    state = {"last": float("-inf"), "suppressed": 0}
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS and "accept" in str(context.get("message", "")):
            if guard is not None:                          # free some descriptors for the retry
                for _ in range(EVICT_ON_EXHAUSTION):
                    if not guard.evict_oldest_waiting():
                        break
            now = time.monotonic()
            if now - state["last"] >= every:
                more = f" ({state['suppressed']} more since the last report)" if state["suppressed"] else ""
                log.error("cannot accept connections: %s; retrying every second%s", exc.strerror or exc, more)
                state["last"], state["suppressed"] = now, 0
            else:
                state["suppressed"] += 1
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)


def raise_nofile(limit: int = 65536) -> int:
    """Lift the soft open-files limit towards ``limit``; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        want = min(limit, hard) if hard != resource.RLIM_INFINITY else limit
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (ValueError, OSError):
        pass
    return soft if soft != resource.RLIM_INFINITY else limit


def connection_cap(nofile: int, wanted: int = MAX_CONNECTIONS, reserve: int = 64) -> int:
    """At most ``wanted`` connections, leaving ``reserve`` descriptors to the master itself."""
    return max(8, min(wanted, nofile - reserve))
