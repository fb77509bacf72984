"""The AutoPS protocol: operation names, field schemas and the data path's records.

A message is one header -- the shared envelope of ``dlrt.messages`` (a msgpack map with
``proto``, ``v``, ``op`` and the operation's fields) -- followed by zero or more payload
buffers (tensor bytes, carried by a transport without copies, see ``autops.transport``).
This module owns the operation names, the per-operation field schema, and the records of
the data path (``PushItem``, ``PullItem``, ``PullReplyItem``, ``Move``, ``Ack``,
``InitItem``, ``KeyCopy``, ``TableEntry``): on the wire each is a short positional list,
and only this module knows the positions. Everything malformed -- an undecodable header,
a missing field, an item of the wrong shape, a payload slice outside its buffer, a number
that is not finite, a declaration over the limits -- raises ``ProtocolError``
(``VersionMismatch`` for a peer speaking another version), never another exception, so a
server loop answers it with an error instead of dying. The limits (``MAX_TENSOR_BYTES``,
``MAX_JOB_KEYS``) are checked before anything is planned or allocated: a huge count in a
small message never makes a service allocate what it asks for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, NamedTuple, Sequence

import msgpack
import numpy as np

from dlrt.messages import Protocol, ProtocolError, VersionMismatch

from .partition import KeySpec, validate_tensor

VERSION = 2    # 2: the shared dlrt envelope and named item records

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
REPLICA_PREPARE = "replica_prepare"   # to a new replica of keys (new or migrating): make their memory ready
MIGRATE_INIT = "migrate_init"         # to the old aggregator: keys to hand over
MIGRATE_DROP = "migrate_drop"         # to the old aggregator: migration complete, forget the keys
# aggregator -> aggregator
TENSOR_COPY = "tensor_copy"
# aggregator -> master
TENSOR_COPY_DONE = "tensor_copy_done"
WORKER_DONE = "worker_done"
MIGRATE_CUTOVER = "migrate_cutover"   # keys whose state went ahead: their cutovers, once decided
# admin -> master
MIGRATE = "migrate"                   # move keys of a job (operators, benchmarks)
# any -> master
STATUS = "status"
# agent -> aggregator
PUSH = "push"
PUSH_PULL = "push_pull"               # a push answered with the value of its iteration (PULL_REPLY), not an ack
PULL = "pull"
INIT = "init"
BCAST_PUT = "bcast_put"
BCAST_GET = "bcast_get"
STATE_GET = "state_get"               # server-side state of keys after an iteration (checkpoints)
WARM = "warm"                         # a move's new owner, ahead of its switch: answered with the payload
# the most a WARM carries (each way): enough to take a TCP connection through slow start and
# grow its socket buffers (32 MiB by default, ``autops.worker.agent.WARM_BYTES``)
MAX_WARM_BYTES = 64 << 20
# replies
OK = "ok"
ERROR = "error"
PUSH_ACK = "push_ack"
PULL_REPLY = "pull_reply"
REDIRECT = "redirect"
STATE_REPLY = "state_reply"           # KeyCopy items + payloads, as TENSOR_COPY
# failures (an aggregator lost): pMaster -> the aggregator taking keys over, and data-path messages
FAILOVER = "failover"                 # take over keys: recover them from the workers, or promote replicas
MIGRATE_ABORT = "migrate_abort"       # to a migration's old owner: the new one is gone, keep serving
REPLICA_SET = "replica_set"           # to an owner: replicate these keys to another aggregator (or stop)
RECOVER = "recover"                   # agent -> new owner: per key, the last iteration this rank pulled
REPLICATE = "replicate"               # owner -> replica: full state (KeyCopy) or one step's gradient


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
    REPLICA_PREPARE: {"job": _str, "secret": _str, "world_size": _int, "mode": _str, "keys": _list},
    MIGRATE_INIT: {"mid": _int, "job": _str, "to": _str, "info": _map, "keys": _list},
    MIGRATE_DROP: {"job": _str, "keys": _list},
    TENSOR_COPY: {"mid": _int, "job": _str, "secret": _str, "items": _list},
    TENSOR_COPY_DONE: {"mid": _int, "job": _str, "keys": _list},
    WORKER_DONE: {"mid": _int, "job": _str, "keys": _list},
    MIGRATE_CUTOVER: {"mid": _int, "job": _str, "cutovers": _map},
    MIGRATE: {"job": _str},
    STATUS: {},
    PUSH: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    PUSH_PULL: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    PULL: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    INIT: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    BCAST_PUT: {"job": _str, "secret": _str, "rank": _int, "name": _str, "seq": _int, "dtype": _str, "shape": _list},
    BCAST_GET: {"job": _str, "secret": _str, "rank": _int, "name": _str, "seq": _int},
    STATE_GET: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    WARM: {},
    OK: {},
    ERROR: {"message": _str},
    PUSH_ACK: {"items": _list},
    PULL_REPLY: {"items": _list},
    REDIRECT: {"items": _list},
    STATE_REPLY: {"items": _list},
    FAILOVER: {"job": _str, "secret": _str, "world_size": _int, "keys": _list},
    MIGRATE_ABORT: {"job": _str, "keys": _list},
    REPLICA_SET: {"job": _str, "keys": _list},
    RECOVER: {"job": _str, "secret": _str, "rank": _int, "items": _list},
    REPLICATE: {"job": _str, "secret": _str, "items": _list},
}

# Fields that, when present and not None, are lists of names (keys, aggregators).
NAME_LISTS: dict[str, tuple[str, ...]] = {
    MIGRATE: ("keys", "to"), MIGRATE_DROP: ("keys",), TENSOR_COPY_DONE: ("keys",), WORKER_DONE: ("keys",),
}

PROTOCOL = Protocol("autops", VERSION, error_op=ERROR)


# --- records of the data path ------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return type(value) is int        # msgpack gives plain ints; bool is not one here


def _malformed(op: str, item: Any) -> ProtocolError:
    return ProtocolError(f"{op}: malformed item {item!r}"[:300])


class Slice(NamedTuple):
    """``nbytes`` bytes at ``offset`` of the message's payload number ``payload``."""
    payload: int
    offset: int
    nbytes: int

    @classmethod
    def checked(cls, op: str, payload: Any, offset: Any, nbytes: Any) -> "Slice":
        if type(payload) is not int or type(offset) is not int or type(nbytes) is not int:
            raise ProtocolError(f"{op}: frame index, offset and size must be integers")
        return cls(payload, offset, nbytes)


