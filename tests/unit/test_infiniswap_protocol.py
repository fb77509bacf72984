"""Infiniswap control messages (thesis §2.6.1): round trips and every class of malformed input."""
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infiniswap import protocol as p
from infiniswap.protocol import ProtocolError

EXAMPLES = {
    p.QUERY_MEM: {},
    p.FREE_MEM: {"free_bytes": 12 << 30, "slab_size": 1 << 30, "slabs_free": 12, "slabs_mapped": 3,
                 "host_id": "node1/6b2c"},
    p.MAP: {"device_id": "node2:0", "slab": 7, "slab_size": 1 << 30},
    p.MR_INFO: {"slab": 7, "region": 3 << 30, "size": 1 << 30, "generation": 5, "host_id": "node1/6b2c", "host": "10.0.0.1",
                "data_port": 7301, "shm_path": "/proc/4242/fd/9"},
    p.CHECK_ACTIVITY: {"slabs": [1, 7, 9]},
    p.ACTIVITY: {"activity": {1: 0.0, 7: 35.5, 9: 20}},
    p.EVICT: {"slabs": [7]},
    p.DONE: {"slabs": [7]},
    p.UNMAP: {"device_id": "node2:0", "slabs": [1, 9]},
    p.PING: {},
    p.PONG: {},
    p.STATUS: {},
    p.REPORT: {"report": {"free_bytes": 1 << 30, "devices": {"node2:0": [1, 9]}, "ok": True}},
    p.ERROR: {"reason": "no free slab", "code": "no_memory"},
    p.RDMA_CONNECT: {"device_id": "node2:0", "qp": {"qpn": 0x1A2B3C, "psn": 77, "lid": 0, "mtu": 5,
                                                    "global": 1, "gid": bytes(range(16))}},
    p.RDMA_ACCEPT: {"qp": {"qpn": 0x11, "psn": 0xFFFFFF, "lid": 3, "mtu": 3, "global": 0,
                           "gid": bytes(16)}, "capacity": 64 << 30},
}


def test_examples_cover_the_schema():
    assert set(EXAMPLES) == set(p.SCHEMA)
    assert {"QUERY_MEM", "FREE_MEM", "MAP", "MR_INFO", "CHECK_ACTIVITY", "ACTIVITY", "EVICT", "DONE"} <= set(p.SCHEMA)


@pytest.mark.parametrize("op", sorted(EXAMPLES))
def test_round_trip_every_op(op):
    msg = p.decode(p.encode(op, **EXAMPLES[op]))
    assert msg.op == op and msg.fields == EXAMPLES[op] and msg.id is None
    with_id = p.decode(p.encode(op, id=17, **EXAMPLES[op]))
    assert with_id.id == 17 and with_id.fields == {**EXAMPLES[op], "id": 17}
    assert p.decode(with_id.encode()) == with_id


def test_optional_and_nullable_fields():
    bare = {k: v for k, v in EXAMPLES[p.MAP].items() if k != "slab_size"}
    assert p.decode(p.encode(p.MAP, **bare)).get("slab_size") is None
    remote = {**EXAMPLES[p.MR_INFO], "shm_path": None, "data_port": None}
    assert p.decode(p.encode(p.MR_INFO, **remote))["shm_path"] is None
    assert p.decode(p.error("bad")).fields == {"reason": "bad"}
    assert p.decode(p.error("bad", code="bad_request"))["code"] == "bad_request"


def test_daemon_instance_and_pong_slab_list():
    pong = p.decode(p.encode(p.PONG, instance="a1b2", slabs=[3, 0]))
    assert pong["instance"] == "a1b2" and pong["slabs"] == [3, 0]
    free = p.decode(p.encode(p.FREE_MEM, **EXAMPLES[p.FREE_MEM], instance="a1b2"))
    assert free["instance"] == "a1b2"
    info = p.decode(p.encode(p.MR_INFO, **EXAMPLES[p.MR_INFO], instance="a1b2"))
    assert info["instance"] == "a1b2"
    with pytest.raises(ProtocolError, match="wrong type"):
        p.encode(p.PONG, slabs=[-1])
    with pytest.raises(ProtocolError, match="wrong type"):
        p.encode(p.PONG, instance=7)


def test_status_report_needs_a_string_keyed_map():
    msg = p.decode(p.encode(p.REPORT, report={"a": [1, {"b": None}]}))
    assert msg["report"] == {"a": [1, {"b": None}]}
    with pytest.raises(ProtocolError, match="string keys"):
        p.encode(p.REPORT, report={1: "x"})
    with pytest.raises(ProtocolError, match="string keys"):
        p.encode(p.REPORT, report=[("a", 1)])
    with pytest.raises(ProtocolError, match="missing field 'report'"):
        p.encode(p.REPORT)
    with pytest.raises(ProtocolError, match="no NaN or infinity"):
        p.encode(p.REPORT, report={"a": [1.0, {"b": float("nan")}]})
    with pytest.raises(ProtocolError, match="no NaN or infinity"):
        p.decode(raw({"v": 2, "op": "REPORT", "report": {"x": float("inf")}}))


