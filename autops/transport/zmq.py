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


def keep_freed_buffers(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Let glibc reuse freed message buffers instead of unmapping them.

    ZeroMQ allocates one buffer per received message; with glibc's defaults a multi-MiB
    buffer is mmap'ed and unmapped for every message, so every byte received is page-faulted
    in again (measured: a third of a 64 MiB push+pull over ipc). Raising the mmap and trim
    thresholds keeps those pages in the heap for the next message. Returns False where
    mallopt is not available (not glibc). ``AUTOPS_MALLOC_TUNING=0`` turns it off.
    """
    if os.environ.get("AUTOPS_MALLOC_TUNING", "1") == "0":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, int(mmap_threshold)) == 1
        return ok and libc.mallopt(m_trim_threshold, int(trim_threshold)) == 1
    except (OSError, AttributeError):
        return False
