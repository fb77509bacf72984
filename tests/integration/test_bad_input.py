"""Bad requests get an error reply naming the problem, to that client only; the aggregator
keeps serving every other job."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from autops import wire
from autops.agent import Agent


@pytest.fixture
def setup(pool1):
    good = [Agent(pool1.master, "good", r, 2, timeout=20, average=False) for r in range(2)]
    victim = Agent(pool1.master, "victim", 0, 2, timeout=20)
    for a in good:
        a.declare([("w", (1000,), "float32")])
    victim.declare([("w", (1000,), "float32")])
    info = victim.table.aggs["agg-0"]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(info["endpoints"]["tcp"])
    try:
        yield good, victim, raw
    finally:
        raw.close(0)
        ctx.term()
        for a in good + [victim]:
            a.close()


def ask(raw, frames):
    raw.send_multipart(frames)
    assert raw.poll(5000), "no reply"
    return wire.decode(raw.recv_multipart())


def push_frames(victim, key="w", iteration=1, data=None, rank=0, secret=None):
    data = np.zeros(1000, np.float32) if data is None else data
    return wire.encode(wire.PUSH, [data], req=7, job=victim.job, secret=secret or victim.secret, rank=rank,
                       items=[[key, iteration, 0, 0, data.nbytes]])


CASES = [
    ("wrong shape", lambda v: push_frames(v, data=np.zeros(999, np.float32)), "carries 999 x float32, expected 1000"),
    ("wrong dtype", lambda v: push_frames(v, data=np.zeros(1000, np.float64)), "expected 1000 x float32"),
    ("wrong iteration", lambda v: push_frames(v, iteration=5), "iteration 5, but the open iteration is 1"),
    ("undeclared key", lambda v: push_frames(v, key="nope"), "'nope' is not declared"),
    ("rank out of range", lambda v: push_frames(v, rank=9), "rank 9 outside world size 2"),
    ("wrong secret", lambda v: push_frames(v, secret="0" * 32), "wrong secret"),
    ("pull undeclared", lambda v: wire.encode(wire.PULL, req=7, job=v.job, secret=v.secret, rank=0,
                                              items=[["ghost", 1]]), "'ghost' is not declared"),
    ("stale pull", lambda v: wire.encode(wire.PULL, req=7, job=v.job, secret=v.secret, rank=0,
                                         items=[["w", 7]]), "ahead of the open iteration"),
    ("garbage", lambda v: [b"\x00\xff garbage"], "undecodable header"),
    ("missing payload", lambda v: wire.encode(wire.PUSH, req=7, job=v.job, secret=v.secret, rank=0,
                                              items=[["w", 1, 0, 0, 4000]]), "payload frame 0 missing"),
    ("unknown op", lambda v: wire.encode(wire.STATUS, req=7), "not served by an aggregator"),
    ("unknown job", lambda v: wire.encode(wire.PULL, req=7, job="ghost-job", secret="x", rank=0, items=[]),
     "'ghost-job' is not served"),
]


@pytest.mark.parametrize("name, make, text", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_answered_with_an_error_and_others_keep_working(setup, name, make, text):
    good, victim, raw = setup
    reply = ask(raw, make(victim))
    assert reply.op == wire.ERROR
    assert text in reply["message"]
    # the bad request changed nothing: the victim job's open iteration is still 1 ...
    ok = ask(raw, push_frames(victim))
    assert ok.op == wire.PUSH_ACK
    # ... and another job is served normally
    outs = [np.empty(1000, np.float32) for _ in good]

    def work(r):
        good[r].push_pull("w", np.full(1000, r + 1.0, np.float32), outs[r], 1).wait()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for out in outs:
        np.testing.assert_array_equal(out, 3.0)


def test_duplicate_push_from_one_rank_is_refused(setup):
    _, victim, raw = setup
    assert ask(raw, push_frames(victim)).op == wire.PUSH_ACK
    reply = ask(raw, push_frames(victim))
    assert reply.op == wire.ERROR and "rank 0 already pushed 'w' iteration 1" in reply["message"]


def test_master_answers_bad_requests_with_errors(pool1):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pool1.master)
    try:
        for frames, text in [
            ([b"junk"], "undecodable"),
            (wire.encode(wire.DECLARE, job="none", secret="s", tensors=[]), "not registered"),
            (wire.encode(wire.REGISTER_JOB, job="x", world_size=2, rank=5, num_aggregators=1, mode="sum"),
             "outside world size"),
            (wire.encode(wire.REGISTER_JOB, job="x", world_size=1, rank=0, num_aggregators=1, mode="fancy"),
             "mode must be one of"),
            (wire.encode(wire.REGISTER_JOB, job="x", world_size=1, rank=0, num_aggregators=1, mode="server",
                         optimizer="lbfgs"), "lbfgs"),
        ]:
            sock.send_multipart(frames)
            assert sock.poll(5000)
            reply = wire.decode(sock.recv_multipart())
            assert reply.op == wire.ERROR and text in reply["message"], reply.fields
        # still alive
        sock.send_multipart(wire.encode(wire.STATUS))
        assert sock.poll(5000)
        assert wire.decode(sock.recv_multipart()).op == wire.OK
    finally:
        sock.close(0)
        ctx.term()
