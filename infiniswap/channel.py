"""ZeroMQ plumbing shared by the Infiniswap daemon, device and command line.

This module owns the process's ZeroMQ context and two small mechanisms (addresses and
the thread waker come from the shared core, ``dlrt.endpoints`` and ``dlrt.waker``):

* ``bind_router(address, what)`` -- a ROUTER socket bound with a clear error on failure;
* ``ask(addr, op, ...)`` -- one request, one reply, on a fresh DEALER socket, bounded by a
  timeout (``infiniswap status`` and tests use it).

Both apply a ``dlrt.curve.Security`` (default: ``default_security()``) before the bind or
connect, so every tcp control socket runs CURVE when the key directory holds the cluster's
server key; ``bind_router`` warns once when it binds beyond loopback without CURVE.
"""
from __future__ import annotations

from typing import Any

import zmq

from dlrt.curve import Security, default_security, warn_if_exposed
from dlrt.endpoints import endpoint

from infiniswap import protocol as p

__all__ = ["ask", "bind_router", "context"]


def context() -> zmq.Context:
    """The process-wide ZeroMQ context (never terminated by this package)."""
    return zmq.Context.instance()


def ask(addr: str, op: str, timeout: float = 2.0, security: Security | None = None,
        **fields: Any) -> p.Message:
    """Send one request to ``addr`` and return its decoded reply (``security``: the CURVE
    keys of the connection; default ``default_security()``).

    ``TimeoutError`` (naming the address) if nothing comes back within ``timeout`` seconds;
    ``ProtocolError`` if the reply is malformed.  An ERROR reply is returned as a message."""
    ep = endpoint(addr)
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        (security or default_security()).client(sock, ep)
        sock.connect(ep)
        sock.send(p.encode(op, id=1, **fields))
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"no answer from {addr} within {timeout:g} s (is it running?)")
        return p.decode(sock.recv_multipart()[-1])
    finally:
        sock.close(0)


def bind_router(address: str, what: str, security: Security | None = None,
                **options: int) -> tuple[zmq.Socket, str]:
    """A ROUTER socket bound to ``address`` (``options``: zmq socket options; ``security``:
    its CURVE keys, default ``default_security()``) and the endpoint it got; a bind failure
    is an ``OSError`` naming ``what`` and the address."""
    security = security or default_security()
    sock = context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    try:
        security.server(sock, address)
    except BaseException:                   # e.g. KeysError: CURVE on, no server key here
        sock.close(0)
        raise
    warn_if_exposed(what, address, security)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise OSError(exc.errno, f"cannot bind {what} to {address}: {exc.strerror}") from None
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
