"""ZeroMQ channels and listeners: tcp across hosts, ipc (unix sockets) on one host.

A connected ``ZmqChannel`` is a DEALER, a ``ZmqListener`` a ROUTER; a message is the
header frame followed by one frame per payload, sent without copying (``copy=False``)
and received without copying (``zmq.Frame``). A ``Framing`` turns a message into frames
and back; ``PlainFraming`` is the one above, ``shm_channel.ShmFraming`` adds references to
lent buffers. Also here: the process's ZeroMQ context, fresh ipc addresses, and the glibc
tuning that lets received frames reuse heap pages.
"""
from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any, Sequence

import zmq

from .base import Channel, Inbound, Listener, buffer_of

_NO_LENT: frozenset = frozenset()


def make_context() -> zmq.Context:
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def ipc_address(prefix: str) -> str:
    """A fresh unix-socket address under the runtime directory."""
    base = os.environ.get("AUTOPS_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{os.path.join(base, f'autops-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock')}"


def bound_address(sock: zmq.Socket) -> str:
    """The concrete address after binding to port 0 / a wildcard."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


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


class PlainFraming:
    """``[header, *payload frames]``: every payload by value."""

    lends = False

    def pack(self, header: bytes, payloads: Sequence) -> list:
        return [header, *map(buffer_of, payloads)]

    def unpack(self, frames: list) -> tuple[Any, list, frozenset]:
        return frames[0], frames[1:], _NO_LENT


class ZmqChannel(Channel):
    """A DEALER connected to one peer's endpoint."""

    def __init__(self, ctx: zmq.Context, address: str, kind: str, framing: Any = None) -> None:
        self.kind, self.address = kind, address
        self.framing = framing or PlainFraming()
        self.lends = self.framing.lends
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)

    @property
    def pollable(self) -> zmq.Socket:
        return self.sock

    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        self.sock.send_multipart(self.framing.pack(header, payloads), copy=False)

    def recv(self) -> Inbound | None:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if not frames:
            return None
        return Inbound(*self.framing.unpack(frames), self)

    def close(self) -> None:
        self.sock.close(0)


class _Peer:
    """The sender of one message at a listener: replies go back through the listener."""

    __slots__ = ("listener", "identity")

    def __init__(self, listener: "ZmqListener", identity: bytes) -> None:
        self.listener, self.identity = listener, identity

    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        listener = self.listener
        listener.sock.send_multipart([self.identity, *listener.framing.pack(header, payloads)], copy=False)


class ZmqListener(Listener):
    """A ROUTER bound to ``tcp://host:port`` or an ipc path; ``address`` is what peers
    connect to (port 0 resolved; for tcp, ``advertise_host`` replaces the bind host)."""

    def __init__(self, ctx: zmq.Context, bind: str, kind: str, advertise_host: str | None = None,
                 framing: Any = None) -> None:
        self.kind = kind
        self.framing = framing or PlainFraming()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind(bind)
        bound = bound_address(self.sock)
        if kind == "tcp" and advertise_host:
            bound = f"tcp://{advertise_host}:{int(bound.rsplit(':', 1)[1])}"
        self.address = bound

    @property
    def pollable(self) -> zmq.Socket:
        return self.sock

    def recv(self) -> Inbound | None:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if len(frames) < 2:
            return None       # a peer's empty message: nothing to answer
        return Inbound(*self.framing.unpack(frames[1:]), _Peer(self, frames[0].bytes))

    def close(self) -> None:
        self.sock.close(0)
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except OSError:
                pass