class PushItem(NamedTuple):
    """One key's contribution to an iteration (PUSH): ``[key, iteration, payload, offset,
    nbytes, hp]``; ``hp``: hyper-parameters that changed (server mode) or ``None``."""
    key: str
    iteration: int
    data: Slice
    hp: dict | None = None

    def to_wire(self) -> list:
        return [self.key, self.iteration, *self.data, self.hp]

    @classmethod
    def from_wire(cls, item: Any, op: str = "push") -> "PushItem":
        if not isinstance(item, (list, tuple)) or len(item) < 5:
            raise _malformed(op, item)
        key, iteration, payload, offset, nbytes = item[:5]
        if type(key) is not str or type(iteration) is not int:
            raise ProtocolError(f"{op}: bad item for key {key!r}")
        hp = item[5] if len(item) > 5 else None
        if hp is not None and type(hp) is not dict:
            raise ProtocolError(f"{op}: hyper-parameters of {key!r} must be a map")
        return cls(key, iteration, Slice.checked(op, payload, offset, nbytes), hp)


class PullItem(NamedTuple):
    """A key's value as published after an iteration (PULL), or its server-side state then
    (STATE_GET): ``[key, iteration]``."""
    key: str
    iteration: int

    def to_wire(self) -> list:
        return [self.key, self.iteration]

    @classmethod
    def from_wire(cls, item: Any, op: str = "pull") -> "PullItem":
        if not isinstance(item, (list, tuple)) or len(item) < 2:
            raise _malformed(op, item)
        key, iteration = item[0], item[1]
        if type(key) is not str or type(iteration) is not int:
            raise ProtocolError(f"{op}: bad item {key!r}")
        return cls(key, iteration)


