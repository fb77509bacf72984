"""The envelope every control message of the runtime travels in, and its errors.

A message is one msgpack map ``{"proto": NAME, "v": VERSION, "op": OP, <fields>...}``.
Each system defines its own operations and field schemas on top (``autops.wire.protocol``,
``infiniswap.protocol``); this module owns what they share: packing and unpacking the
envelope, the version check, and the error types. Anything that is not a valid envelope
raises ``ProtocolError`` -- never another exception -- so a server loop never dies on a
bad peer; a peer speaking another version of the protocol gets ``VersionMismatch``, whose
text says both versions, instead of a decode failure. Error replies are readable across
versions, so that text reaches the other side too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import msgpack

__all__ = ["ProtocolError", "VersionMismatch", "Protocol"]

_ENVELOPE = ("proto", "v", "op")


class ProtocolError(ValueError):
    """Bytes that are not a valid message of the protocol this side speaks."""


class VersionMismatch(ProtocolError):
    """A well-formed message of another version of this protocol."""

    def __init__(self, protocol: str, ours: int, theirs: Any) -> None:
        super().__init__(f"unsupported protocol version {theirs!r}: the peer speaks {protocol} "
                         f"protocol v{theirs}, this side speaks v{ours}; run the same release on both sides")
        self.protocol, self.ours, self.theirs = protocol, ours, theirs


@dataclass(frozen=True)
class Protocol:
    """One protocol's name and version, and the operation its error replies use (an error
    reply of any version is accepted, so a version mismatch can be reported to the peer)."""
    name: str
    version: int
    error_op: str | None = None

    def pack(self, op: str, fields: Mapping[str, Any]) -> bytes:
        """The envelope for ``op`` with ``fields`` (which must not use the envelope's keys)."""
        return msgpack.packb({"proto": self.name, "v": self.version, "op": op, **fields},
                             use_bin_type=True)

    def unpack(self, data: Any) -> tuple[str, dict[str, Any]]:
        """``(op, fields)`` of one envelope; ``ProtocolError`` (or ``VersionMismatch``) when
        ``data`` is not a message of this protocol and version. ``op`` is not checked
        against any schema here."""
        if hasattr(data, "bytes"):            # a zmq.Frame
            data = data.bytes
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"not msgpack: expected bytes, got {type(data).__name__}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated types (ExtraData, ValueError, ...)
            raise ProtocolError(f"not msgpack: {exc.__class__.__name__}: {exc}"[:200]) from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"not a dict: the message is a msgpack {type(obj).__name__}, expected a map")
        proto = obj.get("proto", self.name)
        if proto != self.name:
            raise ProtocolError(f"not a {self.name} message (protocol {proto!r})")
        if "v" not in obj:
            raise ProtocolError("missing protocol version 'v'")
        if "op" not in obj:
            raise ProtocolError("missing 'op'")
        version, op = obj["v"], obj["op"]
        if not isinstance(op, str):
            raise ProtocolError(f"unknown op {op!r}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ProtocolError(f"unsupported protocol version {version!r} (not an integer)")
        if version != self.version and op != self.error_op:
            raise VersionMismatch(self.name, self.version, version)
        for key in _ENVELOPE:
            obj.pop(key, None)
        return op, obj
