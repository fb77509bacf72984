"""ZeroMQ plumbing shared by the Infiniswap daemon, device and command line.

This module owns three small mechanisms and nothing else:

* ``endpoint(addr, bind=...)`` -- turns what a user types (``host:port``,
  ``tcp://host:port``, ``ipc:///path``) into a ZeroMQ endpoint, or raises ``ValueError``
  with a message naming the bad address;
* ``Waker`` -- a non-blocking pipe a control thread polls next to its sockets, so other
  threads can wake it (stop, commands) without touching its sockets (ZeroMQ sockets are
  not thread-safe: each is used by the one thread that polls it);
* ``ask(addr, op, ...)`` -- one request, one reply, on a fresh DEALER socket, bounded by a
  timeout (``infiniswap status`` and tests use it).
"""
from __future__ import annotations

import os
import re
from typing import Any

import zmq

from infiniswap import protocol as p

__all__ = ["endpoint", "Waker", "ask", "context"]

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\s]+):(?P<port>\d+|\*)$")


def context() -> zmq.Context:
    """The process-wide ZeroMQ context (never terminated by this package)."""
    return zmq.Context.instance()


def endpoint(addr: str, bind: bool = False) -> str:
    """A ZeroMQ endpoint for ``addr``; ``host:port`` means TCP.  For ``bind``, port ``0`` or
    ``*`` asks the OS for a free port.  ``ValueError`` names the address if it is unusable."""
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"bad address {addr!r}: expected tcp://HOST:PORT, HOST:PORT or ipc://PATH")
    addr = addr.strip()
    if addr.startswith(("ipc://", "inproc://")):
        if len(addr.split("://", 1)[1]) == 0:
            raise ValueError(f"bad address {addr!r}: the path is empty")
        return addr
    rest = addr[len("tcp://"):] if addr.startswith("tcp://") else addr
    if "://" in rest:
        raise ValueError(f"bad address {addr!r}: only tcp://, ipc:// and inproc:// are supported")
    m = _HOST_PORT.match(rest)
    if m is None:
        raise ValueError(f"bad address {addr!r}: expected tcp://HOST:PORT, HOST:PORT or ipc://PATH")
    host, port = m.group("host"), m.group("port")
    if port == "*" or int(port) == 0:
        if not bind:
            raise ValueError(f"bad address {addr!r}: a port is needed to connect")
        port = "*"
    elif int(port) > 65535:
        raise ValueError(f"bad address {addr!r}: port {port} is out of range (1..65535)")
    return f"tcp://{host}:{port}"


class Waker:
    """A self-pipe: ``wake()`` from any thread makes ``fd`` readable until ``clear()``."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        return self._r

    def wake(self) -> None:
        if self._w < 0:
            return
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):      # full (already awake) or closed
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Close both ends once (a second call must not close a reused descriptor)."""
        fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def ask(addr: str, op: str, timeout: float = 2.0, **fields: Any) -> p.Message:
    """Send one request to ``addr`` and return its decoded reply.

    ``TimeoutError`` (naming the address) if nothing comes back within ``timeout`` seconds;
    ``ProtocolError`` if the reply is malformed.  An ERROR reply is returned as a message."""
    ep = endpoint(addr)
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(ep)
        sock.send(p.encode(op, id=1, **fields))
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"no answer from {addr} within {timeout:g} s (is it running?)")
        return p.decode(sock.recv_multipart()[-1])
    finally:
        sock.close(0)


def bind_router(address: str, what: str, **options: int) -> tuple[zmq.Socket, str]:
    """A ROUTER socket bound to ``address`` (``options``: zmq socket options) and the endpoint it
    got; a bind failure is an ``OSError`` naming ``what`` and the address."""
    sock = context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise OSError(exc.errno, f"cannot bind {what} to {address}: {exc.strerror}") from None
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