class Move(NamedTuple):
    """``key`` is served by aggregator ``to`` (reached through ``info``: endpoints, host,
    segments) from iteration ``first`` on. A REDIRECT item: ``[key, to, first, info]``."""
    key: str
    to: str
    first: int
    info: dict

    def to_wire(self) -> list:
        return [self.key, self.to, self.first, self.info]

    @classmethod
    def from_wire(cls, item: Any, op: str = "redirect") -> "Move":
        if not isinstance(item, (list, tuple)) or len(item) < 4 or not isinstance(item[0], str) \
                or not isinstance(item[1], str) or not _is_int(item[2]) or not isinstance(item[3], dict):
            raise ProtocolError(f"{op}: malformed migration notice {item!r}"[:300])
        return cls(item[0], item[1], item[2], item[3])


class PullReplyItem(NamedTuple):
    """The value of ``key`` after ``iteration`` in payload ``payload`` (PULL_REPLY):
    ``[key, iteration, payload]``, plus ``[to, first, info]`` of ``moved`` when the key
    migrates after this iteration (Fig. 4.5 step 2) or ``None``, plus ``offset, nbytes``
    when the value is a slice of the payload (small keys packed into one, ``pack``);
    ``nbytes`` -1: the whole payload."""
    key: str
    iteration: int
    payload: int
    moved: Move | None = None
    offset: int = 0
    nbytes: int = -1

    def to_wire(self) -> list:
        item = [self.key, self.iteration, self.payload]
        if self.moved is not None or self.nbytes >= 0:
            item.append(None if self.moved is None else self.moved.to_wire()[1:])
        if self.nbytes >= 0:
            item += [self.offset, self.nbytes]
        return item

    @classmethod
    def from_wire(cls, item: Any, op: str = "pull_reply") -> "PullReplyItem":
        if not isinstance(item, (list, tuple)) or len(item) < 3 or type(item[0]) is not str \
                or type(item[1]) is not int or type(item[2]) is not int:
            raise _malformed(op, item)
        if len(item) == 3:
            return cls(item[0], item[1], item[2])
        moved = None
        if item[3] is not None:
            if not isinstance(item[3], (list, tuple)):
                raise ProtocolError(f"{op}: malformed migration notice {item[3]!r}"[:300])
            moved = Move.from_wire([item[0], *item[3]], op)
        if len(item) < 6:
            return cls(item[0], item[1], item[2], moved)
        part = Slice.checked(op, item[2], item[4], item[5])
        return cls(item[0], item[1], item[2], moved, part.offset, part.nbytes)

    @property
    def data(self) -> Slice | None:
        """The slice of the payload holding the value (``None``: all of it)."""
        return Slice(self.payload, self.offset, self.nbytes) if self.nbytes >= 0 else None


PACK_ALIGN = 64


