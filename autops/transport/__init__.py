"""AutoPS's transports behind one small interface (``base``), in the manner of ps-lite's ``Van``.

``Transport`` (``links``) gives a process its listeners, a ``Channel`` to each peer --
ZeroMQ tcp or ipc (``zmq``), or same-host shared memory (``shm``, ``shm_channel``),
chosen in one place -- and the ``Memory`` whose buffers a channel may lend by reference;
RDMA (``rdma``, pyverbs) behind the same interface, asked for explicitly (see ``base``).
"""
from __future__ import annotations

from .base import (Channel, Inbound, Listener, Memory, PayloadError, Sender, Shared, TransportError,
                   background_priority)
from .links import TRANSPORTS, Transport, settings_from_env
from .zmq import make_context

__all__ = ["Channel", "Inbound", "Listener", "Memory", "PayloadError", "Sender", "Shared", "Transport",
           "TransportError", "TRANSPORTS", "background_priority", "make_context", "settings_from_env"]
