"""``MasterClient``: a worker's request/reply connection to pMaster (used by the agent's
user-facing calls and, on a socket of its own, by its I/O thread)."""
from __future__ import annotations

import itertools
import time
from typing import Any

import zmq

from dlrt.curve import Security, default_security

from ..wire import protocol as wire
from .errors import AuthRefused, AutoPSError, MasterUnreachable, PoolBusy


class MasterClient:
    """Request/reply to pMaster over a DEALER with a timeout; one per thread."""

    def __init__(self, ctx: zmq.Context, address: str, timeout: float, security: Security | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.sock = ctx.socket(zmq.DEALER)
        (security if security is not None else default_security()).client(self.sock, address)
        self.sock.connect(address)
        self._reqs = itertools.count(1)

    def send(self, op: str, **fields: Any) -> int:
        """Send a request without waiting; its reply arrives on ``sock`` with this ``req``."""
        req = next(self._reqs)
        self.sock.send_multipart(wire.encode(op, req=req, **fields), zmq.NOBLOCK)
        return req

    def call(self, op: str, timeout: float | None = None, **fields: Any) -> wire.Message:
        req = next(self._reqs)
        self.sock.send_multipart(wire.encode(op, req=req, **fields))
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise MasterUnreachable(f"AutoPS master at {self.address} did not answer {op} within "
                                        f"{timeout:.0f}s; is `autops master` running there?")
            reply = wire.decode(self.sock.recv_multipart())
            if reply.get("req") != req:
                continue      # a late reply to an earlier, timed-out request
            if reply.op == wire.ERROR:
                if reply.get("refused"):
                    raise AuthRefused(f"pMaster refused {op}: {reply['message']}")
                if reply.get("retry"):
                    raise PoolBusy(f"master: {reply['message']}")
                raise AutoPSError(f"master: {reply['message']}")
            return reply

    def close(self) -> None:
        self.sock.close(0)