def pack(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Copy small arrays into one buffer (each at a ``PACK_ALIGN``-byte boundary), so that a
    batch of small keys travels as one payload instead of one frame each: the buffer, and
    the ``(offset, nbytes)`` of each array in it."""
    spans, end = [], 0
    for a in arrays:
        spans.append((end, a.nbytes))
        end += -(-a.nbytes // PACK_ALIGN) * PACK_ALIGN
    blob = np.empty(end, np.uint8)
    for a, (offset, nbytes) in zip(arrays, spans):
        blob[offset:offset + nbytes] = a.reshape(-1).view(np.uint8)
    return blob, spans


class Ack(NamedTuple):
    """A key whose push was accepted (PUSH_ACK items are the keys)."""
    key: str

    def to_wire(self) -> str:
        return self.key

    @classmethod
    def from_wire(cls, item: Any, op: str = "push_ack") -> "Ack":
        if not isinstance(item, str):
            raise _malformed(op, item)
        return cls(item)


class InitItem(NamedTuple):
    """A server-mode master copy (INIT): ``[key, payload, offset, nbytes, {"step": step,
    "state": {name: [payload, offset, nbytes]}}]``, the optimizer state under torch's names."""
    key: str
    data: Slice
    step: int | None = None
    state: dict[str, Slice] = {}

    def to_wire(self) -> list:
        extra: dict = {"step": self.step}
        if self.state:
            extra["state"] = {name: list(sl) for name, sl in self.state.items()}
        return [self.key, *self.data, extra]

    @classmethod
    def from_wire(cls, item: Any, op: str = "init") -> "InitItem":
        if not isinstance(item, (list, tuple)) or len(item) < 4 or not isinstance(item[0], str):
            raise _malformed(op, item)
        extra = item[4] if len(item) > 4 and isinstance(item[4], dict) else {}
        step = extra.get("step")
        state = extra.get("state") or {}
        if (step is not None and not _is_int(step)) or not isinstance(state, dict) or not all(
                isinstance(name, str) and isinstance(sl, (list, tuple)) and len(sl) == 3
                for name, sl in state.items()):
            raise _malformed(op, item)
        return cls(item[0], Slice.checked(op, *item[1:4]), step,
                   {name: Slice.checked(op, *sl) for name, sl in state.items()})


class KeyCopy(NamedTuple):
    """A key's server-side state (TENSOR_COPY, STATE_REPLY): ``[key, meta, count]``, its
    ``count`` arrays in the payloads that follow the previous item's."""
    key: str
    meta: dict
    count: int

    def to_wire(self) -> list:
        return [self.key, self.meta, self.count]

    @classmethod
    def from_wire(cls, item: Any, op: str = "tensor_copy") -> "KeyCopy":
        if not isinstance(item, (list, tuple)) or len(item) < 3:
            raise _malformed(op, item)
        key, meta, count = item[:3]
        if not isinstance(key, str) or not isinstance(meta, dict) or not _is_int(count) or count < 0:
            raise ProtocolError(f"{op}: malformed item for {key!r}")
        return cls(key, meta, count)


class TableEntry(NamedTuple):
    """One key of a job's assignment table (``keys`` of the replies to DECLARE and
    GET_TABLE): the key's spec, its owner, and ``(new owner, first iteration there)`` while
    it migrates -- ``[*spec, owner, [to, first] | None]``."""
    spec: KeySpec
    owner: str
    move: tuple[str, int] | None = None

    def to_wire(self) -> list:
        return [*self.spec.to_wire(), self.owner, list(self.move) if self.move else None]

    @classmethod
    def from_wire(cls, item: Any, op: str = "ok") -> "TableEntry":
        try:
            spec = KeySpec.from_wire(item)
            move = item[7] if len(item) > 7 and item[7] else None
            return cls(spec, str(item[6]), (str(move[0]), int(move[1])) if move else None)
        except (TypeError, ValueError, IndexError, KeyError):
            raise _malformed(op, item) from None


# --- limits of a declaration ----------------------------------------------------------------
MAX_TENSOR_BYTES = 1 << 40      # one declared tensor (and any one of its dimensions)
MAX_TENSOR_DIMS = 32            # numpy's limit
MAX_JOB_KEYS = 1 << 18          # aggregation keys of one job (a 1 TiB tensor in 4 MiB partitions)


def check_declared(tensors: Sequence, partition_bytes: Any, known: Container[str] = (), keys: int = 0) -> None:
    """DECLARE's ``tensors`` -- ``[name, shape, dtype(, options)]`` entries -- checked before
    pMaster plans a key or an aggregator allocates a byte: ``ProtocolError`` for a malformed
    entry, a tensor (or dimension) over ``MAX_TENSOR_BYTES``, more than ``MAX_TENSOR_DIMS``
    dimensions, or a job that would have more than ``MAX_JOB_KEYS`` keys: the ``keys`` it has
    plus those the tensors not in ``known`` would be cut into (``partition_bytes`` each)."""
    if type(partition_bytes) is not int or partition_bytes <= 0:
        raise ProtocolError(f"declare: the partition size must be a positive integer, got {partition_bytes!r}")
    total = keys
    for item in tensors:
        if not isinstance(item, (list, tuple)) or len(item) not in (3, 4):
            raise ProtocolError(f"declare: malformed tensor entry {item!r}"[:300])
        try:
            name, shape, dtype = validate_tensor(*item[:3])
        except ValueError as exc:
            raise ProtocolError(f"declare: {exc}"[:300]) from None
        itemsize = np.dtype(dtype).itemsize
        numel = math.prod(shape)
        if len(shape) > MAX_TENSOR_DIMS or any(d > MAX_TENSOR_BYTES for d in shape) \
                or numel * itemsize > MAX_TENSOR_BYTES:
            raise ProtocolError(f"declare: tensor {name!r} of shape {list(shape)} {dtype} is over the limit "
                                f"of {MAX_TENSOR_DIMS} dimensions and {MAX_TENSOR_BYTES} bytes"[:300])
        if name not in known:
            per_key = max(1, partition_bytes // itemsize)
            total += math.ceil(numel / per_key) if numel * itemsize > partition_bytes else 1
    if total > MAX_JOB_KEYS:
        raise ProtocolError(f"declare: the job would have {total} keys, more than {MAX_JOB_KEYS}; "
                            "declare fewer or larger partitions")


# --- messages ---------------------------------------------------------------------------
@dataclass
class Message:
    """A decoded message: ``op``, its fields, its payload buffers, and which payloads the
    sender lent (its shared memory, read in place; see ``autops.transport``)."""
    op: str
    fields: dict[str, Any]
    payloads: Sequence = field(default_factory=list)
    lent: frozenset = frozenset()

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def items(self, record: Any) -> list:
        """The ``items`` field as records of type ``record`` (validated)."""
        return [record.from_wire(item, self.op) for item in self.fields.get("items") or ()]

    def view(self, index: int) -> memoryview:
        """Payload ``index`` without copying."""
        if type(index) is not int or not 0 <= index < len(self.payloads):
            raise ProtocolError(f"{self.op}: payload frame {index} missing")
        buf = self.payloads[index]
        if isinstance(buf, BaseException):     # a lent buffer the transport could not map
            raise ProtocolError(f"{self.op}: payload {index}: {buf}")
        return buf.buffer if hasattr(buf, "buffer") else memoryview(buf)

    def array(self, data: Slice, dtype: str) -> np.ndarray:
        """The ``dtype`` elements of a payload slice, without copying."""
        buf = self.view(data.payload)
        itemsize = np.dtype(dtype).itemsize
        offset, nbytes = data.offset, data.nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > buf.nbytes or nbytes % itemsize:
            raise ProtocolError(f"{self.op}: payload slice [{offset}, {offset + nbytes}) outside a "
                                f"{buf.nbytes}-byte frame or not a whole number of {dtype}")
        return np.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset)

    def whole(self, index: int, dtype: Any) -> np.ndarray:
        """Payload ``index`` as an array of ``dtype``, without copying."""
        try:
            return np.frombuffer(self.view(index), dtype=dtype)
        except ValueError as exc:
            raise ProtocolError(f"{self.op}: payload {index}: {exc}") from None


def header(op: str, **fields: Any) -> bytes:
    """The header of one message (what a transport sends before the payloads)."""
    return PROTOCOL.pack(op, fields)


def encode(op: str, payloads: Sequence = (), **fields: Any) -> list:
    """Frames for one message: header bytes then the payload buffers (not copied)."""
    return [PROTOCOL.pack(op, fields), *payloads]


def error(message: str, **fields: Any) -> list:
    return encode(ERROR, message=message, **fields)


def parse(head: Any, payloads: Sequence = (), lent: frozenset = frozenset()) -> Message:
    """Decode and validate one header (bytes or ``zmq.Frame``) with its payloads; raises
    ProtocolError when malformed."""
    try:
        op, fields = PROTOCOL.unpack(head)
    except VersionMismatch:
        raise
    except ProtocolError as exc:
        raise _refused(head, exc) from None
    schema = SCHEMA.get(op)
    if schema is None:
        raise ProtocolError(f"unknown operation {op!r}")
    for name, types in schema.items():
        if name not in fields:
            raise ProtocolError(f"{op}: missing field {name!r}")
        value = fields[name]
        if not isinstance(value, types) or (types is _int and isinstance(value, bool)):
            raise ProtocolError(f"{op}: field {name!r} has the wrong type {type(value).__name__}")
    for name, value in fields.items():
        if type(value) is float and not math.isfinite(value):
            raise ProtocolError(f"{op}: field {name!r} is not a finite number: {value!r}")
    for name in NAME_LISTS.get(op, ()):
        value = fields.get(name)
        if value is not None and not (isinstance(value, list) and all(type(v) is str for v in value)):
            raise ProtocolError(f"{op}: field {name!r} must be a list of names"[:300])
    return Message(op, fields, payloads, lent)


def decode(frames: Sequence) -> Message:
    """Parse and validate frames (bytes or zmq.Frame); raises ProtocolError when malformed."""
    if not frames:
        raise ProtocolError("empty message")
    return parse(frames[0], list(frames[1:]))


def _refused(head: Any, exc: ProtocolError) -> ProtocolError:
    """Say which part of a header the envelope refused (the error path only)."""
    try:
        obj = msgpack.unpackb(head.bytes if hasattr(head, "bytes") else bytes(head), raw=False,
                              strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types
        return ProtocolError(f"undecodable header: {exc}")
    if not isinstance(obj, dict):
        return ProtocolError(f"header is not a map: {exc}")
    return exc


def payload_view(frame: Any) -> memoryview:
    """A view of one payload buffer without copying."""
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
    """The ``KeyCopy`` items of a TENSOR_COPY or STATE_REPLY, each with its ``count``
    payload buffers (which follow each other in item order)."""
    first = 0
    for copy in msg.items(KeyCopy):
        if first + copy.count > len(msg.payloads):
            raise ProtocolError(f"{msg.op}: malformed item for {copy.key!r}")
        yield copy.key, copy.meta, [msg.view(i) for i in range(first, first + copy.count)]
        first += copy.count


# --- records of failure handling ---------------------------------------------------------
class RecoverItem(NamedTuple):
    """RECOVER: ``[key, last pulled]`` -- the last iteration of ``key`` whose pull this rank got
    answered (0 before any) --, plus ``payload, offset, nbytes`` of the value this rank pulled
    then, when it kept it. The new owner of a lost ``sum``-mode key starts after the largest
    iteration whose value a rank gave, else after the smallest reported."""
    key: str
    pulled: int
    value: Slice | None = None

    def to_wire(self) -> list:
        return [self.key, self.pulled] if self.value is None else [self.key, self.pulled, *self.value]

    @classmethod
    def from_wire(cls, item: Any, op: str = "recover") -> "RecoverItem":
        if not isinstance(item, (list, tuple)) or len(item) not in (2, 5) or type(item[0]) is not str \
                or not _is_int(item[1]) or item[1] < 0:
            raise _malformed(op, item)
        value = Slice.checked(op, *item[2:5]) if len(item) == 5 else None
        return cls(item[0], item[1], value)


class StepItem(NamedTuple):
    """REPLICATE of kind ``step``: the averaged gradient that completed ``iteration`` of
    ``key`` (payload ``payload``) and the hyper-parameters it was applied with:
    ``[key, iteration, payload, hp]``. The replica applies the same optimizer step."""
    key: str
    iteration: int
    payload: int
    hp: dict

    def to_wire(self) -> list:
        return [self.key, self.iteration, self.payload, self.hp]

    @classmethod
    def from_wire(cls, item: Any, op: str = "replicate") -> "StepItem":
        if not isinstance(item, (list, tuple)) or len(item) < 4 or type(item[0]) is not str \
                or not _is_int(item[1]) or not _is_int(item[2]) or not isinstance(item[3], dict):
            raise _malformed(op, item)
        return cls(item[0], item[1], item[2], item[3])
