"""The ``rdma`` transport: a ``Channel``/``Listener`` pair over RC queue pairs.

A connection is a TCP stream (records of ``rdma_layout``) next to one RC queue pair per
side. The stream is set up first and carries the queue pairs' addresses (``HELLO``), then
each message's header and payload descriptors (``DATA``) and the receiver's
acknowledgements (``DONE``); the bytes of every payload over ``INLINE_MAX`` stay in the
sender's registered memory and the receiver fetches them with one-sided RDMA READs into
registered landing buffers, so the sender's CPU never touches them. Why a TCP stream and
not the ZeroMQ sockets or rdma_cm: the stream gives each connection a plain descriptor
that ``zmq.Poller`` can watch (pyverbs does not expose a completion channel's fd), a
lifetime (EOF when the peer dies) and ordered, flow-controlled delivery of the small
records, with nothing more to configure than a ``rdma://host:port`` endpoint; the bulk
bytes are on the queue pair either way.

What a sender lends stays readable until the receiver says ``DONE``: a payload in
registered memory (``RdmaMemory``; ``Shared.ref`` names its region) is read in place,
any other large payload is registered on the fly (once per owner, ``Registrations``) or,
when its lifetime cannot be watched, copied into a registered staging buffer. The sender
keeps those objects alive per message until ``DONE``. Received payloads are this
process's memory (``Inbound.lent`` is empty): a READ already copied them.

Nothing blocks on a peer. A channel starts connecting on its first ``send`` (and again
after its connection broke): a non-blocking TCP connect, then HELLOs both ways, advanced by
its ``recv``/``send`` calls; the messages sent meanwhile are held until the queue pairs are
connected (a READ needs the sender's queue pair ready), and dropped with a warning if the
handshake fails or takes over ``CONNECT_TIMEOUT`` -- the caller's request timeouts take
over, as with a peer that is down. A listener takes each connection's HELLO as it arrives.
``pollable`` is an epoll descriptor over the connection sockets (readable; writable too
while output waits or a connect is under way), plus a waker that stays set while parsed
records wait, so a service's poller wakes for every step.

Not run on hardware (no RDMA device here); tested end to end with a fake verbs layer.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections import deque
from typing import Any, Sequence

import numpy as np

from dlrt.endpoints import host_port

from .base import PayloadError, Shared, TransportError, buffer_of
from .rdma_layout import (DATA, DONE, HELLO, INLINE_MAX, Descriptor, LayoutError, RecordReader,
                          decode_data, decode_done, decode_hello, encode_data, encode_done, encode_hello)
from .rdma_memory import NotRegistrable, RdmaMemory, locate
from .rdma_verbs import QueuePair, ReadOp, Verbs
from .sockpoll import LinkChannel, LinkListener, first_n

__all__ = ["RdmaChannel", "RdmaListener", "Link", "CONNECT_TIMEOUT", "parse_address"]

log = logging.getLogger("autops.transport")

CONNECT_TIMEOUT = 5.0
_IOV_MAX = 512
_RECV_CHUNK = 1 << 20
_RECV_ROUNDS = 16


def parse_address(address: str, kind: str = "rdma") -> tuple[str, int]:
    """``(host, port)`` of ``KIND://HOST:PORT`` (``rdma://``, or ``cma://`` for ``cma.py``'s verbs)."""
    if not address.startswith(f"{kind}://"):
        raise TransportError(f"not an {kind} endpoint: {address!r} (expected {kind}://HOST:PORT)")
    try:
        host, port = host_port(address[len(kind) + 3:])
    except ValueError as exc:
        raise TransportError(f"bad {kind} endpoint {address!r}: {exc}") from None
    return host.strip("[]"), port