def test_reply_echoes_request_id():
    req = p.decode(p.encode(p.QUERY_MEM, id=99))
    rep = p.decode(p.reply_to(req, p.FREE_MEM, **EXAMPLES[p.FREE_MEM]))
    assert rep.op == p.FREE_MEM and rep.id == 99
    assert p.decode(p.reply_to(p.decode(p.encode(p.PING)), p.PONG)).id is None


def raw(obj):
    return msgpack.packb(obj, use_bin_type=True)


def ok(op, **over):
    return {"v": 2, "op": op, **EXAMPLES[op], **over}


@pytest.mark.parametrize("data, text", [
    (b"", "not msgpack"),
    (b"\xc1", "not msgpack"),
    (raw({"v": 2, "op": "PING"}) + b"\x00", "not msgpack"),
    (raw([1, 2]), "not a dict"),
    (raw("QUERY_MEM"), "not a dict"),
    (raw({"op": "PING"}), "version"),
    (raw({"v": 1, "op": "PING"}), "version"),
    (raw({"v": "1", "op": "PING"}), "version"),
    (raw({"v": True, "op": "PING"}), "version"),
    (raw({"v": 2}), "missing 'op'"),
    (raw({"v": 2, "op": "FLY"}), "unknown op"),
    (raw({"v": 2, "op": 3}), "unknown op"),
    (raw({"v": 2, "op": "MAP", "slab": 1}), "missing field 'device_id'"),
    (raw(ok("PING", extra=1)), "unexpected field 'extra'"),
    (raw({**ok("PING"), 5: 1}), "unexpected field 5"),
    (raw(ok("MAP", slab=True)), "wrong type"),
    (raw(ok("MAP", slab=-1)), "wrong type"),
    (raw(ok("MAP", slab=1.0)), "wrong type"),
    (raw(ok("MAP", device_id=b"bytes")), "wrong type"),
    (raw(ok("MAP", slab_size=None)), "wrong type"),
    (raw(ok("FREE_MEM", free_bytes="lots")), "wrong type"),
    (raw(ok("EVICT", slabs=[1, "2"])), "wrong type"),
    (raw(ok("EVICT", slabs=7)), "wrong type"),
    (raw(ok("ACTIVITY", activity={"1": 2.0})), "wrong type"),
    (raw(ok("ACTIVITY", activity={1: float("nan")})), "wrong type"),
    (raw(ok("ACTIVITY", activity=[[1, 2.0]])), "wrong type"),
    (raw(ok("MR_INFO", host=None)), "wrong type"),
    (raw(ok("MR_INFO", id=-3)), "wrong type"),
])
def test_malformed_messages_raise_protocol_error(data, text):
    with pytest.raises(ProtocolError, match=text):
        p.decode(data)


def test_decode_rejects_non_bytes():
    with pytest.raises(ProtocolError, match="expected bytes"):
        p.decode("QUERY_MEM")          # type: ignore[arg-type]
    assert p.decode(memoryview(p.encode(p.PING))).op == p.PING
    assert p.decode(bytearray(p.encode(p.PING))).op == p.PING


def test_encode_validates_too():
    with pytest.raises(ProtocolError, match="missing field"):
        p.encode(p.MAP, slab=1)
    with pytest.raises(ProtocolError, match="unexpected field"):
        p.encode(p.PING, slab=1)
    with pytest.raises(ProtocolError, match="unknown op"):
        p.encode("map")
    with pytest.raises(ProtocolError, match="wrong type"):
        p.encode(p.DONE, slabs=[True])


def test_host_id_is_stable_and_overridable(monkeypatch):
    from dlrt.hostid import HOST_ID_ENV, host_id
    monkeypatch.delenv(HOST_ID_ENV, raising=False)
    assert host_id() and host_id() == host_id()
    monkeypatch.setenv(HOST_ID_ENV, "emulated-host-3")
    assert host_id() == "emulated-host-3"


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_only_protocol_error(data):
    try:
        msg = p.decode(data)
    except ProtocolError:
        return
    assert msg.op in p.SCHEMA


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.integers(-5, 5), st.text(max_size=6)), inner, max_size=4)), max_leaves=12)
field_names = st.sampled_from(sorted({f for s in p.SCHEMA.values() for f in s} | {"id", "v", "op", "x"}))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(p.SCHEMA) + ["NOPE"]), st.dictionaries(field_names, values, max_size=6),
       st.sampled_from([p.VERSION, p.VERSION, p.VERSION, p.VERSION - 1, "1"]))
def test_arbitrary_msgpack_maps_only_protocol_error(op, fields, version):
    data = raw({**fields, "v": version, "op": op})
    try:
        msg = p.decode(data)
    except ProtocolError:
        return
    assert msg.op == op and p.decode(msg.encode()) == msg


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(EXAMPLES)), st.data())
def test_mutated_valid_messages_only_protocol_error(op, data):
    buf = bytearray(p.encode(op, **EXAMPLES[op]))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    try:
        p.decode(bytes(buf))
    except ProtocolError:
        pass
