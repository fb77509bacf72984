import threading

import msgpack
import numpy as np
import pytest
import zmq

from autops.wire import protocol as wire
from autops.wire.partition import KeySpec
from autops.transport import PayloadError
from dlrt.messages import Protocol, VersionMismatch


def test_round_trip_keeps_payload_frames_separate():
    payload = np.arange(10, dtype=np.float32)
    frames = wire.encode(wire.PUSH, [payload], job="j", secret="s", rank=0, items=[["k", 1, 0, 0, 40]])
    assert frames[1] is payload                      # not copied into the header
    msg = wire.decode([frames[0], payload.tobytes()])
    assert msg.op == wire.PUSH and msg["job"] == "j" and msg["items"] == [["k", 1, 0, 0, 40]]
    view = np.frombuffer(wire.payload_view(msg.payloads[0]), np.float32)
    assert np.array_equal(view, payload)


@pytest.mark.parametrize("frames, text", [
    ([], "empty"),
    ([b"\xc1garbage"], "undecodable"),
    ([msgpack.packb([1, 2])], "not a map"),
    ([msgpack.packb({"v": 99, "op": "push"})], "version"),
    ([msgpack.packb({"v": wire.VERSION, "op": "fly"})], "unknown operation"),
    ([msgpack.packb({"v": wire.VERSION, "op": "push", "job": "j"})], "missing field"),
    ([msgpack.packb({"v": wire.VERSION, "op": "push", "job": 3, "secret": "s", "rank": 0, "items": []})], "wrong type"),
    ([msgpack.packb({"v": wire.VERSION, "op": "push", "job": "j", "secret": "s", "rank": True, "items": []})], "wrong type"),
])
def test_malformed_messages_raise_protocol_error(frames, text):
    with pytest.raises(wire.ProtocolError, match=text):
        wire.decode(frames)


def test_items_are_validated():
    msg = wire.decode(wire.encode(wire.PULL, job="j", secret="s", rank=0, items=[["k", 1], "bad"]))
    with pytest.raises(wire.ProtocolError, match="malformed item"):
        list(wire.items_of(msg, 2))


