"""Messages over stream sockets, large payloads spliced: ``ipc`` and plaintext ``tcp``.

A connection is one stream socket: ``AF_UNIX`` for an ``ipc://PATH`` endpoint (the ``ipc``
transport), TCP for a ``tcp://HOST:PORT`` one (the ``stream`` endpoint an aggregator
offers next to its ZeroMQ one when CURVE is off, ``links.py``). Each message is a DATA
record: a fixed prefix (op, header bytes, payload count, sequence number), the payloads'
lengths, the header, then the payloads' bytes back to back. Over a socket every byte is
usually copied twice, into the kernel and out again; ZeroMQ adds a third copy where the
receiver takes a payload out of its frame. Here:

* a payload of ``SPLICE_MIN`` bytes or more is not copied into the kernel: ``vmsplice(2)``
  puts references to its pages into a pipe and ``splice(2)`` moves them on into the socket
  (since Linux 6.5 a unix socket takes spliced pages as they are, ``MSG_SPLICE_PAGES``;
  older kernels would copy there, so on them the link sends as usual; TCP sends spliced
  pages without copying them as well). The receiver's read is the one copy. Until
  then the socket holds the sender's pages themselves, so the sender keeps the payload --
  unchanged, as every payload until the peer answered -- until the receiver's DONE record
  says it read the message (the rule of the rdma transport's READs). Where ``vmsplice``
  fails (a sandbox that forbids it) the link sends by copying from then on.
* the receiver reads each payload straight into an array of its own, which the message
  then hands on (``Inbound.lent`` is empty); headers and small payloads come through a
  read-ahead buffer.

Nothing blocks on a peer: sockets are non-blocking, output waits in a queue that the
service's poll loop flushes when the socket is writable (``SocketPoll``), and a channel
whose connection broke drops what it is given (with a warning) and connects again on its
next ``send`` -- the callers' request timeouts take over, as with any peer that is down.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import platform
import re
import socket
import struct
from collections import deque
from typing import Sequence

import numpy as np

from dlrt.endpoints import host_port

from ..config import TransportConfig
from .base import TransportError, buffer_of
from .sockpoll import LinkBudget, LinkChannel, LinkListener, first_n
from .tcpopts import set_rto_min

__all__ = ["StreamChannel", "StreamListener", "StreamLink", "SPLICE_MIN", "socket_path", "stream_kind"]

log = logging.getLogger("autops.transport")

SPLICE_MIN = 64 << 10           # payloads this large go by vmsplice + splice, smaller ones are copied
PIPE_BYTES = 1 << 20            # the splicing pipe's size (pipe-max-size's default)
SOCKET_BUFFER = 4 << 20         # a unix connection's send buffer, asked for (the kernel caps it at wmem_max;
                                # TCP keeps the kernel's autotuning, which a fixed size would turn off)
CONNECT_TIMEOUT = 5.0
DATA, DONE = 1, 2
_PREFIX = struct.Struct("<BxxxIIQ")     # op, header bytes, payloads, sequence number (0: no DONE wanted)
MAX_HEADER = 64 << 20
MAX_PAYLOADS = 1 << 16
MAX_PAYLOAD = 1 << 40
_READ_AHEAD = 256 << 10         # the read-ahead buffer for prefixes, headers and small payloads
_DIRECT_MIN = 32 << 10          # a payload's rest this large is read straight into its array
_RECV_BYTES = 64 << 20          # at most this much read per pump (other connections get their turn)
# TCP: while a payload's rest of this much or more is awaited, the socket is readable only
# once this much arrived (SO_RCVLOWAT). A shaped or busy link delivers a payload in
# packet-sized pieces; woken for each, the reader spends its CPU on wake-ups (measured:
# twice ZeroMQ's CPU at 1 Gbit/s without it).
RECV_LOWAT = 256 << 10
_IOV_MAX = 512
_F_SETPIPE_SZ = 1031


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_vmsplice():
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


_VMSPLICE = _libc_vmsplice()


def splices_pages(release: str | None = None) -> bool:
    """Whether this kernel (``release``: ``uname -r``) takes spliced pages into a unix socket
    as they are (Linux 6.5+). Older ones copy them there: a plain send is then as good."""
    parts = (release or platform.release()).split(".")
    try:
        return (int(parts[0]), int(re.match(r"\d+", parts[1]).group())) >= (6, 5)
    except (IndexError, ValueError, AttributeError):
        return False


SPLICING = _VMSPLICE is not None and splices_pages()


def socket_path(address: str) -> str:
    """The path of an ``ipc://PATH`` endpoint."""
    if not address.startswith("ipc://") or len(address) <= len("ipc://"):
        raise TransportError(f"not an ipc endpoint: {address!r} (expected ipc://PATH)")
    return address[len("ipc://"):]


