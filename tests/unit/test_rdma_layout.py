"""The rdma transport's records (``autops.transport.rdma_layout``): round trips through a
stream cut anywhere, and every malformed record refused with ``LayoutError``."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from autops.transport.rdma_layout import (DATA, DONE, HELLO, INLINE, INLINE_MAX, MAX_RECORD, REMOTE, ConnInfo,
                                          Descriptor, LayoutError, RecordReader, decode_data, decode_done,
                                          decode_hello, encode_data, encode_done, encode_hello)

remote_descriptors = st.builds(Descriptor.remote, st.integers(1, 1 << 40), st.integers(1, 1 << 47),
                               st.integers(0, (1 << 32) - 1))
payload_plans = st.lists(st.one_of(st.binary(max_size=300).map(lambda b: ("inline", b)),
                                   remote_descriptors.map(lambda d: ("remote", d))), max_size=8)
infos = st.builds(ConnInfo, qpn=st.integers(0, 0xFFFFFF), psn=st.integers(0, 0xFFFFFF), lid=st.integers(0, 0xFFFF),
                  gid=st.text("0123456789abcdef:", max_size=39), mtu=st.integers(0, 5),
                  device=st.text(max_size=20))


def _data_record(seq: int, header: bytes, plan: list) -> tuple[bytes, list[Descriptor]]:
    descriptors = [Descriptor.inline(len(x)) if kind == "inline" else x for kind, x in plan]
    inline = [x for kind, x in plan if kind == "inline"]
    return b"".join(bytes(b) for b in encode_data(seq, header, descriptors, inline)), descriptors


def _records(stream: bytes, cuts: list[int]) -> list:
    """Feed ``stream`` cut at ``cuts`` and collect every record as it completes."""
    reader, out, start = RecordReader(), [], 0
    for cut in sorted(set(c % (len(stream) + 1) for c in cuts)) + [len(stream)]:
        reader.feed(stream[start:cut])
        start = cut
        while (record := reader.next()) is not None:
            out.append(record)
    assert reader.buffered == 0
    return out


@settings(max_examples=150, deadline=None)
@given(seq=st.integers(0, (1 << 64) - 1), header=st.binary(max_size=200), plan=payload_plans,
       info=infos, done=st.integers(0, (1 << 64) - 1), cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_records_round_trip_through_a_stream_cut_anywhere(seq, header, plan, info, done, cuts):
    data, descriptors = _data_record(seq, header, plan)
    stream = encode_hello(info) + data + encode_done(done)
    (op1, hello), (op2, body), (op3, ack) = _records(stream, cuts)
    assert (op1, op2, op3) == (HELLO, DATA, DONE)
    assert decode_hello(hello) == info
    assert decode_done(ack) == done
    decoded = decode_data(body)
    assert decoded.seq == seq and bytes(decoded.header) == header
    assert decoded.descriptors == descriptors
    for (kind, x), payload in zip(plan, decoded.payloads):
        assert (bytes(payload) == x) if kind == "inline" else payload is None


def test_inline_payloads_are_not_copied_into_a_new_buffer():
    big = bytearray(b"x" * 1000)
    buffers = encode_data(7, b"head", [Descriptor.inline(1000)], [big])
    assert buffers[-1].obj is big            # the payload travels as a view of the caller's bytes


@pytest.mark.parametrize("descriptor", [
    Descriptor(INLINE, INLINE_MAX + 1), Descriptor(INLINE, 4, addr=8), Descriptor(REMOTE, 0, 4096, 1),
    Descriptor(REMOTE, 16, 0, 1), Descriptor(REMOTE, 1 << 63, (1 << 64) - 16, 1), Descriptor(9, 16, 4096, 1),
])
def test_malformed_descriptors_are_refused(descriptor):
    inline = [b"\0" * descriptor.nbytes] if descriptor.where == INLINE else []
    with pytest.raises(LayoutError):
        encode_data(1, b"h", [descriptor], inline)
    # and on the receiving side, where a peer could have written them
    body = struct.pack("<QIH", 1, 1, 1) + struct.pack("<BQQI", *descriptor) + b"h" + b"".join(inline)
    with pytest.raises(LayoutError):
        decode_data(body)


def test_a_key_wider_than_32_bits_is_refused():
    with pytest.raises(LayoutError):
        encode_data(1, b"h", [Descriptor.remote(16, 4096, 1 << 32)], [])


def test_inline_bytes_must_match_their_descriptors():
    with pytest.raises(LayoutError, match="do not match"):
        encode_data(1, b"h", [Descriptor.inline(3)], [b"four"])


@pytest.mark.parametrize("body, text", [
    (b"\1\2", "truncated"),
    (struct.pack("<QIH", 1, 0, 2) + struct.pack("<BQQI", 0, 0, 0, 0), "truncated descriptors"),
    (struct.pack("<QIH", 1, 5, 0) + b"abc", "account for"),
    (struct.pack("<QIH", 1, 1, 0) + b"abc", "account for"),
])
def test_truncated_or_padded_data_records_are_refused(body, text):
    with pytest.raises(LayoutError, match=text):
        decode_data(body)


def test_a_corrupt_stream_is_refused_not_waited_for():
    reader = RecordReader()
    reader.feed(struct.pack("<IB", MAX_RECORD + 1, DATA))
    with pytest.raises(LayoutError, match="corrupt"):
        reader.next()
    reader = RecordReader()
    reader.feed(struct.pack("<IB", 5, 77) + b"abcd")
    with pytest.raises(LayoutError, match="op 77"):
        reader.next()


@pytest.mark.parametrize("change, text", [
    ({"v": 99}, "version"), ({"qpn": 1 << 24}, "qpn"), ({"psn": -1}, "psn"), ({"mtu": 6}, "mtu"),
    ({"lid": "1"}, "lid"), ({"gid": 5}, "gid"), ({"device": "x" * 65}, "device"),
])
def test_hello_fields_are_checked(change, text):
    good = ConnInfo(qpn=5, psn=6, lid=7, gid="fe80:0000:0000:0000:0000:0000:0000:0001", mtu=3, device="mlx5_0")
    with pytest.raises(LayoutError, match=text):
        ConnInfo.from_wire({**good.to_wire(), **change})
    assert ConnInfo.from_wire(good.to_wire()) == good


def test_done_has_a_fixed_size():
    with pytest.raises(LayoutError):
        decode_done(b"\0" * 7)
