"""The ``shm`` transport's framing: ZeroMQ ipc messages whose lent payloads stay in shared memory.

A message is ``[head, *payload frames]``, as over a plain socket. When payloads are lent,
``head`` is a descriptor followed by the header in the same frame: the descriptor is a
msgpack array with one entry per lent payload, ``[index, *reference, nbytes]``
(``shm.Segment`` references), and the frames carry the other payloads in index order. A
header never starts like a msgpack array (one that did would get an empty descriptor in
front), so the first byte tells whether a descriptor is there -- no extra frame, no extra
socket call per message. The receiver maps the sender's segment once (``SharedMemory``)
and hands the payload on as a view of it, marked lent; a reference it cannot map becomes a
``PayloadError`` in that payload's slot, so the message can still be answered with an
error naming it.
"""
from __future__ import annotations

from typing import Any, Sequence

import msgpack

from .base import PayloadError, Shared
from .shm import SharedMemory

_NO_LENT: frozenset = frozenset()
_ARRAY_STARTS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])      # msgpack fixarray, array16, array32


def _starts_array(raw: bytes) -> bool:
    return bool(raw) and raw[0] in _ARRAY_STARTS


class ShmFraming:
    """Framing for peers that share this host's memory."""

    lends = True

    def __init__(self, memory: SharedMemory) -> None:
        self.memory = memory

    def pack(self, header: bytes, payloads: Sequence) -> list:
        refs = []
        frames: list = [header]
        for index, payload in enumerate(payloads):
            if isinstance(payload, Shared):
                if payload.ref is not None:
                    refs.append([index, *payload.ref, payload.array.nbytes])
                    continue
                payload = payload.array
            frames.append(payload)
        if refs or _starts_array(header):
            frames[0] = msgpack.packb(refs) + header
        return frames

    def unpack(self, frames: list) -> tuple[Any, list, frozenset]:
        head, data = frames[0], frames[1:]
        raw = head.bytes if hasattr(head, "bytes") else bytes(head)    # a zmq.Frame keeps these bytes
        if not _starts_array(raw):
            return head, data, _NO_LENT
        unpacker = msgpack.Unpacker()
        unpacker.feed(raw)
        try:
            entries = unpacker.unpack()
        except Exception:  # msgpack raises several unrelated types
            return raw, [], _NO_LENT             # no header to find: the decoder reports it
        header = raw[unpacker.tell():]
        try:
            refs = self._refs(entries, len(data))
        except ValueError as exc:
            return header, [PayloadError(str(exc))] * (len(data) + 1), _NO_LENT
        slots: list = [None] * (len(data) + len(refs))
        for index, ref, nbytes in refs:
            slots[index] = self.memory.view(ref, nbytes)
        rest = iter(data)
        for index, slot in enumerate(slots):
            if slot is None:
                slots[index] = next(rest)
        return header, slots, frozenset(index for index, _, _ in refs)

    @staticmethod
    def _refs(entries: Any, frames: int) -> list[tuple[int, list, int]]:
        """``(index, reference, nbytes)`` of each lent payload; ``ValueError`` when malformed."""
        if not isinstance(entries, list):
            raise ValueError("malformed shared-memory descriptor")
        total = frames + len(entries)
        refs, seen = [], set()
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 8:
                raise ValueError(f"malformed shared-memory descriptor entry {entry!r}")
            index, ref, nbytes = entry[0], entry[1:7], entry[7]
            if type(index) is not int or not 0 <= index < total or index in seen \
                    or type(nbytes) is not int or nbytes < 0:
                raise ValueError(f"malformed shared-memory descriptor entry {entry!r}")
            seen.add(index)
            refs.append((index, ref, nbytes))
        return refs