# --- records: only wire.py knows the positions ---------------------------------------------
RECORDS = [
    wire.PushItem("k", 3, wire.Slice(1, 0, 40), {"lr": 0.1}),
    wire.PushItem("k", 3, wire.Slice(0, 8, 16)),
    wire.PullItem("k", 2),
    wire.PullReplyItem("k", 2, 0),
    wire.PullReplyItem("k", 2, 1, wire.Move("k", "agg-1", 3, {"host": "h", "endpoints": {}})),
    wire.PullReplyItem("k", 2, 0, None, 128, 40),
    wire.PullReplyItem("k", 2, 0, wire.Move("k", "agg-1", 3, {"host": "h"}), 0, 0),
    wire.Move("k", "agg-1", 3, {"host": "h"}),
    wire.Ack("k"),
    wire.InitItem("k", wire.Slice(0, 0, 40), 7, {"exp_avg": wire.Slice(1, 0, 40)}),
    wire.InitItem("k", wire.Slice(0, 0, 40), 0),
    wire.KeyCopy("k", {"completed": 4}, 2),
    wire.TableEntry(KeySpec("w#p0", "w", 0, 10, "float32", False), "agg-0", ("agg-1", 5)),
    wire.TableEntry(KeySpec("b", "b", 0, 3, "int64", True), "agg-0"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_survive_the_wire(record):
    packed = msgpack.unpackb(msgpack.packb(record.to_wire()), raw=False)
    assert type(record).from_wire(packed) == record


@pytest.mark.parametrize("record, item, text", [
    (wire.PushItem, ["k", 1, 0, 0], "malformed item"),
    (wire.PushItem, [3, 1, 0, 0, 4], "bad item"),
    (wire.PushItem, ["k", True, 0, 0, 4], "bad item"),
    (wire.PushItem, ["k", 1, 0, "0", 4], "must be integers"),
    (wire.PushItem, ["k", 1, 0, 0, 4, [1]], "must be a map"),
    (wire.PullItem, ["k"], "malformed item"),
    (wire.PullItem, ["k", "1"], "bad item"),
    (wire.PullReplyItem, ["k", 1, 0, "elsewhere"], "migration notice"),
    (wire.PullReplyItem, ["k", 1, 0, ["agg-1", 2]], "migration notice"),
    (wire.PullReplyItem, ["k", 1, 0, None, "0", 4], "must be integers"),
    (wire.Move, ["k", "agg-1", "2", {}], "migration notice"),
    (wire.Ack, [1], "malformed item"),
    (wire.InitItem, ["k", 0, 0, 4, {"state": {"m": [0, 0]}}], "malformed item"),
    (wire.InitItem, ["k", 0, 0, 4, {"step": "1"}], "malformed item"),
    (wire.KeyCopy, ["k", {}, -1], "malformed item"),
    (wire.TableEntry, ["w", "w", 0, 10, "float32"], "malformed item"),
])
def test_malformed_records_raise_protocol_error(record, item, text):
    with pytest.raises(wire.ProtocolError, match=text):
        record.from_wire(item)


def test_packed_small_values_come_back_from_their_slices():
    values = [np.arange(3, dtype=np.float32), np.arange(5, dtype=np.int64), np.zeros(0, np.float32),
              np.arange(17, dtype=np.float16)]
    blob, spans = wire.pack(values)
    assert [n for _, n in spans] == [a.nbytes for a in values]
    assert all(offset % wire.PACK_ALIGN == 0 for offset, _ in spans)
    items = [wire.PullReplyItem(f"k{i}", 1, 0, None, offset, nbytes) for i, (offset, nbytes) in enumerate(spans)]
    msg = wire.parse(wire.header(wire.PULL_REPLY, req=1, items=[i.to_wire() for i in items]), [blob])
    for value, item in zip(values, msg.items(wire.PullReplyItem)):
        np.testing.assert_array_equal(msg.array(item.data, value.dtype), value)
    assert wire.PullReplyItem("k", 1, 0).data is None      # the whole payload


def test_payload_slices_are_checked_against_their_buffer():
    msg = wire.parse(wire.header(wire.PUSH, job="j", secret="s", rank=0, items=[]), [np.zeros(4, np.float32)])
    assert msg.array(wire.Slice(0, 4, 8), "float32").size == 2
    for bad, text in [(wire.Slice(1, 0, 4), "payload frame 1 missing"),
                      (wire.Slice(0, 8, 16), "outside a 16-byte frame"),
                      (wire.Slice(0, 0, 6), "not a whole number of float32")]:
        with pytest.raises(wire.ProtocolError, match=text):
            msg.array(bad, "float32")


def test_a_payload_the_transport_could_not_map_is_a_protocol_error():
    msg = wire.parse(wire.header(wire.PULL_REPLY, items=[]), [PayloadError("cannot map shared memory of process 9")],
                     frozenset({0}))
    with pytest.raises(wire.ProtocolError, match="payload 0: cannot map shared memory of process 9"):
        msg.view(0)


# --- versions ----------------------------------------------------------------------------
OTHER = Protocol("autops", wire.VERSION + 1, error_op=wire.ERROR)


def test_another_version_is_a_version_mismatch_naming_both():
    frames = [OTHER.pack(wire.PULL, {"job": "j", "secret": "s", "rank": 0, "items": []})]
    with pytest.raises(VersionMismatch) as info:
        wire.decode(frames)
    assert isinstance(info.value, wire.ProtocolError)
    text = str(info.value)
    assert f"v{wire.VERSION + 1}" in text and f"v{wire.VERSION}" in text


def test_aggregator_answers_another_version_with_an_error_the_sender_reads():
    from autops.aggregator.service import Aggregator

    agg = Aggregator("tcp://127.0.0.1:9", heartbeat_interval=60)
    agg.agg_id = "agg-0"          # registered already: serves data without a master
    loop = threading.Thread(target=agg.run, daemon=True)
    loop.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(agg.endpoints["tcp"])
        sock.send_multipart([OTHER.pack(wire.PUSH, {"req": 5, "job": "j", "secret": "s", "rank": 0, "items": []})])
        assert sock.poll(10_000), "no reply"
        op, fields = OTHER.unpack(sock.recv_multipart()[0])
        assert op == wire.ERROR
        assert f"v{wire.VERSION + 1}" in fields["message"] and f"v{wire.VERSION}" in fields["message"]
    finally:
        sock.close(0)
        ctx.term()
        agg.stop()
        loop.join(10)
