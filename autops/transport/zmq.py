"""ZeroMQ channels and listeners: tcp across hosts, ipc (unix sockets) on one host.

A connected ``ZmqChannel`` is one DEALER per connection (``lanes``: several TCP
connections to one peer, messages spread over them), a ``ZmqListener`` a ROUTER; a message
is the header frame followed by one frame per payload, sent without copying
(``copy=False``) and received without copying (``zmq.Frame``). A ``Framing`` turns a
message into frames and back; ``PlainFraming`` is the one above, ``shm_channel.ShmFraming``
adds references to lent buffers. Also here: the process's ZeroMQ context, fresh ipc
addresses, and the glibc tuning that lets received frames reuse heap pages. Channels and
listeners apply a ``dlrt.curve.Security`` (CURVE on tcp when the key directory holds the
cluster's CURVE keys; ipc stays plaintext: it never leaves the host).
"""
from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any, Sequence

import zmq

from dlrt.curve import Security, default_security

from .base import Channel, Inbound, Listener, buffer_of

_NO_LENT: frozenset = frozenset()
_C_INT_MAX = (1 << 31) - 1
_heap_kept = 0      # bytes glibc keeps of what every thread frees (one arena, trim threshold), once tuned


def make_context(server: bool = False, malloc_tuning: bool = True) -> zmq.Context:
    """The process's ZeroMQ context. ``server``: a service process of this runtime (an
    aggregator) that receives many large messages at once; its received buffers are kept in
    one glibc heap (``keep_freed_buffers(one_arena=True)``), set before the context starts
    the I/O thread that allocates them, unless ``malloc_tuning`` is off
    (``TransportConfig.malloc_tuning``)."""
    if server and malloc_tuning:
        keep_freed_buffers(one_arena=True)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def ipc_address(prefix: str, directory: str | None = None) -> str:
    """A fresh unix-socket address in ``directory`` (``TransportConfig.runtime_dir``; None:
    the temporary directory)."""
    base = directory or tempfile.gettempdir()
    return f"ipc://{os.path.join(base, f'autops-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock')}"


def bound_address(sock: zmq.Socket) -> str:
    """The concrete address after binding to port 0 / a wildcard."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def keep_freed_buffers(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30,
                       one_arena: bool = False) -> bool:
    """Let glibc reuse freed message buffers instead of unmapping them.

    ZeroMQ allocates one buffer per received message; with glibc's defaults a multi-MiB
    buffer is mmap'ed and unmapped for every message, so every byte received is page-faulted
    in again (measured: a third of a 64 MiB push+pull over ipc). Raising the mmap and trim
    thresholds keeps those pages in the heap for the next message.

    ``one_arena``: ZeroMQ's I/O thread allocates from its own glibc arena, whose heaps hold
    64 MiB each; with more than that in flight (an aggregator receiving every worker's
    pushes at once) glibc maps and unmaps the excess per message, and those bytes are
    page-faulted in again (measured: ~1000 faults per 4 MiB message with 96 MiB in flight,
    none with one arena). One arena -- the main heap, which has no such limit -- for every
    thread of the process avoids that; it must be set before the I/O thread first allocates.
    Meant for service processes (few threads allocate), not for a user's training process.

    Returns False where mallopt is not available (not glibc). Its callers skip it where
    ``TransportConfig.malloc_tuning`` is off (``AUTOPS_MALLOC_TUNING=0``).
    """
    for value in (mmap_threshold, trim_threshold):
        if not 0 <= value <= _C_INT_MAX:        # mallopt takes a C int: ctypes would silently truncate
            raise ValueError(f"malloc threshold {value} is outside 0..{_C_INT_MAX}")
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
        ok = libc.mallopt(m_mmap_threshold, int(mmap_threshold)) == 1
        ok = ok and libc.mallopt(m_trim_threshold, int(trim_threshold)) == 1
        ok = ok and (not one_arena or libc.mallopt(m_arena_max, 1) == 1)
    except (OSError, AttributeError):
        return False
    if ok and one_arena:
        global _heap_kept
        _heap_kept = int(trim_threshold)
    return ok


def heap_kept() -> int:
    """How many freed bytes this process's one heap keeps mapped for the next allocations
    (0 unless ``keep_freed_buffers(one_arena=True)`` took effect): the most worth warming
    ahead of a burst of received messages (``prefault.warm_heap``)."""
    return _heap_kept


class PlainFraming:
    """``[header, *payload frames]``: every payload by value."""

    lends = False

    def pack(self, header: bytes, payloads: Sequence) -> list:
        return [header, *map(buffer_of, payloads)]

    def unpack(self, frames: list) -> tuple[Any, list, frozenset]:
        return frames[0], frames[1:], _NO_LENT


class ZmqChannel(Channel):
    """DEALERs connected to one peer's endpoint, one per connection (``lanes``).

    Messages go round-robin over the connections, so several TCP streams carry the traffic
    to one peer (a single stream may not fill a long or shaped link); each reply comes back
    on its request's connection. Messages on different connections may overtake each other:
    the data path never depends on their order (a pull waits for its push, pushes of an
    iteration follow the pull of the one before)."""

    def __init__(self, ctx: zmq.Context, address: str, kind: str, framing: Any = None, lanes: int = 1,
                 security: Security | None = None) -> None:
        self.kind, self.address = kind, address
        security = security if security is not None else default_security()
        self.framing = framing or PlainFraming()
        self.lends = self.framing.lends
        self.socks: list[zmq.Socket] = []
        for _ in range(max(1, lanes)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            security.client(sock, address)
            sock.connect(address)
            self.socks.append(sock)
        self._next = 0

    @property
    def pollable(self) -> zmq.Socket:
        return self.socks[0]

    @property
    def pollables(self) -> list:
        return list(self.socks)

    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        socks = self.socks
        sock = socks[self._next]
        if len(socks) > 1:
            self._next = (self._next + 1) % len(socks)
        sock.send_multipart(self.framing.pack(header, payloads), copy=False)

    def recv(self) -> Inbound | None:
        for sock in self.socks:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            if frames:
                return Inbound(*self.framing.unpack(frames), self)
        return None

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)


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
                 framing: Any = None, security: Security | None = None) -> None:
        self.kind = kind
        self.framing = framing or PlainFraming()
        self.sock = ctx.socket(zmq.ROUTER)
        try:
            (security if security is not None else default_security()).server(self.sock, bind)
            self.sock.bind(bind)
        except BaseException:
            self.sock.close(0)      # an open socket would keep the context from terminating
            raise
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