def stream_kind(address: str) -> str:
    """``ipc`` for an ``ipc://PATH`` endpoint, ``tcp`` for a ``tcp://HOST:PORT`` one."""
    if address.startswith("ipc://"):
        return "ipc"
    if address.startswith("tcp://"):
        return "tcp"
    raise TransportError(f"not a stream endpoint: {address!r} (expected ipc://PATH or tcp://HOST:PORT)")


def _tcp_host_port(address: str, bind: bool = False) -> tuple[str, int]:
    try:
        host, port = host_port(address, bind=bind)
    except ValueError as exc:
        raise TransportError(str(exc)) from None
    return host.strip("[]"), port


class _Splice:
    """A payload going out by vmsplice: its bytes (kept until DONE) and how far it got."""

    __slots__ = ("view", "address", "offset")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.address = np.frombuffer(view, np.uint8).ctypes.data
        self.offset = 0

    @property
    def nbytes(self) -> int:
        return self.view.nbytes - self.offset


class _Pipe:
    """The pipe a link splices through."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            self.capacity = fcntl.fcntl(self.w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            self.capacity = fcntl.fcntl(self.w, fcntl.F_GETPIPE_SZ) if hasattr(fcntl, "F_GETPIPE_SZ") else 65536

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


def new_array(nbytes: int) -> np.ndarray:
    """Where a received payload lands (MemoryError when this process cannot hold it)."""
    return np.empty(nbytes, np.uint8)


class _Incoming:
    """A DATA record being read: its header, and its payloads' arrays as they fill."""

    __slots__ = ("header", "lengths", "seq", "arrays", "got")

    def __init__(self, header: bytes, lengths: tuple, seq: int) -> None:
        self.header, self.lengths, self.seq = header, lengths, seq
        self.arrays: list[np.ndarray] = []
        self.got = 0                # bytes of the current payload (the last of ``arrays``) read

    def current(self) -> memoryview | None:
        """The current payload's array, as bytes (allocated when it starts); None when all are read."""
        if self.arrays and self.got < self.arrays[-1].nbytes:
            return memoryview(self.arrays[-1])
        while len(self.arrays) < len(self.lengths):
            self.arrays.append(new_array(self.lengths[len(self.arrays)]))
            self.got = 0
            if self.arrays[-1].nbytes:
                return memoryview(self.arrays[-1])
        return None


