"""Infiniswap control messages between block devices and daemons (thesis §2.6.1).

This module owns the message names, their fields (one ``SCHEMA`` table), the msgpack
encoding, and the validation that turns any malformed input into a ``ProtocolError``
-- never another exception -- so a daemon or device loop never dies on a bad peer.

Wire format: the shared envelope of ``dlrt.messages``, one msgpack map
``{"proto": "infiniswap", "v": 2, "op": <name>, <fields>...}``. ``id`` (optional,
non-negative int) is allowed on every message: a request may carry one and the reply
echoes it (``reply_to``), so requests in both directions can share one connection.
Unknown fields are rejected (a typo is an error, not silently ignored).

The eight messages of the paper, then the few extras this control plane needs::

  op              sender -> receiver   fields                                          reply
  QUERY_MEM       device -> daemon     (none)                                          FREE_MEM
  FREE_MEM        daemon -> device     free_bytes, slab_size, slabs_free,              --
                                       slabs_mapped, host_id
  MAP             device -> daemon     device_id, slab, [slab_size]                    MR_INFO | ERROR
  MR_INFO         daemon -> device     slab, region, size, generation, host_id, host,  --
                                       data_port (int|None), shm_path (str|None)
  CHECK_ACTIVITY  daemon -> device     slabs                                           ACTIVITY
  ACTIVITY        device -> daemon     activity {slab: A(s)}                           --
  EVICT           daemon -> device     slabs                                           DONE
  DONE            device -> daemon     slabs (after EVICT: unmapped and drained;       --
                  daemon -> device      after UNMAP: released)
  UNMAP           device -> daemon     device_id, slabs, [shm_read, shm_written]       DONE
  PING            either -> either     [shm_read, shm_written] (device -> daemon)      PONG
  PONG            either -> either     [instance], [slabs]                             --
  STATUS          tool -> either       (none)                                          REPORT
  REPORT          either -> tool       report {str: any}                               --
  ERROR           either -> either     reason, [code]                                  --
  RDMA_CONNECT    device -> daemon     device_id, qp                                   RDMA_ACCEPT | ERROR
  RDMA_ACCEPT     daemon -> device     qp, capacity, [instance]                        --

Field meanings:

* ``free_bytes``: bytes the daemon can give to new slabs now (its unmapped preallocated
  slabs plus what it may still allocate above HeadRoom) -- what placement compares;
  ``slab_size``: the daemon's SlabSize in bytes; ``slabs_free`` / ``slabs_mapped``: slab
  counts (also the daemon's utilization report); ``host_id``: ``dlrt.hostid.host_id()`` of the
  daemon's machine, so a device uses shared memory only when it is equal to its own.
* ``device_id``: a device's cluster-unique name; ``slab``/``slabs``: slab indices in that
  device's address space (the daemon keys its slabs by ``(device_id, slab)``).
* ``region``: byte offset of the slab in the daemon's slab memory; ``size``: its length;
  ``generation``: the lease's generation, which the device names on every access to the
  region (the daemon's fence refuses it once the daemon took the slab back);
  ``shm_path``: a path the device can open to map that memory on the same host
  (e.g. ``/proc/<pid>/fd/<n>``), else ``None``; ``host``/``data_port``: the daemon's TCP
  data server (``data_port`` ``None`` when it runs none).
* ``activity``: slab index -> EWMA page I/O rate ``A(s)`` (pages/s) for the slabs asked about.
* ``instance`` (optional on FREE_MEM, MR_INFO, PONG): a daemon's incarnation id, new each
  time a daemon starts, so a device notices a restart behind the same address (its slabs
  there are gone) and never mixes up the shared memory of two incarnations.
* ``shm_read`` / ``shm_written`` (optional on PING and UNMAP, both or neither, device ->
  daemon): the bytes this device has read from / written to the daemon's memory over
  shared memory so far (since it mapped that memory), which the daemon's CPU never sees;
  the daemon adds them to what it served (its TCP data server counts its own).
* ``slabs`` on a daemon's PONG: the slabs the daemon holds for the device that pinged it,
  so both sides can reconcile (a slab the daemon dropped is unmapped by the device; a slab
  the device does not use there is given back with UNMAP).
* ``report``: a status snapshot (``Daemon.stats()`` / ``Device.stats()``) for
  ``infiniswap status``; a msgpack map with string keys holding plain values (finite
  numbers only).
* Cluster-key proofs (``infiniswap/ctlauth.py``; docs/infiniswap.md, "Security"), all hex
  strings: ``challenge`` (optional on FREE_MEM, PONG and ERROR): the daemon's nonce for this
  device, until it answered it; ``proof`` on MAP: the device's answer to it (a daemon
  refuses MAP and RDMA_CONNECT -- which may carry the same ``proof`` -- with ERROR
  ``unauthenticated`` from a device that never answered);
  ``nonce`` on MAP: the device's own challenge, which the daemon answers with ``proof`` on
  MR_INFO over the lease and the memory it offers -- the device uses that memory only when
  the proof holds.
* ``reason``: human-readable text; ``code``: a short machine-readable tag
  (e.g. ``"no_memory"`` when MAP finds the memory already gone, ``"bad_request"``).
* RDMA (``docs/rdma.md``): ``rdma_addr`` / ``rdma_rkey`` (optional on MR_INFO, both or
  neither; a daemon started with ``--transport rdma`` sends them): where the slab lies in
  the daemon's memory and the rkey of the memory region it registered for this lease --
  the rkey is the lease, deregistered before the daemon takes the slab back.  ``qp``: one
  side's RC queue-pair address, a map of exactly ``QP_FIELDS`` (qpn and psn < 2**24,
  lid < 2**16, mtu an ``enum ibv_mtu`` 1..5, global 0/1, gid 16 bytes).  ``capacity``: the
  bytes of the daemon's slab memory (its RDMA remote's slots are ``capacity / slab_size``).
  The queue pair is per device and daemon, not per slab, so it gets its own exchange,
  once, before the device's first one-sided access (the first MR_INFO with an rkey) rather
  than riding on every MAP: a retried or concurrent MAP never makes a second queue pair,
  and each side brings its own queue pair to RTR only once it holds the peer's address.

Flows: placement = QUERY_MEM/FREE_MEM to two daemons, MAP/MR_INFO to the chosen one
(over RDMA, the first MR_INFO of a daemon incarnation is followed by RDMA_CONNECT/RDMA_ACCEPT);
eviction = CHECK_ACTIVITY/ACTIVITY to the devices of E+E' slabs, EVICT/DONE for the E
chosen (the daemon frees the memory only after DONE); a device giving a slab back on its
own (cold slab, shutdown) sends UNMAP and gets DONE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dlrt.messages import Protocol, ProtocolError

__all__ = [
    "VERSION", "QUERY_MEM", "FREE_MEM", "MAP", "MR_INFO", "CHECK_ACTIVITY", "ACTIVITY", "EVICT",
    "DONE", "UNMAP", "PING", "PONG", "STATUS", "REPORT", "ERROR", "RDMA_CONNECT", "RDMA_ACCEPT",
    "QP_FIELDS", "TOGETHER", "Field", "SCHEMA", "COMMON",
    "ProtocolError",
    "Message", "encode", "decode", "reply_to", "error", "PROTOCOL",
]

VERSION = 2    # 2: the shared dlrt envelope (adds "proto")

QUERY_MEM = "QUERY_MEM"
FREE_MEM = "FREE_MEM"
MAP = "MAP"
MR_INFO = "MR_INFO"
CHECK_ACTIVITY = "CHECK_ACTIVITY"
ACTIVITY = "ACTIVITY"
EVICT = "EVICT"
DONE = "DONE"
UNMAP = "UNMAP"
PING = "PING"
PONG = "PONG"
STATUS = "STATUS"
REPORT = "REPORT"
ERROR = "ERROR"
RDMA_CONNECT = "RDMA_CONNECT"
RDMA_ACCEPT = "RDMA_ACCEPT"

PROTOCOL = Protocol("infiniswap", VERSION, error_op=ERROR)

# Field kinds.
UINT = "uint"            # int >= 0 (bool is not an int here)
STR = "str"
NUM = "num"              # finite int or float
SLABS = "[uint]"         # list of uint
ACTIVITY_MAP = "{uint:num}"
OBJ = "{str:any}"        # a map with string keys (status reports)
U32 = "u32"              # int in [0, 2**32)
U64 = "u64"              # int in [0, 2**64)
QP = "qp"                # an RC queue pair's address (QP_FIELDS)

# A queue pair's address (struct isw_rdma_qp_info), field -> exclusive upper bound; gid: bytes.
_QP_LIMITS = {"qpn": 1 << 24, "psn": 1 << 24, "lid": 1 << 16, "mtu": 6, "global": 2}
QP_FIELDS = (*_QP_LIMITS, "gid")
_GID_LEN = 16


@dataclass(frozen=True)
class Field:
    """One field of a message: its kind, whether it must be present, whether ``None`` is allowed."""
    kind: str
    required: bool = True
    nullable: bool = False


def _opt(kind: str) -> Field:
    return Field(kind, required=False)


def _nullable(kind: str) -> Field:
    return Field(kind, nullable=True)


# Fields every message may carry besides its own (``v`` and ``op`` are checked separately).
COMMON: dict[str, Field] = {"id": _opt(UINT)}

SCHEMA: dict[str, dict[str, Field]] = {
    QUERY_MEM: {},
    FREE_MEM: {"free_bytes": Field(UINT), "slab_size": Field(UINT), "slabs_free": Field(UINT),
               "slabs_mapped": Field(UINT), "host_id": Field(STR), "instance": _opt(STR),
               "challenge": _opt(STR)},
    MAP: {"device_id": Field(STR), "slab": Field(UINT), "slab_size": _opt(UINT),
          "proof": _opt(STR), "nonce": _opt(STR)},
    MR_INFO: {"slab": Field(UINT), "region": Field(UINT), "size": Field(UINT),
              "generation": Field(UINT), "host_id": Field(STR),
              "host": Field(STR), "data_port": _nullable(UINT), "shm_path": _nullable(STR),
              "instance": _opt(STR), "rdma_addr": _opt(U64), "rdma_rkey": _opt(U32),
              "proof": _opt(STR)},
    CHECK_ACTIVITY: {"slabs": Field(SLABS)},
    ACTIVITY: {"activity": Field(ACTIVITY_MAP)},
    EVICT: {"slabs": Field(SLABS)},
    DONE: {"slabs": Field(SLABS)},
    UNMAP: {"device_id": Field(STR), "slabs": Field(SLABS), "shm_read": _opt(U64),
            "shm_written": _opt(U64)},
    PING: {"shm_read": _opt(U64), "shm_written": _opt(U64)},
    PONG: {"instance": _opt(STR), "slabs": _opt(SLABS), "challenge": _opt(STR)},
    STATUS: {},
    REPORT: {"report": Field(OBJ)},
    ERROR: {"reason": Field(STR), "code": _opt(STR), "challenge": _opt(STR)},
    RDMA_CONNECT: {"device_id": Field(STR), "qp": Field(QP), "proof": _opt(STR)},
    RDMA_ACCEPT: {"qp": Field(QP), "capacity": Field(UINT), "instance": _opt(STR)},
}

# Optional fields that come together or not at all.
TOGETHER: dict[str, tuple[str, ...]] = {MR_INFO: ("rdma_addr", "rdma_rkey"),
                                        UNMAP: ("shm_read", "shm_written"),
                                        PING: ("shm_read", "shm_written")}


@dataclass(frozen=True)
class Message:
    """A decoded message: its operation and its fields (``id`` included when present)."""
    op: str
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    @property
    def id(self) -> int | None:
        return self.fields.get("id")

    def encode(self) -> bytes:
        return encode(self.op, **self.fields)


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_plain(value: Any, depth: int = 0) -> bool:
    """msgpack-plain data a report may hold: no NaN/infinity (so a report equals itself)."""
    if depth > 32:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, str, bytes))


def _check_kind(kind: str, value: Any) -> str | None:
    """``None`` if ``value`` is of ``kind``, else what is wrong with it."""
    if kind == UINT:
        return None if _is_uint(value) else "a non-negative integer"
    if kind == STR:
        return None if isinstance(value, str) else "a string"
    if kind == NUM:
        return None if _is_num(value) else "a finite number"
    if kind == SLABS:
        if isinstance(value, (list, tuple)) and all(_is_uint(s) for s in value):
            return None
        return "a list of non-negative integers"
    if kind == ACTIVITY_MAP:
        if isinstance(value, dict) and all(_is_uint(k) and _is_num(a) for k, a in value.items()):
            return None
        return "a map of non-negative integer slab -> finite number"
    if kind in (U32, U64):
        ok = _is_uint(value) and value < (1 << (32 if kind == U32 else 64))
        return None if ok else f"a non-negative integer below 2**{kind[1:]}"
    if kind == QP:
        return _qp_problem(value)
    if kind == OBJ:
        if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
            return "a map with string keys"
        return None if _is_plain(value) else "a map of plain values (no NaN or infinity)"
    raise AssertionError(f"unknown field kind {kind!r}")


def _qp_problem(value: Any) -> str | None:
    """``None`` if ``value`` is a queue pair's address, else what one is."""
    expected = ("a queue pair address: a map of exactly qpn, psn (< 2**24), lid (< 2**16), "
                f"mtu (1..5), global (0 or 1), gid ({_GID_LEN} bytes)")
    if not isinstance(value, dict) or set(value) != set(QP_FIELDS):
        return expected
    if not all(_is_uint(value[k]) and value[k] < limit for k, limit in _QP_LIMITS.items()):
        return expected
    gid = value["gid"]
    ok = value["mtu"] >= 1 and isinstance(gid, bytes) and len(gid) == _GID_LEN
    return None if ok else expected


