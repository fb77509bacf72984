"""Message framing shared by agent, aggregator and master.

A message is a ZeroMQ multipart message: one small msgpack header frame followed by
zero or more raw payload frames (tensor bytes, sent and received without copies).
The header is a map with the protocol version ``v``, the operation ``op`` and the
operation's fields. This module owns the operation names, the per-operation field
schema and the validation that turns any malformed input into a ``ProtocolError``
(never an unhandled exception in a server loop).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import msgpack

VERSION = 1

# --- operations -------------------------------------------------------------------
# agent -> master
REGISTER_JOB = "register_job"
DECLARE = "declare"
GET_TABLE = "get_table"
JOB_DONE = "job_done"
# aggregator -> master
REGISTER_AGG = "register_agg"
HEARTBEAT = "heartbeat"
# agent -> master (fire and forget, one per profiling period)
PROFILE = "profile"
# master -> aggregator
ASSIGN = "assign"
RELEASE_JOB = "release_job"
CYCLE = "cycle"                       # execution cycle of the jobs packed on an aggregator
MIGRATE_PREPARE = "migrate_prepare"   # to the new aggregator: keys to expect
MIGRATE_INIT = "migrate_init"         # to the old aggregator: keys to hand over
MIGRATE_DROP = "migrate_drop"         # to the old aggregator: migration complete, forget the keys
# aggregator -> aggregator
TENSOR_COPY = "tensor_copy"
# aggregator -> master
TENSOR_COPY_DONE = "tensor_copy_done"
WORKER_DONE = "worker_done"
# admin -> master
MIGRATE = "migrate"                   # move keys of a job (operators, benchmarks)
# any -> master
STATUS = "status"
# agent -> aggregator
PUSH = "push"
PULL = "pull"
INIT = "init"
BCAST_PUT = "bcast_put"
BCAST_GET = "bcast_get"
STATE_GET = "state_get"               # server-side state of keys after an iteration (checkpoints)
# replies
OK = "ok"
ERROR = "error"
PUSH_ACK = "push_ack"
PULL_REPLY = "pull_reply"
REDIRECT = "redirect"
STATE_REPLY = "state_reply"           # items [key, meta, count] + frames, as TENSOR_COPY

_int = (int,)
_str = (str,)
_list = (list, tuple)
_map = (dict,)

# Required fields and their types per operation. Extra fields are allowed (forward compatible).
SCHEMA: dict[str, dict[str, tuple]] = {
    REGISTER_JOB: {"job": _str, "world_size": _int, "rank": _int, "num_aggregators": _int, "mode": _str},
    DECLARE: {"job": _str, "secret": _str, "tensors": _list},
    GET_TABLE: {"job": _str, "secret": _str},
    JOB_DONE: {"job": _str, "secret": _str, "rank": _int},
    REGISTER_AGG: {"endpoints": _map, "host": _str, "pid": _int},
    HEARTBEAT: {"agg": _str},
    ASSIGN: {"job": _str, "secret": _str, "world_size": _int, "mode": _str, "keys": _list},
    RELEASE_JOB: {"job": _str},
    PROFILE: {"job": _str, "secret": _str, "rank": _int, "iteration": _int, "count": _int},
    CYCLE: {"jobs": _map},
    MIGRATE_PREPARE: {"mid": _int, "job": _str, "secret": _str, "world_size": _int, "mode": _str, "keys": _list},
    MIGRATE_INIT: {"mid": _int, "job": _str, "to": _str, "info": _map, "keys": _list},
    MIGRATE_DROP: {"job": _str, "keys": _list},
    TENSOR_COPY: {"mid": _int, "job": _str, "secret": _str, "items": _list},
    TENSOR_COPY_DONE: {"mid": _int, "job": _str, "keys": _list},
    WORKER_DONE: {"mid": _int, "job": _str, "keys": _list},
    MIGRATE: {"job": _str},
    STATUS: {},
    PUSH: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    PULL: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    INIT: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    BCAST_PUT: {"job": _str, "secret": _str, "rank": _int, "name": _str, "seq": _int, "dtype": _str, "shape": _list},
    BCAST_GET: {"job": _str, "secret": _str, "rank": _int, "name": _str, "seq": _int},
    STATE_GET: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    OK: {},
    ERROR: {"message": _str},
    PUSH_ACK: {"items": _list},
    PULL_REPLY: {"items": _list},
    REDIRECT: {"items": _list},
    STATE_REPLY: {"items": _list},
}


class ProtocolError(ValueError):
    """A message that cannot be decoded or does not follow the schema."""


@dataclass
class Message:
    op: str
    fields: dict[str, Any]
    payloads: list = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def encode(op: str, payloads: Sequence = (), **fields: Any) -> list:
    """Frames for one message: header bytes then the payload buffers (not copied)."""
    header = dict(fields)
    header["v"] = VERSION
    header["op"] = op
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def decode(frames: Sequence) -> Message:
    """Parse and validate frames (bytes or zmq.Frame); raises ProtocolError when malformed."""
    if not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    raw = head.bytes if hasattr(head, "bytes") else bytes(head)
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable header: {exc.__class__.__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    version = header.pop("v", None)
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this side speaks {VERSION})")
    op = header.pop("op", None)
    if op not in SCHEMA:
        raise ProtocolError(f"unknown operation {op!r}")
    for name, types in SCHEMA[op].items():
        if name not in header:
            raise ProtocolError(f"{op}: missing field {name!r}")
        value = header[name]
        if not isinstance(value, types) or (types is _int and isinstance(value, bool)):
            raise ProtocolError(f"{op}: field {name!r} has the wrong type {type(value).__name__}")
    return Message(op, header, list(frames[1:]))


def error(message: str, **fields: Any) -> list:
    return encode(ERROR, message=message, **fields)


def payload_view(frame: Any) -> memoryview:
    """A read-only view of one payload frame without copying."""
    if hasattr(frame, "buffer"):
        return frame.buffer
    return memoryview(frame)


def items_of(msg: Message, width: int) -> Iterable[list]:
    """Validate that ``items`` is a list of lists of at least ``width`` entries."""
    for item in msg.fields["items"]:
        if not isinstance(item, (list, tuple)) or len(item) < width:
            raise ProtocolError(f"{msg.op}: malformed item {item!r}")
        yield item


def key_copies(msg: Message) -> Iterable[tuple[str, dict, list]]:
    """The ``[key, meta, count]`` items of a TENSOR_COPY or STATE_REPLY, each with its
    ``count`` payload frames (which follow each other in item order)."""
    frame = 0
    for item in items_of(msg, 3):
        key, meta, count = item[:3]
        if not isinstance(key, str) or not isinstance(meta, dict) or not isinstance(count, int) \
                or isinstance(count, bool) or count < 0 or frame + count > len(msg.payloads):
            raise ProtocolError(f"{msg.op}: malformed item for {key!r}")
        yield key, meta, msg.payloads[frame:frame + count]
        frame += count
