"""The transport interface: how one process hands a header and payload buffers to a peer.

AutoPS's data path (agent <-> aggregator, aggregator <-> aggregator) speaks through this
interface only, in the manner of ps-lite's ``Van``. A message is one header (bytes the
caller packed, see ``autops.wire.protocol``) plus zero or more payload buffers (tensor bytes, never
copied on the way). The kinds behind it:

* ``tcp`` (``zmq.py``): payloads travel as ZeroMQ frames;
* ``ipc`` (``stream.py``): a unix stream socket of this project's own records; large
  payloads are spliced from the sender's pages (no copy into the kernel) and read straight
  into the receiver's arrays;
* ``shm`` (``shm_channel.py`` over ``shm.py``): a same-host peer; a payload that lies in
  memory this process can lend (``Memory.allocate``) travels as a reference and the
  receiver reads it in place, every other payload as a frame.
* ``rdma`` (``rdma.py``, pyverbs; not run on hardware yet, see docs/rdma.md): a
  ``Channel``/``Listener`` pair over RC queue pairs, whose ``Memory`` registers its arrays
  as memory regions (``Shared.ref`` names the region and its rkey); every large payload
  is a one-sided READ by the receiver, the rkey travelling in the message's descriptor
  (nothing to premap). ``links.Transport`` decides which kind reaches a peer; nothing
  else in AutoPS needs to change.

Lent buffers (``Inbound.lent``) stay the sender's memory: the receiver may read them
(and, by the protocol's rules, scribble on them) only until the exchange that hands them
back completes -- for a push, until the pull of that iteration is answered.
"""
from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from typing import Any, Iterable, NamedTuple, Protocol, Sequence

import numpy as np

from dlrt.messages import ProtocolError

__all__ = ["Sender", "Shared", "PayloadError", "Inbound", "Channel", "Listener", "Memory", "PlainMemory",
           "TransportError", "buffer_of", "background_priority"]


class TransportError(ValueError):
    """A peer that cannot be reached the way it was asked for (wrong host, unknown kind)."""


class PayloadError(ProtocolError):
    """A payload the sender lent that cannot be read here (stands in its slot of ``Inbound.payloads``)."""


class Sender(Protocol):
    """Where a message can go: a connected ``Channel``, or the peer an ``Inbound`` came from."""

    def send(self, header: bytes, payloads: Sequence = ()) -> None: ...


class Shared:
    """A buffer from ``Memory.allocate``: ``array``, and ``ref`` -- where a same-host peer
    finds it (``None`` when this memory cannot be lent). Sent as a payload, it travels as a
    reference over channels that lend and as bytes over the others."""

    __slots__ = ("array", "ref")

    def __init__(self, array: np.ndarray, ref: list | None = None) -> None:
        self.array = array
        self.ref = ref


def background_priority() -> None:
    """Lowest CPU priority for the calling thread (Linux nice is per thread): memory
    population and mapping done ahead of time must not take CPU from the data path."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


def buffer_of(payload: Any) -> Any:
    """The bytes of a payload as a socket sends them (a ``Shared`` by value)."""
    return payload.array if isinstance(payload, Shared) else payload


class Inbound(NamedTuple):
    """One received message. ``payloads`` holds buffers (``zmq.Frame`` or ``memoryview``),
    or a ``PayloadError`` where a lent buffer could not be mapped; ``lent`` are the indices
    of buffers the sender lent (its memory, read in place); ``reply`` answers the sender."""
    header: Any
    payloads: list
    lent: frozenset
    reply: Sender


class Channel(ABC):
    """A connection to one peer. ``lends``: payloads given as ``Shared`` reach the peer by
    reference, so staging data in lendable memory saves the receiver a copy."""

    kind: str = ""
    lends: bool = False
    address: str = ""

    @property
    @abstractmethod
    def pollable(self) -> Any:
        """What ``zmq.Poller`` watches for incoming messages (a socket or a file descriptor)."""

    @property
    def pollables(self) -> list:
        """Everything to watch for this channel's messages (``pollable``; one socket per
        connection for a channel over several connections)."""
        return [self.pollable]

    @abstractmethod
    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        """Queue one message; payload buffers are not copied (keep them unchanged until the
        peer answered)."""

    @abstractmethod
    def recv(self) -> Inbound | None:
        """The next message, or ``None`` when none is waiting (never blocks)."""

    def open(self) -> None:
        """Connect now, ahead of the first ``send`` (a peer about to be needed); a channel
        that connects on its own (ZeroMQ's, in the background) has nothing to do. Never
        raises: a peer it cannot reach now is tried again by ``send``."""

    @abstractmethod
    def close(self) -> None: ...


class Listener(ABC):
    """A bound endpoint many peers connect to; each ``Inbound.reply`` answers its sender."""

    kind: str = ""
    address: str = ""

    @property
    @abstractmethod
    def pollable(self) -> Any: ...

    @abstractmethod
    def recv(self) -> Inbound | None: ...

    def sending(self) -> bool:
        """Whether replies wait here to be sent (their bytes not yet all handed to the
        kernel); False where the transport cannot tell (ZeroMQ keeps its queues to itself)."""
        return False

    @abstractmethod
    def close(self) -> None: ...


class Memory(ABC):
    """Buffers this process can lend to peers, and the peers' buffers it has mapped.

    A ``scope`` (a job) groups memory that is released together, both this process's own
    and what it mapped of its peers'. ``handles`` describe whole regions so that a peer can
    map them before the first message needs them (``premap``)."""

    lends: bool = False
    reserve: Any = None     # where lendable memory can be made ahead: a ``shm.SegmentReserve``

    @abstractmethod
    def allocate(self, sizes: Sequence[tuple[int, str]], scope: str, pace: Any = None) -> list[Shared]:
        """Arrays of ``(numel, dtype)``; safe to call from a helper thread. Memory populated
        ahead is populated at ``pace`` (a ``prefault.Pace``; None: at once)."""

    def slow_to_allocate(self, nbytes: int) -> bool:
        """Whether allocating ``nbytes`` costs enough page faults to do it off the serving thread."""
        return False

    def handles_of(self, buffers: Iterable[Shared]) -> list:
        """Handles of the regions holding ``buffers`` (for peers to map ahead)."""
        return []

    def mapped_handles(self, scope: str) -> list:
        """Handles of the peers' regions mapped here for ``scope``."""
        return []

    def premap(self, handles: Any) -> None:
        """Map peers' regions ahead of their first use, in a low-priority helper thread."""

    @abstractmethod
    def release(self, scope: str) -> None:
        """Free this process's buffers of ``scope`` and unmap the peers' ones."""

    def close(self) -> None:
        """Release everything."""


class PlainMemory(Memory):
    """Memory nothing can be lent from: plain arrays, sent by value."""

    def allocate(self, sizes: Sequence[tuple[int, str]], scope: str, pace: Any = None) -> list[Shared]:
        return [Shared(np.empty(numel, dtype)) for numel, dtype in sizes]

    def release(self, scope: str) -> None:
        pass