def _type_name(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _validate(op: Any, fields: Mapping[Any, Any]) -> None:
    if not isinstance(op, str) or op not in SCHEMA:
        raise ProtocolError(f"unknown op {op!r} (known: {', '.join(SCHEMA)})")
    spec = SCHEMA[op]
    for name, f in spec.items():
        if f.required and name not in fields:
            raise ProtocolError(f"{op}: missing field {name!r}")
    for name, value in fields.items():
        f = spec.get(name) if isinstance(name, str) else None
        if f is None and isinstance(name, str):
            f = COMMON.get(name)
        if f is None:
            raise ProtocolError(f"{op}: unexpected field {name!r} (fields: {', '.join(spec) or 'none'})")
        if value is None and f.nullable:
            continue
        wrong = _check_kind(f.kind, value)
        if wrong is not None:
            raise ProtocolError(f"{op}: field {name!r} has the wrong type: expected {wrong}, "
                                f"got {_type_name(value)}")
    together = TOGETHER.get(op, ())
    present = [name for name in together if name in fields]
    if present and len(present) != len(together):
        raise ProtocolError(f"{op}: fields {', '.join(together)} come together; got only "
                            f"{', '.join(present)}")


def encode(op: str, **fields: Any) -> bytes:
    """One message as msgpack bytes; validated the same way ``decode`` validates (ProtocolError)."""
    _validate(op, fields)
    return PROTOCOL.pack(op, fields)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one message; any malformed input raises ``ProtocolError``
    (``VersionMismatch`` for a peer speaking another version of this protocol)."""
    op, fields = PROTOCOL.unpack(data)
    _validate(op, fields)
    return Message(op, fields)


def reply_to(request: Message, op: str, **fields: Any) -> bytes:
    """Encode a reply to ``request``, echoing its ``id`` when it had one."""
    if request.id is not None and "id" not in fields:
        fields["id"] = request.id
    return encode(op, **fields)


def error(reason: str, code: str | None = None, **fields: Any) -> bytes:
    """An ERROR message (``code`` omitted when ``None``)."""
    if code is not None:
        fields["code"] = code
    return encode(ERROR, reason=reason, **fields)
