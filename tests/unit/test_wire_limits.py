"""What the fuzzing of the shared services (tests/integration/test_fuzz_services.py) found,
pinned down without processes: declaration limits and field checks of ``autops.wire.protocol``,
replies and migration reports only from the aggregator asked, and shared-memory
references with negative numbers."""
from __future__ import annotations

import os

import pytest

from autops.wire import protocol as wire
from autops.master.migration import Batch, Migrations
from autops.master.outbox import AggregatorOutbox
from autops.master.pool import AggInfo, PoolState
from autops.transport.base import PayloadError
from autops.transport.shm import SharedMemory

MiB = 1 << 20


def test_a_small_declaration_passes():
    wire.check_declared([["w", [1000, 1100], "float32"], ["b", [10], "float32", {"mode": "sum"}]], 4 * MiB)


@pytest.mark.parametrize("entry, text", [
    (7, "malformed tensor entry"),
    (["w"], "malformed tensor entry"),
    (["w#1", [4], "float32"], "bad tensor name"),
    (["w", [-1], "float32"], "bad shape"),
    (["w", [4], "int8"], "not supported"),
    (["w", [2**41], "float32"], "over the limit"),                 # 8 TiB
    (["w", [2**40, 2**40], "float32"], "over the limit"),          # 2**82 bytes
    (["w", [0, 2**64 - 1], "float32"], "over the limit"),          # no bytes, but a dimension int64 cannot hold
    (["w", [1] * 33, "float32"], "over the limit"),
])
def test_a_bad_or_huge_tensor_is_refused_before_anything_is_planned(entry, text):
    with pytest.raises(wire.ProtocolError, match=text):
        wire.check_declared([["ok", [4], "float32"], entry], 4 * MiB)


def test_the_keys_of_a_job_are_counted_against_the_limit():
    tensor = ["w", [wire.MAX_JOB_KEYS * 256], "float32"]          # MAX_JOB_KEYS keys of 1 KiB
    wire.check_declared([tensor], 1024)
    with pytest.raises(wire.ProtocolError, match="keys, more than"):
        wire.check_declared([tensor], 1024, keys=1)                # one key already
    with pytest.raises(wire.ProtocolError, match="keys, more than"):
        wire.check_declared([tensor], 1000)                        # 1000 bytes: 250 elements a key
    wire.check_declared([tensor], 1024, known={"w"}, keys=wire.MAX_JOB_KEYS)   # declared again: no new keys
    with pytest.raises(wire.ProtocolError, match="partition size"):
        wire.check_declared([tensor], 0)


@pytest.mark.parametrize("fields, text", [
    ({"job": "j", "secret": "s", "rank": 0, "iteration": 1, "count": 1, "duration": float("nan")}, "finite"),
    ({"job": "j", "secret": "s", "rank": 0, "iteration": 1, "count": 1, "duration": float("inf")}, "finite"),
])
def test_a_number_that_is_not_finite_is_refused(fields, text):
    with pytest.raises(wire.ProtocolError, match=text):
        wire.decode(wire.encode(wire.PROFILE, **fields))


@pytest.mark.parametrize("op, fields", [
    (wire.MIGRATE, {"job": "j", "keys": 5}),
    (wire.MIGRATE, {"job": "j", "keys": [{}]}),
    (wire.MIGRATE, {"job": "j", "to": "agg-0"}),
    (wire.TENSOR_COPY_DONE, {"mid": 1, "job": "j", "keys": [["k"]]}),
    (wire.WORKER_DONE, {"mid": 1, "job": "j", "keys": [None]}),
])
def test_lists_of_names_hold_names(op, fields):
    with pytest.raises(wire.ProtocolError, match="list of names"):
        wire.decode(wire.encode(op, **fields))
    ok = {k: (["a", "b"] if k in ("keys", "to") else v) for k, v in fields.items()}
    assert wire.decode(wire.encode(op, **ok)).op == op
    if op == wire.MIGRATE:                                         # optional there: None is "all keys"
        assert wire.decode(wire.encode(op, **{**ok, "keys": None})).op == op


def pool_with(*names: str) -> PoolState:
    state = PoolState(heartbeat_timeout=5.0, clock=lambda: 100.0)
    for name in names:
        state.add_aggregator(AggInfo(name, name.encode(), {}, "host", 1, 100.0))
    return state


def test_only_the_aggregator_asked_can_answer():
    answers = []
    outbox = AggregatorOutbox(pool_with("a", "b"), lambda identity, frames: None, 10.0)
    outbox.send_agg("a", wire.ASSIGN, answers.append, job="J")
    ok = wire.decode(wire.encode(wire.OK, req=1))
    assert not outbox.deliver(ok, b"b") and not outbox.deliver(ok, b"someone")   # spoofed: ignored
    assert not outbox.deliver(wire.decode(wire.encode(wire.OK, req=[1])), b"a")  # not a request id
    assert not outbox.deliver(wire.decode(wire.encode(wire.OK, req=True)), b"a")
    assert answers == [] and outbox.deliver(ok, b"a") and answers == [ok]


def test_migration_reports_count_only_from_the_batch_aggregators():
    state = pool_with("a", "b")
    migrations = Migrations(state, AggregatorOutbox(state, lambda identity, frames: None, 10.0))
    batch = migrations.batches[7] = Batch(7, "J", "a", "b", ["k"])
    report = {"mid": 7, "job": "J", "keys": ["k"]}
    migrations.copy_done(wire.decode(wire.encode(wire.TENSOR_COPY_DONE, **report)), "b")
    migrations.worker_done(wire.decode(wire.encode(wire.WORKER_DONE, **report)), "")      # an unknown peer
    assert batch.copied == set() and batch.workers == set()
    migrations.copy_done(wire.decode(wire.encode(wire.TENSOR_COPY_DONE, **report)), "a")
    assert batch.copied == {"k"}


def test_a_shared_memory_reference_with_a_negative_number_is_a_payload_error():
    memory = SharedMemory("test")
    fd = os.memfd_create("test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        good = memory.view(["s", "seg-good", os.getpid(), fd, 4096, 0], 64)
        assert not isinstance(good, PayloadError) and good.nbytes == 64
        good.release()
        for ref in (["s", "seg-1", os.getpid(), fd, -1, 0],        # mmap: "length must be positive"
                    ["s", "seg-2", os.getpid(), fd, 4096, -64],
                    ["s", "seg-3", -1, fd, 4096, 0]):
            assert isinstance(memory.view(ref, 64), PayloadError)
    finally:
        memory.close()
        os.close(fd)