class StreamLink:
    """One connection: queued output (sent by ``flush``), what the peer still reads of
    ours (``kept`` until its DONE), and what arrived (``pump`` reads, ``next_message``
    hands out). A failure of the peer or the stream marks it ``broken`` and closes it.
    ``rto_min_us``: the retransmission-timeout floor of a TCP link (``tcpopts``; 0: the
    kernel's)."""

    def __init__(self, sock: socket.socket, name: str, rto_min_us: int) -> None:
        sock.setblocking(False)
        self.kind = "ipc" if sock.family == socket.AF_UNIX else "tcp"
        try:
            if self.kind == "ipc":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)    # a DONE or reply goes at once
        except OSError:
            pass
        # a lost tail waits the measured round trip, not the kernel's 200 ms (tcpopts.py)
        self.rto_min_us = set_rto_min(sock, rto_min_us) if self.kind == "tcp" else None
        self.sock, self.fd, self.name = sock, sock.fileno(), name
        self.out: deque = deque()
        self.kept: dict[int, list] = {}
        self.seq = 0
        self.splicing = SPLICING
        self.pipe: _Pipe | None = None
        self.piped = 0                  # bytes of the current splice in the pipe, not yet in the socket
        self.broken: str | None = None
        self.eof = False
        self.buf = bytearray(_READ_AHEAD)
        self.start = self.end = 0       # the unparsed bytes of ``buf``
        self.lowat = 1 if self.kind == "tcp" else 0     # the socket's SO_RCVLOWAT (0: left alone)
        self.incoming: _Incoming | None = None
        self.ready: deque = deque()     # (header, payloads) read whole

    @classmethod
    def dial(cls, address: str, rto_min_us: int, timeout: float = CONNECT_TIMEOUT) -> "StreamLink":
        """Connect to a listener at ``ipc://PATH`` or ``tcp://HOST:PORT`` (OSError when none
        is there)."""
        if stream_kind(address) == "tcp":
            sock = socket.create_connection(_tcp_host_port(address), timeout=timeout)
            return cls(sock, address, rto_min_us)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(socket_path(address))
        except BaseException:
            sock.close()
            raise
        return cls(sock, address, rto_min_us)

    # --- sending ----------------------------------------------------------------------
    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        if self.broken is not None:
            log.warning("%s: dropped a message to %s: %s", self.kind, self.name, self.broken)
            return
        parts, lengths, keep = [], [], []
        for payload in payloads:
            view = memoryview(buffer_of(payload))
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            lengths.append(view.nbytes)
            if self.splicing and view.nbytes >= SPLICE_MIN:
                parts.append(_Splice(view))
                keep.append(view)
            else:
                parts.append(view)
        if len(header) > MAX_HEADER or len(lengths) > MAX_PAYLOADS:
            raise TransportError(f"{self.kind}: a message of {len(header)} header bytes and {len(lengths)} "
                                 f"payloads is over the limits ({MAX_HEADER}, {MAX_PAYLOADS})")
        seq = 0
        if keep:
            self.seq += 1
            seq = self.seq
            self.kept[seq] = keep
        head = _PREFIX.pack(DATA, len(header), len(lengths), seq) + struct.pack(f"<{len(lengths)}Q", *lengths)
        self.out.append(memoryview(head + bytes(header)))
        self.out.extend(parts)
        self.flush()

    def flush(self) -> bool:
        """Write what the socket takes now; whether output still waits."""
        out = self.out
        while out and self.broken is None:
            try:
                if type(out[0]) is _Splice:
                    if self._splice(out[0]):
                        out.popleft()
                    continue
                views = []
                for item in first_n(out, _IOV_MAX):
                    if type(item) is _Splice:
                        break
                    views.append(item)
                sent = self.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                self.fail(f"connection lost ({exc.strerror or exc})")
                return False
            while out and type(out[0]) is not _Splice and sent >= out[0].nbytes:      # empty buffers go too
                sent -= out.popleft().nbytes
            if sent:
                out[0] = out[0][sent:]
        return bool(out) and self.broken is None

    def _splice(self, item: _Splice) -> bool:
        """Move ``item`` into the socket through the pipe: True when all of it is there,
        BlockingIOError while the socket is full. A ``vmsplice`` this process may not make
        puts the rest in ``item``'s place as a plain buffer (False), and copies from then on."""
        if self.pipe is None:
            self.pipe = _Pipe()
        pipe = self.pipe
        while True:
            if self.piped:
                moved = os.splice(pipe.r, self.fd, self.piped, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
                if moved <= 0:
                    raise OSError(errno.EPIPE, "the pipe ran dry")
                self.piped -= moved
                continue
            left = item.nbytes
            if not left:
                return True
            iov = _IoVec(item.address + item.offset, min(pipe.capacity, left))
            moved = _VMSPLICE(pipe.w, ctypes.byref(iov), 1, os.SPLICE_F_NONBLOCK)
            if moved < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err == errno.EAGAIN:
                    raise BlockingIOError(err, "the pipe is full")
                log.warning("%s: vmsplice refused (%s): sending by copy from now on", self.kind, os.strerror(err))
                self.splicing = False
                self.out[0] = item.view[item.offset:]
                return False
            item.offset += moved
            self.piped += moved

    # --- receiving --------------------------------------------------------------------
    def pump(self) -> None:
        """Flush output and read what arrived, up to ``_RECV_BYTES`` (never blocks)."""
        self.flush()
        budget = _RECV_BYTES
        while budget > 0 and self.broken is None and not self.eof and not self.ready:
            try:
                got = self._read()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.fail(f"connection lost ({exc.strerror or exc})")
                return
            if not got:
                self.eof = True         # what arrived before it is still delivered
                break
            budget -= got
        if self.lowat:
            self._watermark()
        if self.out:
            self.flush()                # the DONE records of what was read

    def _watermark(self) -> None:
        """Wake for the current payload's rest, up to ``RECV_LOWAT``, not for every piece of
        it (TCP); for anything else at its first byte. The bytes awaited are this record's,
        so they all come: an EOF or an error wakes the reader as well."""
        inc = self.incoming
        want = 1
        if inc is not None and self.start == self.end and inc.arrays and self.broken is None:
            rest = inc.arrays[-1].nbytes - inc.got
            if rest >= _DIRECT_MIN:
                want = min(rest, RECV_LOWAT)
        if want != self.lowat:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:
                self.lowat = 0          # not to be changed here: woken at every piece, as before
                return
            self.lowat = want

    def _read(self) -> int:
        """One read: straight into the current payload's array when what is left of it is
        large and nothing is buffered, else into the read-ahead buffer (then parsed)."""
        inc = self.incoming
        if inc is not None and self.start == self.end and inc.arrays \
                and inc.arrays[-1].nbytes - inc.got >= _DIRECT_MIN:
            got = self.sock.recv_into(memoryview(inc.arrays[-1])[inc.got:])
            inc.got += got
            if got:
                self._parse()
            return got
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.end < _DIRECT_MIN:
            self._compact(max(len(self.buf), self.end - self.start + _DIRECT_MIN))
        got = self.sock.recv_into(memoryview(self.buf)[self.end:])
        self.end += got
        if got:
            self._parse()
        return got

    def _compact(self, capacity: int) -> None:
        """Move the unparsed bytes to the front of a buffer of at least ``capacity`` bytes."""
        rest = self.buf[self.start:self.end]
        if capacity > len(self.buf):
            self.buf = bytearray(capacity)
        self.buf[:len(rest)] = rest
        self.start, self.end = 0, len(rest)

    def _parse(self) -> None:
        """Turn the buffered bytes into messages (and the peer's DONEs into released payloads)."""
        while self.broken is None:
            if self.incoming is None and not self._record():
                return
            inc = self.incoming
            while True:
                try:
                    view = inc.current()
                except MemoryError:
                    self.fail(f"no memory for a payload of {inc.lengths[len(inc.arrays)]} bytes")
                    return
                if view is None:
                    break
                take = min(view.nbytes - inc.got, self.end - self.start)
                if take:
                    view[inc.got:inc.got + take] = memoryview(self.buf)[self.start:self.start + take]
                    self.start += take
                    inc.got += take
                if inc.got < view.nbytes:
                    return
            self.incoming = None
            self.ready.append((inc.header, [memoryview(a) for a in inc.arrays]))
            if inc.seq:
                self.out.append(memoryview(_PREFIX.pack(DONE, 0, 0, inc.seq)))

    def _record(self) -> bool:
        """Read the next record's prefix and header from the buffer: a DONE is acted on, a
        DATA becomes ``incoming``; False while its bytes have not all arrived."""
        while True:
            avail = self.end - self.start
            if avail < _PREFIX.size:
                return False
            op, header_len, count, seq = _PREFIX.unpack_from(self.buf, self.start)
            if op == DONE:
                self.kept.pop(seq, None)
                self.start += _PREFIX.size
                continue
            if op != DATA or header_len > MAX_HEADER or count > MAX_PAYLOADS:
                self.fail(f"a malformed record (op {op}, {header_len} header bytes, {count} payloads)")
                return False
            meta = _PREFIX.size + 8 * count + header_len
            if avail < meta:
                if meta > len(self.buf) - self.start:
                    self._compact(max(meta, len(self.buf)))
                return False
            lengths = struct.unpack_from(f"<{count}Q", self.buf, self.start + _PREFIX.size)
            if any(n > MAX_PAYLOAD for n in lengths):
                self.fail(f"a payload of {max(lengths)} bytes announced")
                return False
            header = bytes(self.buf[self.start + meta - header_len:self.start + meta])
            self.start += meta
            self.incoming = _Incoming(header, lengths, seq)
            return True

    def next_message(self) -> tuple[bytes, list] | None:
        """The next message read whole; ``None`` when none (an EOF then ends the link)."""
        if self.ready:
            return self.ready.popleft()
        if self.eof and self.broken is None:
            self.fail("the peer closed the connection",
                      orderly=not self.kept and not self.out and self.incoming is None)
        return None

    @property
    def wants_write(self) -> bool:
        return self.broken is None and bool(self.out)

    @property
    def has_records(self) -> bool:
        """Messages read whole wait, or an EOF that ends the link once they are handed out."""
        return (bool(self.ready) or self.eof) and self.broken is None

    @property
    def wants_pump(self) -> bool:
        return bool(self.out) or self.has_records

    # --- the end ----------------------------------------------------------------------
    def fail(self, reason: str, orderly: bool = False) -> None:
        if self.broken is None:
            self.broken = reason
            log.log(logging.INFO if orderly else logging.WARNING, "%s: connection to %s %s: %s",
                    self.kind, self.name, "closed" if orderly else "broken", reason)
            self.close()

    def close(self) -> None:
        self.kept.clear()
        self.out.clear()
        self.ready.clear()
        self.incoming = None
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None
        self.sock.close()


class StreamChannel(LinkChannel):
    """A connection to one peer's ``ipc://PATH`` or ``tcp://HOST:PORT`` listener; replies
    come back on it. ``config``: the transport's settings (default
    ``TransportConfig.from_env()``)."""

    lends = False

    def __init__(self, address: str, timeout: float = CONNECT_TIMEOUT, config: TransportConfig | None = None) -> None:
        self.kind = stream_kind(address)
        if self.kind == "tcp":
            _tcp_host_port(address)
        else:
            socket_path(address)
        super().__init__()
        self.address = address
        self.timeout = timeout
        self.rto_min_us = (config or TransportConfig.from_env()).tcp_rto_min_us

    def _dial(self) -> StreamLink:
        return StreamLink.dial(self.address, self.rto_min_us, self.timeout)


class StreamListener(LinkListener):
    """A stream socket that many peers connect to: a unix one at ``ipc://PATH`` (removed on
    close), or TCP bound to ``tcp://HOST:PORT`` (port 0: a free one), whose ``address``
    then names ``advertise_host`` and the port bound. ``kind``, the endpoint's name in what
    a service registers: ``ipc``, or ``stream`` for TCP (``tcp`` is its ZeroMQ endpoint).
    Its connections are bounded (``config``'s ``stream_*``: a cap, a handshake deadline, an
    idle timeout for those that never became a job's channel; the arguments override them).
    ``budget``: the cap it shares with the process's other listeners (``sockpoll.LinkBudget``);
    without one it has a cap of its own, ``max_links``. ``config``: the transport's settings
    (default ``TransportConfig.from_env()``)."""

    def __init__(self, address: str, advertise_host: str | None = None, max_links: int | None = None,
                 handshake_s: float | None = None, idle_s: float | None = None,
                 budget: LinkBudget | None = None, config: TransportConfig | None = None) -> None:
        self.path: str | None = None
        config = config or TransportConfig.from_env()
        self.budget = budget if budget is not None else LinkBudget(max_links or config.stream_max_connections)
        self.handshake_s = handshake_s or config.stream_handshake_s
        self.idle_s = idle_s or config.stream_idle_s
        self.rto_min_us = config.tcp_rto_min_us
        self.kind = "stream" if stream_kind(address) == "tcp" else "ipc"
        if self.kind == "stream":
            host, port = _tcp_host_port(address, bind=True)
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            bind_to: object = (host, port)
        else:
            self.path = socket_path(address)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bind_to = self.path
        try:
            sock.bind(bind_to)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        if self.path is None:
            shown = advertise_host or host
            self.address = f"tcp://{f'[{shown}]' if ':' in shown else shown}:{sock.getsockname()[1]}"
        else:
            self.address = address
        super().__init__(sock)

    def _link_for(self, sock: socket.socket, peer: object) -> StreamLink:
        return StreamLink(sock, f"{self.path or self.address} peer {peer if self.path is None else sock.fileno()}",
                          self.rto_min_us)

    def close(self) -> None:
        super().close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