class Link:
    """One connection: its socket, its queue pair once connected, what it owes and is owed.

    ``send`` queues a DATA record (and keeps its remote payloads alive until DONE; before
    the queue pairs are connected it is held); ``pump`` moves bytes (finishes the connect,
    flushes output, reads what arrived) and ``next_message`` turns records into messages,
    READing their remote payloads. A failure of the peer, the stream or a READ, or a
    handshake past its deadline, marks it ``broken``; it is then closed, sends are dropped."""

    def __init__(self, sock: socket.socket, verbs: Verbs, memory: RdmaMemory, name: str,
                 connect_to: tuple | None = None, timeout: float = CONNECT_TIMEOUT) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.verbs, self.memory, self.name = verbs, memory, name
        self.connect_to = connect_to          # set while a TCP connect is under way
        self.deadline = time.monotonic() + timeout
        self.qp: QueuePair | None = None
        self.connected = False                # queue pairs connected (HELLOs exchanged)
        self.eof = False
        self.reader = RecordReader()
        self.out: deque = deque()
        self.held: list = []                  # DATA buffers waiting for the queue pairs
        self.kept: dict[int, list] = {}
        self.seq = 0
        self.broken: str | None = None

    @classmethod
    def dial(cls, host: str, port: int, verbs: Verbs, memory: RdmaMemory, name: str,
             timeout: float = CONNECT_TIMEOUT) -> "Link":
        """Start connecting to a listener (never blocks but for resolving a host name) and
        queue this side's HELLO."""
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = cls(sock, verbs, memory, name, connect_to=sockaddr, timeout=timeout)
        try:
            link.hello()
        except BaseException:
            sock.close()
            raise
        link.flush()
        return link

    # --- set-up -----------------------------------------------------------------------
    def hello(self) -> None:
        """Make this side's queue pair and queue its HELLO."""
        self.qp = self.verbs.queue_pair()
        self.out.append(memoryview(encode_hello(self.qp.local_info())))

    def on_hello(self, body: memoryview) -> None:
        remote = decode_hello(body)
        if self.qp is None:            # the listener's side answers the peer's HELLO
            self.hello()
        self.qp.connect(remote)
        self.connected = True
        self.out.extend(self.held)
        self.held = []

    @property
    def late(self) -> bool:
        """Whether the handshake is still not done past its deadline."""
        return not self.connected and self.broken is None and time.monotonic() > self.deadline

    @property
    def wants_write(self) -> bool:
        return self.broken is None and (bool(self.out) or self.connect_to is not None)

    def _dialled(self) -> bool:
        """Whether the TCP connect is done (fails the link when it failed)."""
        if self.connect_to is None:
            return True
        rc = self.sock.connect_ex(self.connect_to)
        if rc in (0, errno.EISCONN):
            self.connect_to = None
            return True
        if rc not in (errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN, errno.EINTR):
            self.fail(f"cannot connect: {errno.errorcode.get(rc, rc)} ({os.strerror(rc)})")
        return False

    # --- sending ----------------------------------------------------------------------
    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        if self.broken is not None:
            log.warning("rdma: dropped a message to %s: %s", self.name, self.broken)
            return
        self.seq += 1
        descriptors, inline, keep = [], [], []
        for payload in payloads:
            descriptors.append(self._describe(payload, inline, keep))
        if keep:
            self.kept[self.seq] = keep
        (self.out if self.connected else self.held).extend(encode_data(self.seq, header, descriptors, inline))
        self.flush()

    def _describe(self, payload: Any, inline: list, keep: list) -> Descriptor:
        if isinstance(payload, Shared) and payload.ref is not None and payload.array.nbytes > INLINE_MAX:
            keep.append(payload.array)
            addr, nbytes, rkey = payload.ref
            return Descriptor.remote(nbytes, addr, rkey)
        buf = buffer_of(payload)
        view = memoryview(buf)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes <= INLINE_MAX:
            inline.append(view)
            return Descriptor.inline(view.nbytes)
        regions = self.memory.regions
        try:
            region = regions.register(buf)
            addr, nbytes = locate(buf)
            keep.append(buf)
        except NotRegistrable:
            if not self.verbs.pins_memory:
                # cma: a READ goes through this process's page tables, so any buffer kept
                # alive (and unchanged, as every payload) until DONE will do -- a torch
                # tensor's memory too; nothing to register, no copy
                try:
                    addr, nbytes = locate(buf)
                except NotRegistrable:
                    pass
                else:
                    keep.append(buf)
                    return Descriptor.remote(nbytes, addr, 0)
            staging, region = self.memory.landing.take(view.nbytes)
            staging[:] = np.frombuffer(view, np.uint8)
            addr, nbytes = locate(staging)
            keep.append(staging)
        return Descriptor.remote(nbytes, addr, region.rkey)

    def flush(self) -> bool:
        """Write what the socket takes now; whether output still waits."""
        if self.late:
            self.fail("no handshake within the connect timeout")
        if not self._dialled():
            return self.broken is None
        out = self.out
        while out and self.broken is None:
            try:
                sent = self.sock.sendmsg(list(first_n(out, _IOV_MAX)))
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                self.fail(f"connection lost ({exc.strerror or exc})")
                return False
            while out and sent >= out[0].nbytes:      # empty buffers go too
                sent -= out.popleft().nbytes
            if sent:
                out[0] = out[0][sent:]
        return bool(out) and self.broken is None

    # --- receiving --------------------------------------------------------------------
    def pump(self) -> None:
        """Flush output and read what arrived (never blocks; at most ``_RECV_ROUNDS`` reads)."""
        self.flush()
        if self.connect_to is not None:
            return
        for _ in range(_RECV_ROUNDS):
            if self.broken is not None or self.eof:
                return
            try:
                data = self.sock.recv(_RECV_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.fail(f"connection lost ({exc.strerror or exc})")
                return
            if not data:
                self.eof = True         # what arrived before it is still delivered
                return
            self.reader.feed(data)

    def next_message(self) -> tuple[Any, list] | None:
        """The next message that arrived, its remote payloads READ; ``None`` when none."""
        while self.broken is None:
            try:
                record = self.reader.next()
            except LayoutError as exc:
                self.fail(str(exc))
                return None
            if record is None:
                if self.eof:      # a peer that leaves owing nothing and owed nothing: an orderly end
                    self.fail("the peer closed the connection", orderly=not self.kept and not self.out)
                return None
            op, body = record
            try:
                if op == HELLO:
                    if self.connected:
                        raise LayoutError("rdma stream: a second HELLO")
                    self.on_hello(body)
                    self.flush()
                elif not self.connected:
                    raise LayoutError("rdma stream: a record before HELLO")
                elif op == DONE:
                    self.kept.pop(decode_done(body), None)
                elif op == DATA:
                    return self._message(body)
            except (LayoutError, TransportError) as exc:
                self.fail(str(exc))
        return None

    def _message(self, body: memoryview) -> tuple[Any, list]:
        data = decode_data(body)
        payloads = list(data.payloads)
        ops, landed = [], []
        for i, d in enumerate(data.descriptors):
            if payloads[i] is None:
                try:
                    array, region = self.memory.landing.take(d.nbytes)
                except MemoryError:
                    raise TransportError(f"no memory for a {d.nbytes}-byte payload of {self.name}") from None
                addr, _ = locate(array)
                ops.append(ReadOp(addr, region.lkey, d.addr, d.rkey, d.nbytes))
                landed.append((i, array))
        if ops:
            try:
                self.qp.read(ops)
            except TransportError as exc:
                error = PayloadError(f"payload of {self.name} could not be read: {exc}")
                for i, _ in landed:
                    payloads[i] = error
                self.fail(str(exc))
                return bytes(data.header), payloads
            for i, array in landed:
                payloads[i] = memoryview(array)
            self.out.append(memoryview(encode_done(data.seq)))
            self.flush()
        return bytes(data.header), payloads

    @property
    def has_records(self) -> bool:
        return (self.reader.buffered > 0 or self.eof) and self.broken is None

    @property
    def wants_pump(self) -> bool:
        return bool(self.out) or self.has_records or self.late

    # --- the end ----------------------------------------------------------------------
    def fail(self, reason: str, orderly: bool = False) -> None:
        if self.broken is None:
            self.broken = reason
            log.log(logging.INFO if orderly else logging.WARNING, "rdma: connection to %s %s: %s",
                    self.name, "closed" if orderly else "broken", reason)
            self.close()

    def close(self) -> None:
        # the queue pair first: once it is gone no peer READ can touch what we kept
        if self.qp is not None:
            try:
                self.qp.close()
            except Exception as exc:  # pyverbs raises its own types
                log.debug("rdma: closing a queue pair: %s", exc)
            self.qp = None
        self.kept.clear()
        self.out.clear()
        self.held = []
        self.sock.close()


class RdmaChannel(LinkChannel):
    """A connection to one peer's ``rdma://HOST:PORT`` listener; replies come back on it.
    ``kind``: ``cma`` over ``cma.CmaVerbs`` (endpoints ``cma://HOST:PORT``)."""

    lends = True

    def __init__(self, verbs: Verbs, memory: RdmaMemory, address: str,
                 timeout: float = CONNECT_TIMEOUT, kind: str = "rdma") -> None:
        super().__init__()
        self.verbs, self.memory, self.address, self.kind = verbs, memory, address, kind
        self.host, self.port = parse_address(address, kind)
        self.timeout = timeout

    def _dial(self) -> Link:
        return Link.dial(self.host, self.port, self.verbs, self.memory, self.address, self.timeout)


class RdmaListener(LinkListener):
    """A TCP socket on ``bind_host:port`` whose connections each get a queue pair;
    ``address`` is ``KIND://ADVERTISE_HOST:PORT`` (``rdma``, or ``cma`` over ``cma.CmaVerbs``)."""

    def __init__(self, verbs: Verbs, memory: RdmaMemory, bind_host: str, port: int,
                 advertise_host: str | None = None, kind: str = "rdma") -> None:
        self.verbs, self.memory, self.kind = verbs, memory, kind
        bind_host = "0.0.0.0" if bind_host in ("*", "") else bind_host
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, port))
        sock.listen(128)
        super().__init__(sock)
        host = advertise_host or bind_host
        self.address = f"{kind}://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"

    def _link_for(self, sock: socket.socket, peer: Any) -> Link:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Link(sock, self.verbs, self.memory, f"{peer[0]}:{peer[1]}")
