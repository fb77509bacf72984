"""Addresses as users type them, and the ZeroMQ endpoints they mean.

Every CLI and service accepts ``HOST:PORT``, ``tcp://HOST:PORT`` and ``ipc://PATH``;
``endpoint()`` turns those into a ZeroMQ endpoint or raises ``ValueError`` naming the bad
address. ``is_loopback()`` tells whether a bind address stays on this machine (services
bind 127.0.0.1 unless ``--bind`` says otherwise).
"""
from __future__ import annotations

import ipaddress
import re

__all__ = ["endpoint", "host_port", "is_loopback", "DEFAULT_BIND_HOST"]

DEFAULT_BIND_HOST = "127.0.0.1"

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\s]+):(?P<port>\d+|\*)$")
_USAGE = "expected tcp://HOST:PORT, HOST:PORT or ipc://PATH"


def endpoint(addr: str, bind: bool = False) -> str:
    """A ZeroMQ endpoint for ``addr``; ``HOST:PORT`` means TCP. For ``bind``, port ``0`` or
    ``*`` asks the OS for a free port. ``ValueError`` names the address if it is unusable."""
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"bad address {addr!r}: {_USAGE}")
    addr = addr.strip()
    if addr.startswith(("ipc://", "inproc://")):
        if len(addr.split("://", 1)[1]) == 0:
            raise ValueError(f"bad address {addr!r}: the path is empty")
        return addr
    host, port = host_port(addr, bind=bind)
    return f"tcp://{host}:{'*' if port == 0 else port}"


def host_port(addr: str, bind: bool = False) -> tuple[str, int]:
    """``(host, port)`` of a TCP address (``HOST:PORT`` or ``tcp://HOST:PORT``); port ``0``
    (or ``*``) only when ``bind``. ``ValueError`` names the address if it is unusable."""
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"bad address {addr!r}: {_USAGE}")
    addr = addr.strip()
    rest = addr[len("tcp://"):] if addr.startswith("tcp://") else addr
    if "://" in rest:
        raise ValueError(f"bad address {addr!r}: only tcp://, ipc:// and inproc:// are supported")
    m = _HOST_PORT.match(rest)
    if m is None:
        raise ValueError(f"bad address {addr!r}: {_USAGE}")
    host, port = m.group("host"), m.group("port")
    if port == "*" or int(port) == 0:
        if not bind:
            raise ValueError(f"bad address {addr!r}: a port is needed to connect")
        return host, 0
    if int(port) > 65535:
        raise ValueError(f"bad address {addr!r}: port {port} is out of range (1..65535)")
    return host, int(port)


def is_loopback(addr: str) -> bool:
    """Whether a bind address (endpoint or host) stays on this machine: loopback IPs,
    ``localhost``, ipc and inproc endpoints. ``*``, ``0.0.0.0`` and other addresses do not."""
    if addr.startswith(("ipc://", "inproc://")):
        return True
    host = addr[len("tcp://"):] if addr.startswith("tcp://") else addr
    if _HOST_PORT.match(host):
        host = host.rsplit(":", 1)[0]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
