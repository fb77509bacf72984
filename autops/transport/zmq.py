"""ZeroMQ endpoints: tcp across hosts, ipc (unix sockets) on one host.

Transports an agent may ask for: ``tcp``; ``ipc`` (unix socket, payloads in frames);
``shm`` (ipc for messages, payload bytes through shared memory); ``auto`` (shm on the same
host when available, else tcp).
"""
from __future__ import annotations

import os
import tempfile
import uuid

import zmq

from ..hostinfo import host_id

TRANSPORTS = ("auto", "tcp", "ipc", "shm")


def make_context() -> zmq.Context:
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def ipc_address(prefix: str) -> str:
    """A fresh unix-socket address under the runtime directory."""
    base = os.environ.get("AUTOPS_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{os.path.join(base, f'autops-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock')}"


def choose_endpoint(endpoints: dict, host: str, transport: str = "auto") -> str:
    """The address to reach a peer: ``ipc`` only when both run on the same host."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r} (one of {', '.join(TRANSPORTS)})")
    same_host = host == host_id()
    if transport in ("auto", "ipc", "shm") and same_host and "ipc" in endpoints:
        return endpoints["ipc"]
    if transport in ("ipc", "shm") and not same_host:
        raise ValueError(f"transport {transport} asked for, but the aggregator runs on another host ({host})")
    if "tcp" not in endpoints:
        raise ValueError(f"aggregator offers no tcp endpoint: {endpoints}")
    return endpoints["tcp"]


def bound_address(sock: zmq.Socket) -> str:
    """The concrete address after binding to port 0 / a wildcard."""
    addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return addr
