import msgpack
import numpy as np
import pytest

from autops import wire


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
    ([msgpack.packb({"v": 1, "op": "fly"})], "unknown operation"),
    ([msgpack.packb({"v": 1, "op": "push", "job": "j"})], "missing field"),
    ([msgpack.packb({"v": 1, "op": "push", "job": 3, "secret": "s", "rank": 0, "items": []})], "wrong type"),
    ([msgpack.packb({"v": 1, "op": "push", "job": "j", "secret": "s", "rank": True, "items": []})], "wrong type"),
])
def test_malformed_messages_raise_protocol_error(frames, text):
    with pytest.raises(wire.ProtocolError, match=text):
        wire.decode(frames)


def test_items_are_validated():
    msg = wire.decode(wire.encode(wire.PULL, job="j", secret="s", rank=0, items=[["k", 1], "bad"]))
    with pytest.raises(wire.ProtocolError, match="malformed item"):
        list(wire.items_of(msg, 2))
