"""The ``rdma`` transport's wire layout: the records its connection socket carries.

An ``rdma`` connection is one TCP stream (the control path) next to one RC queue pair
(the data path). The stream carries records; the bulk bytes of large payloads never
travel on it -- the receiver fetches them with one-sided RDMA READs from the sender's
registered memory. This module owns the bytes of those records and nothing else (pure:
no sockets, no verbs), so every layout rule is unit-tested without hardware.

A record is ``u32 length | u8 op | body`` (little endian; ``length`` counts op and body):

* ``HELLO`` -- the first record each side sends: a msgpack map, ``ConnInfo`` (what the
  peer needs to move its queue pair to RTR/RTS: QP number, PSN, LID, GID, MTU).
* ``DATA`` -- one message: ``u64 seq | u32 header length | u16 count | count x descriptor |
  header | inline payload bytes``, a descriptor being ``u8 where | u64 nbytes | u64 addr |
  u32 rkey``. ``where`` is ``INLINE`` (the bytes follow the header, in descriptor order;
  ``addr`` and ``rkey`` are 0) or ``REMOTE`` (READ ``nbytes`` at ``addr`` with ``rkey``).
* ``DONE`` -- ``u64 seq``: the receiver has read every remote payload of message ``seq``;
  the sender may reuse that memory (and drops what it kept alive for it).

Anything malformed raises ``LayoutError`` (a ``ProtocolError``) naming what is wrong.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import msgpack

from dlrt.messages import ProtocolError

__all__ = ["LayoutError", "ConnInfo", "Descriptor", "Data", "RecordReader", "HELLO", "DATA", "DONE",
           "INLINE", "REMOTE", "INLINE_MAX", "MAX_RECORD", "encode_hello", "decode_hello", "encode_data",
           "decode_data", "encode_done", "decode_done", "VERSION"]

VERSION = 1
HELLO, DATA, DONE = 1, 2, 3
INLINE, REMOTE = 0, 1
INLINE_MAX = 64 << 10          # payloads up to this many bytes travel inline, on the stream
MAX_RECORD = 1 << 30           # a larger length prefix is taken as a corrupt stream
MAX_PAYLOADS = 0xFFFF

_PREFIX = struct.Struct("<IB")            # length, op
_DATA_HEAD = struct.Struct("<QIH")        # seq, header length, count
_DESCRIPTOR = struct.Struct("<BQQI")      # where, nbytes, addr, rkey
_DONE = struct.Struct("<Q")               # seq
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


class LayoutError(ProtocolError):
    """Bytes on an ``rdma`` connection that are not a valid record."""


# --- HELLO ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConnInfo:
    """What one side of a connection tells the other to connect its queue pair."""
    qpn: int                   # queue pair number (24 bits)
    psn: int                   # first packet sequence number (24 bits)
    lid: int = 0               # port LID (InfiniBand; 0 on RoCE)
    gid: str = ""              # GID as 8 groups of 4 hex digits ("" when not routed globally)
    mtu: int = 0               # ibv_mtu enum of the port (1..5); the smaller of both is used
    device: str = ""           # for error messages only

    def to_wire(self) -> dict[str, Any]:
        return {"v": VERSION, "qpn": self.qpn, "psn": self.psn, "lid": self.lid, "gid": self.gid,
                "mtu": self.mtu, "device": self.device}

    @classmethod
    def from_wire(cls, obj: Any) -> "ConnInfo":
        if not isinstance(obj, dict):
            raise LayoutError("rdma HELLO: not a map")
        if obj.get("v") != VERSION:
            raise LayoutError(f"rdma HELLO: the peer speaks layout version {obj.get('v')!r}, this "
                              f"side {VERSION}; run the same release on both sides")
        limits = {"qpn": 0xFFFFFF, "psn": 0xFFFFFF, "lid": 0xFFFF, "mtu": 5}
        values = {}
        for name, top in limits.items():
            value = obj.get(name)
            if type(value) is not int or not 0 <= value <= top:
                raise LayoutError(f"rdma HELLO: field {name!r} must be an integer in 0..{top}, got {value!r}")
            values[name] = value
        for name in ("gid", "device"):
            value = obj.get(name)
            if not isinstance(value, str) or len(value) > 64:
                raise LayoutError(f"rdma HELLO: field {name!r} must be a short string, got {value!r}")
            values[name] = value
        return cls(**values)


def encode_hello(info: ConnInfo) -> bytes:
    body = msgpack.packb(info.to_wire(), use_bin_type=True)
    return _PREFIX.pack(len(body) + 1, HELLO) + body


def decode_hello(body: Any) -> ConnInfo:
    try:
        obj = msgpack.unpackb(bytes(body), raw=False)
    except Exception:  # msgpack raises several unrelated types
        raise LayoutError("rdma HELLO: not msgpack") from None
    return ConnInfo.from_wire(obj)


# --- DATA -------------------------------------------------------------------------------

class Descriptor(NamedTuple):
    """Where one payload of a ``DATA`` record is: inline, or ``nbytes`` at ``addr``/``rkey``."""
    where: int
    nbytes: int
    addr: int = 0
    rkey: int = 0

    @classmethod
    def inline(cls, nbytes: int) -> "Descriptor":
        return cls(INLINE, nbytes)

    @classmethod
    def remote(cls, nbytes: int, addr: int, rkey: int) -> "Descriptor":
        return cls(REMOTE, nbytes, addr, rkey)


class Data(NamedTuple):
    """A decoded ``DATA`` record: payloads hold a view of the inline bytes, or ``None``
    where the descriptor says ``REMOTE`` (the receiver READs those)."""
    seq: int
    header: memoryview
    descriptors: list[Descriptor]
    payloads: list


def _check_descriptor(d: Descriptor) -> None:
    if d.where == INLINE:
        if not 0 <= d.nbytes <= INLINE_MAX or d.addr or d.rkey:
            raise LayoutError(f"rdma DATA: malformed inline descriptor {tuple(d)}")
    elif d.where == REMOTE:
        if not (0 < d.nbytes <= _U64 and 0 < d.addr <= _U64 and d.addr + d.nbytes - 1 <= _U64
                and 0 <= d.rkey <= _U32):
            raise LayoutError(f"rdma DATA: malformed remote descriptor {tuple(d)}")
    else:
        raise LayoutError(f"rdma DATA: descriptor kind {d.where!r} is neither inline nor remote")


def encode_data(seq: int, header: Any, descriptors: Sequence[Descriptor], inline: Sequence[Any]) -> list:
    """The buffers of one ``DATA`` record (memoryviews, to send in order, e.g. with
    ``sendmsg``): prefix and fixed part, header, then the inline payloads -- not copied.
    ``inline`` holds the bytes of the ``INLINE`` descriptors, in order."""
    if len(descriptors) > MAX_PAYLOADS:
        raise LayoutError(f"rdma DATA: {len(descriptors)} payloads, at most {MAX_PAYLOADS}")
    views = [memoryview(buf).cast("B") for buf in inline]
    sizes = [d.nbytes for d in descriptors if d.where == INLINE]
    if sizes != [v.nbytes for v in views]:
        raise LayoutError("rdma DATA: the inline payloads do not match their descriptors")
    for d in descriptors:
        _check_descriptor(d)
    head = memoryview(header).cast("B")
    fixed = bytearray(_DATA_HEAD.pack(seq, head.nbytes, len(descriptors)))
    for d in descriptors:
        fixed += _DESCRIPTOR.pack(*d)
    length = 1 + len(fixed) + head.nbytes + sum(sizes)
    if length > MAX_RECORD:
        raise LayoutError(f"rdma DATA: a record of {length} bytes is over the {MAX_RECORD}-byte limit")
    return [memoryview(_PREFIX.pack(length, DATA) + bytes(fixed)), head, *views]


def decode_data(body: Any) -> Data:
    view = memoryview(body).cast("B")
    if view.nbytes < _DATA_HEAD.size:
        raise LayoutError("rdma DATA: truncated")
    seq, header_len, count = _DATA_HEAD.unpack_from(view)
    pos = _DATA_HEAD.size
    end_of_descriptors = pos + count * _DESCRIPTOR.size
    if end_of_descriptors > view.nbytes:
        raise LayoutError("rdma DATA: truncated descriptors")
    descriptors = []
    for _ in range(count):
        d = Descriptor(*_DESCRIPTOR.unpack_from(view, pos))
        _check_descriptor(d)
        descriptors.append(d)
        pos += _DESCRIPTOR.size
    header = view[pos:pos + header_len]
    pos += header_len
    payloads: list = []
    for d in descriptors:
        if d.where == INLINE:
            payloads.append(view[pos:pos + d.nbytes])
            pos += d.nbytes
        else:
            payloads.append(None)
    if pos != view.nbytes:
        raise LayoutError(f"rdma DATA: {view.nbytes} bytes, the descriptors account for {pos}")
    return Data(seq, header, descriptors, payloads)


# --- DONE -------------------------------------------------------------------------------

def encode_done(seq: int) -> bytes:
    return _PREFIX.pack(1 + _DONE.size, DONE) + _DONE.pack(seq)


def decode_done(body: Any) -> int:
    view = memoryview(body).cast("B")
    if view.nbytes != _DONE.size:
        raise LayoutError(f"rdma DONE: {view.nbytes} bytes, expected {_DONE.size}")
    return _DONE.unpack(view)[0]


# --- the stream -------------------------------------------------------------------------

class RecordReader:
    """Splits the bytes of a stream into records: ``feed`` what arrived, then call ``next()``
    until it returns ``None``; each record is ``(op, body)``, body a view of its own bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: Any) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def next(self) -> tuple[int, memoryview] | None:
        buf = self._buf
        if len(buf) < _PREFIX.size:
            return None
        length, op = _PREFIX.unpack_from(buf)
        if not 1 <= length <= MAX_RECORD or op not in (HELLO, DATA, DONE):
            raise LayoutError(f"rdma stream: record of length {length} and op {op} (corrupt stream?)")
        end = 4 + length
        if end > len(buf):
            return None
        with memoryview(buf) as whole:
            body = bytes(whole[_PREFIX.size:end])
        del buf[:end]
        return op, memoryview(body)
