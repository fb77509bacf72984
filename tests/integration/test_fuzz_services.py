"""Malformed frames to a live pMaster and aggregator while another job trains on them.

Hypothesis draws malformed messages -- random bytes, broken envelopes, unknown operations,
a required field missing or of the wrong type, data-path items whose slices lie outside
their frames (truncated payloads), huge counts, lengths and shapes, wrong secrets,
shared-memory descriptors that point nowhere -- and sends each with a raw ZeroMQ DEALER
to pMaster or to one of the aggregator's endpoints (tcp, ipc, shm), a few at a time. After
them a probe on the same socket (STATUS to pMaster, a PULL of an unknown job to the
aggregator) proves the service read them: every reply before the probe's must be an error,
and not an "internal error" (an exception the service did not expect); no reply is fine
(a request parked, or a report that needs none). Meanwhile a victim job (two
workers, sum mode) trains on the same aggregator, its iterations interleaved with the
fuzzing; its final parameters must be bit-identical to a run without fuzzing, and both
processes must still be up and answering at the end. The pool's processes run under an
address-space limit, so a service that tried to allocate what a huge count asks for would
fail here instead of exhausting the machine.
"""
from __future__ import annotations

import itertools
import os
import resource
import select
import threading
import time

import msgpack
import numpy as np
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from autops.wire import protocol as wire
from autops.admin import query_status
from autops.worker.agent import Agent, AutoPSError
from autops.local import LocalPool
from autops.transport.stream import StreamChannel
from autops_testlib import secret_for

pytestmark = pytest.mark.timeout(240)

TENSORS = [("w", (40_000,), "float32"), ("m", (3_000,), "float32"), ("b", (37,), "float32")]
ITERS = 24
W = 2
EXAMPLES = 200
BATCH = 8                       # messages per example (a probe per endpoint follows them)
AS_HEADROOM = 3 << 30           # address space each pool process may still add
PROBE_TIMEOUT = 10.0            # seconds a live service may take to answer a probe

# ops each service serves (anything else it must refuse)
AGG_OPS = (wire.PUSH, wire.PUSH_PULL, wire.PULL, wire.INIT, wire.BCAST_PUT, wire.BCAST_GET, wire.TENSOR_COPY,
           wire.STATE_GET, wire.RECOVER, wire.REPLICATE)
# ...and answer without a job's secret by design: a warm comes back as it was sent
# (test_migration.py checks that echo and its limit), so it is no unknown op to refuse
AGG_ECHOED = (wire.WARM,)
MASTER_OPS = (wire.REGISTER_JOB, wire.DECLARE, wire.GET_TABLE, wire.JOB_DONE, wire.PROFILE, wire.HEARTBEAT,
              wire.REGISTER_AGG, wire.MIGRATE, wire.TENSOR_COPY_DONE, wire.WORKER_DONE)
HUGE = [2**31, 2**32 - 1, 2**40, 2**62, 2**63 - 1, 2**64 - 1]
INTS = st.one_of(st.sampled_from([-2**63, -1, 0, 1, 2, 3] + HUGE), st.integers(-2**63, 2**64 - 1))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12), st.binary(max_size=12))
GARBAGE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                       max_leaves=8)
REQS = st.one_of(st.none(), INTS, st.lists(INTS, max_size=2))      # never a str: probes use str reqs


# --------------------------------------------------------------------------- the pool

@pytest.fixture(scope="module")
def pool():
    pool = LocalPool(1, master_args=["--static", "--report-bind", "127.0.0.1:0"])     # reports: status every second
    pool.start()
    try:
        for proc in pool.procs:
            limit = psutil.Process(proc.pid).memory_info().vms + AS_HEADROOM
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, limit))
        yield pool
    finally:
        pool.stop()


def grad(rank: int, it: int, name: str, shape) -> np.ndarray:
    rng = np.random.default_rng([rank, it, sum(map(ord, name))])
    return rng.standard_normal(shape).astype(np.float32)


def train(master: str, job: str, before_iteration=lambda it: None) -> dict[str, bytes]:
    """A W=2 sum-mode job; returns rank 0's final parameters (as bytes: compared bit for bit)."""
    agents = [Agent(master, job, r, W, average=False, num_aggregators=0, timeout=30, secret=secret_for(job))
              for r in range(W)]
    params = [{n: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for n, s, _ in TENSORS}
              for _ in range(W)]
    errors: list[BaseException] = []
    try:
        for a in agents:
            a.declare(TENSORS)

        def work(rank: int) -> None:
            try:
                out = {n: np.empty(s, np.float32) for n, s, _ in TENSORS}
                for it in range(1, ITERS + 1):
                    before_iteration(it)
                    handles = [agents[rank].push_pull(n, grad(rank, it, n, s), out[n], it) for n, s, _ in TENSORS]
                    for h in handles:
                        h.wait()
                    for n, _, _ in TENSORS:
                        params[rank][n] -= np.float32(0.01) * out[n]
            except BaseException as exc:  # re-raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            raise errors[0]
        assert not any(t.is_alive() for t in threads), "the victim job hung"
    finally:
        for a in agents:
            a.close()
    for n, _, _ in TENSORS:
        assert params[0][n].tobytes() == params[1][n].tobytes()
    return {n: params[0][n].tobytes() for n, _, _ in TENSORS}


# --------------------------------------------------------------------------- the fuzzer's sockets

class Target:
    """A raw DEALER to one endpoint of the pool whose processes are ``procs``."""

    _probes = itertools.count()

    def __init__(self, ctx: zmq.Context, name: str, address: str, probe: dict, procs: list) -> None:
        self.name = name
        self.procs = procs
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.probe_fields = probe

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def receive(self, timeout: float) -> list | None:
        return self.sock.recv_multipart() if self.sock.poll(int(timeout * 1000)) else None

    def exchange(self, messages: list[list[bytes]]) -> list[wire.Message]:
        """Send ``messages`` (each a list of frames), then a probe; the replies that came
        before the probe's."""
        for frames in messages:
            self.send(frames)
        req = f"probe-{next(self._probes)}"
        self.send(wire.encode(req=req, **self.probe_fields))
        replies = []
        deadline = time.monotonic() + PROBE_TIMEOUT
        while time.monotonic() < deadline:
            dead = [f"{p.args[3]} (exit status {p.returncode})" for p in self.procs if p.poll() is not None]
            assert not dead, f"{', '.join(dead)} died after {messages!r:.600}"
            frames = self.receive(0.1)
            if frames is None:
                continue
            msg = wire.decode(frames)
            if msg.get("req") == req:
                return replies
            replies.append(msg)
        raise AssertionError(f"{self.name} did not answer a probe within {PROBE_TIMEOUT:g} s after {messages!r:.600}")

    def close(self) -> None:
        self.sock.close(0)


class StreamTarget(Target):
    """The same over the aggregator's ipc or stream endpoint (``stream.py``): the first
    frame is the message's header, the others its payloads."""

    def __init__(self, name: str, address: str, probe: dict, procs: list) -> None:
        self.name, self.procs, self.probe_fields = name, procs, probe
        self.channel = StreamChannel(address)

    def send(self, frames: list[bytes]) -> None:
        self.channel.send(frames[0], frames[1:])

    def receive(self, timeout: float) -> list | None:
        deadline = time.monotonic() + timeout
        while True:
            inbound = self.channel.recv()
            if inbound is not None:
                return [inbound.header, *map(bytes, inbound.payloads)]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([self.channel.pollable], [], [], left)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture(scope="module")
def fuzz_job(pool):
    """A job of the fuzzer's own (W=1, one small key), so that messages carrying its secret
    reach past the secret check."""
    agent = Agent(pool.master, "fuzz", 0, 1, average=False, num_aggregators=0, timeout=30, secret=secret_for("fuzz"))
    try:
        agent.declare([("f", (64,), "float32")])
        yield agent
    finally:
        agent.close()


# --------------------------------------------------------------------------- malformed messages

def envelope(op, fields: dict, **head) -> bytes:
    return msgpack.packb({"proto": "autops", "v": wire.VERSION, "op": op, **head, **fields}, use_bin_type=True)


def wrong_type(types: tuple) -> st.SearchStrategy:
    def fits(v) -> bool:
        return isinstance(v, types) and not (isinstance(v, bool) and int in types)
    return GARBAGE.filter(lambda v: not fits(v))


def skeleton(op: str) -> dict:
    """Fields of the right types for ``op`` (content that no job owns)."""
    sample = {int: 1, str: "nobody", list: [], tuple: [], dict: {}}
    return {name: sample[types[0]] for name, types in wire.SCHEMA[op].items()}


@st.composite
def raw_bytes(draw):
    return draw(st.lists(st.binary(max_size=200), min_size=1, max_size=4))


@st.composite
def not_a_message(draw):
    value = draw(GARBAGE.filter(lambda v: not isinstance(v, dict)))
    return [msgpack.packb(value, use_bin_type=True)]


@st.composite
def bad_envelope(draw):
    fields = {"proto": draw(st.sampled_from(["autops", "infiniswap", 7])), "v": wire.VERSION, "op": wire.PULL}
    defect = draw(st.sampled_from(["proto", "v", "no v", "op", "no op"]))
    if defect == "proto":
        fields["proto"] = draw(st.sampled_from(["infiniswap", "", 7, None]))
    elif defect == "v":
        fields["v"] = draw(st.sampled_from([wire.VERSION - 1, wire.VERSION + 1, str(wire.VERSION), True, None, 2.0]))
    elif defect == "op":
        fields["op"] = draw(st.one_of(INTS, st.none(), st.binary(max_size=4), st.lists(st.text(), max_size=2)))
    else:
        fields.pop(defect.split()[1])
    return [msgpack.packb(fields, use_bin_type=True)]


@st.composite
def unknown_op(draw, served):
    op = draw(st.one_of(st.text(max_size=16), st.sampled_from(sorted(set(wire.SCHEMA) - set(served) - {wire.OK}))))
    if op in served or op == wire.OK:
        op += "?"
    fields = skeleton(op) if op in wire.SCHEMA else draw(st.dictionaries(st.text(max_size=6), GARBAGE, max_size=4))
    return [envelope(op, fields, req=draw(REQS))]


@st.composite
def schema_violation(draw, served):
    op = draw(st.sampled_from(served))
    fields = skeleton(op)
    name = draw(st.sampled_from(sorted(fields)))
    if draw(st.booleans()):
        del fields[name]
    else:
        fields[name] = draw(wrong_type(wire.SCHEMA[op][name]))
    return [envelope(op, fields, req=draw(REQS))]


@st.composite
def huge_container(draw, served):
    """A valid envelope whose last field claims a huge array, map, str or bin, then stops."""
    op = draw(st.sampled_from(served))
    fields = skeleton(op)
    head = {"proto": "autops", "v": wire.VERSION, "op": op, **fields}
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in head.items())
    claim = draw(st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6"])) + draw(
        st.sampled_from([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x10\x00\x00"]))
    tail = draw(st.binary(max_size=16))
    return [bytes([0x80 | (len(head) + 1)]) + body + msgpack.packb("items") + claim + tail]


@st.composite
def job_fields(draw, ctx, with_rank=True):
    """job and secret: the fuzzer's own (valid), the victim's with a wrong secret, or nobody's."""
    who = draw(st.sampled_from(["fuzz", "victim", "nobody"]))
    if who == "fuzz":
        fields = {"job": "fuzz", "secret": ctx["secret"]}
    else:
        fields = {"job": "victim" if who == "victim" else "nobody", "secret": draw(st.text(max_size=32))}
    if with_rank:
        fields["rank"] = draw(st.sampled_from([0, 0, 0, 1, -1, 2**62]))
    return fields


SLICES = st.tuples(st.sampled_from([0, 0, 1, 5, -1, 2**62]), st.sampled_from([0, 0, 4, -4, 2**62, 2**64 - 1]),
                   st.sampled_from([256, 255, 0, 4, -256, 2**40, 2**63 - 1]))


@st.composite
def data_request(draw, ctx):
    """A data-path request with one defect: a slice outside its frame (truncated payload),
    a huge count, a wrong key, iteration or item shape, or someone else's job."""
    op = draw(st.sampled_from(AGG_OPS))
    fields = draw(job_fields(ctx))
    if op in (wire.RECOVER, wire.REPLICATE):      # failure handling: only someone else's job here
        fields["job"] = draw(st.sampled_from(["victim", "nobody"]))
        fields["items"] = draw(st.lists(GARBAGE, max_size=3))
        return [envelope(op, fields, req=draw(REQS))]
    payloads = draw(st.lists(st.binary(max_size=300), max_size=2))
    key = draw(st.sampled_from(["f", "f", "w", "nope", ""]))
    iteration = draw(st.sampled_from([1, 0, -1, 2, 2**62, 2**63 - 1]))
    payload, offset, nbytes = draw(SLICES)
    if op in (wire.PUSH, wire.PUSH_PULL):
        item = [key, iteration, payload, offset, nbytes, draw(st.one_of(st.none(), GARBAGE))]
        fields["items"] = [item[:draw(st.integers(0, 6))]] * draw(st.sampled_from([1, 1, 2]))
        in_frame = payload == 0 and offset == 0 and nbytes == 256 and payloads and len(payloads[0]) >= 256
        if fields["job"] == "fuzz" and key == "f" and iteration == 1 and fields["rank"] == 0 and in_frame \
                and len(fields["items"]) == 1 and len(item) >= 5:
            fields["items"][0][1] = 2**62                 # that push would be valid: make it a bad one
    elif op in (wire.PULL, wire.STATE_GET):
        readable = lambda v: isinstance(v, list) and len(v) >= 2 and type(v[0]) is str and v[1] == 0  # noqa: E731
        fields["items"] = draw(st.lists(st.one_of(GARBAGE.filter(lambda v: not readable(v)),
                                                  st.just([key, -abs(iteration) - 1])), min_size=1, max_size=3))
    elif op == wire.INIT:
        extra = draw(st.one_of(GARBAGE, st.just({"state": {"m": [payload, offset, nbytes]}})))
        fields["items"] = [[key, payload, -1 if fields["job"] == "fuzz" else offset, nbytes, extra]]
    elif op == wire.TENSOR_COPY:
        fields.pop("rank")
        fields.update(mid=draw(INTS), items=[[key, draw(GARBAGE), draw(st.sampled_from([2**62, 3, -1, 2**64 - 1]))]])
    elif op == wire.BCAST_PUT:
        fields.update(name=key, seq=draw(INTS), dtype="float32", shape=[draw(INTS)])
        payloads = draw(st.sampled_from([[], [b"x" * 8, b"y"]]))      # exactly one frame is valid
    else:                                                   # BCAST_GET: someone else's, or a bad rank
        fields.update(name=key, seq=draw(INTS))
        if fields["job"] == "fuzz":
            fields["rank"] = draw(st.sampled_from([-1, 1, 2**62]))
    return [envelope(op, fields, req=draw(REQS)), *payloads]


@st.composite
def master_request(draw, ctx):
    """A control request to pMaster with one defect: huge or malformed tensors, a wrong
    secret or rank, non-finite numbers, impossible registrations."""
    op = draw(st.sampled_from([wire.DECLARE, wire.DECLARE, wire.REGISTER_JOB, wire.GET_TABLE, wire.JOB_DONE,
                               wire.PROFILE, wire.MIGRATE, wire.TENSOR_COPY_DONE, wire.WORKER_DONE]))
    if op == wire.DECLARE:
        fields = draw(job_fields(ctx, with_rank=False))
        entry = st.one_of(
            st.tuples(st.sampled_from(["small", "f"]), st.lists(st.sampled_from([1, 7]), min_size=1, max_size=3),
                      st.sampled_from(["float32", "float64"])).map(list),
            st.lists(GARBAGE, max_size=5))
        tensors = draw(st.lists(entry, max_size=2))
        bad = draw(st.sampled_from([                      # every declaration has one bad entry: refused whole
            ["#", [1], "float32"], ["x", [-1], "float32"], ["x", [1], "int8"], ["x", [1], "float32", 5], ["x"], 7,
            ["huge", [2**41], "float32"], ["huge", [2**40, 2**40], "float32"], ["huge", [0, 2**64 - 1], "float32"],
            ["huge", [1] * 33, "float32"], ["f", [65], "float32"]]))
        tensors.insert(draw(st.integers(0, len(tensors))), bad)
        fields["tensors"] = tensors
    elif op == wire.REGISTER_JOB:
        fields = {"job": draw(st.sampled_from(["victim", "fuzz", "new", ""])),
                  "world_size": draw(st.sampled_from([0, -1, 2, 2**62])),
                  "rank": draw(st.sampled_from([-1, 2, 2**62])),
                  "num_aggregators": draw(st.sampled_from([2**62, 1, -1])),
                  "mode": draw(st.sampled_from(["sum", "avg", ""]))}
        if fields["job"] == "new" and fields["mode"] == "sum" and 0 <= fields["rank"] < fields["world_size"] \
                and fields["num_aggregators"] != 2**62:
            fields["rank"] = -1
    elif op in (wire.GET_TABLE, wire.JOB_DONE, wire.PROFILE):
        fields = draw(job_fields(ctx))
        fields.update(iteration=draw(INTS), count=draw(INTS), duration=draw(st.sampled_from(
            [float("nan"), float("inf"), -1.0, 1e308, "x"])))
        if op != wire.PROFILE and fields["job"] == "fuzz":
            fields["secret"] += "x"
    elif op == wire.MIGRATE:
        fields = {"job": draw(st.sampled_from(["victim", "fuzz", "nobody"])),
                  "keys": draw(st.one_of(GARBAGE, st.sampled_from([5, 2**62, [{}], [[1]], {"f": 1}, [None]]),
                                         st.lists(st.text(max_size=4), min_size=1, max_size=3))),
                  "to": draw(st.one_of(st.just(["agg-9"]), st.lists(INTS, min_size=1, max_size=2), st.just("agg-0")))}
    else:
        fields = {"mid": draw(INTS), "job": draw(st.sampled_from(["victim", "fuzz", "nobody"])),
                  "keys": draw(st.lists(GARBAGE, max_size=3))}
    return [envelope(op, fields, req=draw(REQS))]


@st.composite
def spoofed_reply(draw):
    """An OK or ERROR as if from an aggregator, answering requests pMaster may have sent
    to a real one (its request ids are small integers)."""
    op = draw(st.sampled_from([wire.OK, wire.ERROR]))
    fields = {"message": draw(st.text(max_size=8))} if op == wire.ERROR else {}
    req = draw(st.one_of(st.integers(1, 50), REQS))
    return [envelope(op, {**fields, "agg": "agg-0", "cutovers": draw(GARBAGE)}, req=req)]


@st.composite
def shm_descriptor(draw, ctx):
    """A lent-payload descriptor (shm endpoint) whose references point nowhere, at the
    wrong size, or past the end of a real segment."""
    if draw(st.booleans()):                                  # this process's real 4 KiB segment
        pid, fd = os.getpid(), ctx["memfd"]
    else:
        pid = draw(st.sampled_from([ctx["agg_pid"], os.getpid(), 1, 2**62, -1]))
        fd = draw(st.sampled_from([ctx["memfd"], 0, 1, 2, -1, 2**31]))
    size = draw(st.sampled_from([4096, 8192, 0, -1, 2**62, 2**64 - 1]))
    offset = draw(st.sampled_from([0, 4096, -1, 2**62]))
    nbytes = draw(st.sampled_from([256, 4096, -1, 2**63 - 1]))
    entry = [draw(st.sampled_from([0, 0, 0, 1, -1, 2**62])), "fuzz", draw(st.text(max_size=8)), pid, fd, size,
             offset, nbytes]
    entries = draw(st.sampled_from([[entry]] * 3 + [[entry, entry], [entry[:5]], [None], 5]))
    fields = draw(job_fields(ctx))
    fields["items"] = [["f", draw(st.sampled_from([2, 0, 2**62])), 0, 0, 256]]
    return [msgpack.packb(entries) + envelope(wire.PUSH, fields, req=draw(REQS))]


def messages(ctx) -> st.SearchStrategy:
    """(target name, frames) of one malformed message."""
    agg = st.sampled_from(["agg-tcp", "agg-stream", "agg-ipc", "agg-shm"])
    return st.one_of(
        st.tuples(st.sampled_from(["master", "agg-tcp", "agg-stream", "agg-ipc", "agg-shm"]), raw_bytes()),
        st.tuples(st.sampled_from(["master", "agg-tcp", "agg-shm"]), not_a_message()),
        st.tuples(st.sampled_from(["master", "agg-tcp"]), bad_envelope()),
        st.tuples(st.just("master"), unknown_op(MASTER_OPS + (wire.STATUS, wire.ERROR))),
        st.tuples(agg, unknown_op(AGG_OPS + AGG_ECHOED)),
        st.tuples(st.just("master"), schema_violation(MASTER_OPS)),
        st.tuples(agg, schema_violation(AGG_OPS)),
        st.tuples(st.just("master"), huge_container(MASTER_OPS)),
        st.tuples(agg, huge_container(AGG_OPS)),
        st.tuples(agg, data_request(ctx)),
        st.tuples(agg, data_request(ctx)),
        st.tuples(st.just("master"), master_request(ctx)),
        st.tuples(st.just("master"), master_request(ctx)),
        st.tuples(st.just("master"), spoofed_reply()),
        st.tuples(st.just("agg-shm"), shm_descriptor(ctx)),
        st.tuples(st.just("agg-shm"), shm_descriptor(ctx)),
    )


# --------------------------------------------------------------------------- the test

def test_malformed_frames_get_an_error_or_nothing_and_another_job_trains_unaffected(pool, fuzz_job):
    reference = train(pool.master, "victim-reference")

    status = query_status(pool.master)
    (agg,) = [a for a in status["aggregators"] if a["alive"]]
    memfd = os.memfd_create("fuzz", os.MFD_CLOEXEC)
    os.ftruncate(memfd, 4096)
    ctx = {"secret": fuzz_job.secret, "agg_pid": agg["pid"], "memfd": memfd}
    zctx = zmq.Context()
    unknown_pull = dict(op=wire.PULL, job="nobody", secret="", rank=0, items=[])
    targets = {"master": Target(zctx, "pMaster", pool.master, dict(op=wire.STATUS), pool.procs)}
    for kind in ("tcp", "shm"):
        targets[f"agg-{kind}"] = Target(zctx, f"aggregator ({kind})", agg["endpoints"][kind], unknown_pull,
                                        pool.procs)
    for kind in ("ipc", "stream"):      # stream: tcp without CURVE
        targets[f"agg-{kind}"] = StreamTarget(f"aggregator ({kind})", agg["endpoints"][kind], unknown_pull,
                                              pool.procs)

    progress = threading.Condition()
    sent = [0]
    finished = [False]

    def pace(it: int) -> None:
        """The victim's iteration ``it`` starts once the fuzzer is that far along."""
        with progress:
            progress.wait_for(lambda: finished[0] or sent[0] >= (it - 1) * EXAMPLES // ITERS, timeout=60)

    victim_result: dict = {}
    victim_error: list[BaseException] = []

    def victim() -> None:
        try:
            victim_result.update(train(pool.master, "victim", pace))
        except BaseException as exc:  # re-raised in the test thread
            victim_error.append(exc)

    runner = threading.Thread(target=victim)
    runner.start()
    accepted: list = []

    # no shrinking: after a service died every batch fails, and the batch that killed it is the answer
    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(messages(ctx), min_size=1, max_size=BATCH))
    def fuzz(batch):
        for name, target in targets.items():
            sent_here = [frames for to, frames in batch if to == name]
            if not sent_here:
                continue
            for reply in target.exchange(sent_here):
                if reply.op != wire.ERROR or str(reply.get("message", "")).startswith("internal"):
                    accepted.append((name, sent_here, reply.op, reply.fields))
            assert not accepted, f"{name} answered malformed messages with {accepted[-1][2:]}: {sent_here!r:.600}"
        with progress:
            sent[0] += 1
            progress.notify_all()

    try:
        fuzz()
    finally:
        with progress:
            finished[0] = True
            progress.notify_all()
        runner.join(180)
        for t in targets.values():
            t.close()
        zctx.term()
        os.close(memfd)
    assert not runner.is_alive(), "the victim job hung"
    if victim_error:
        raise victim_error[0]
    assert victim_result == reference, "the victim's parameters differ from the run without fuzzing"
    for proc in pool.procs:
        assert proc.poll() is None, f"{proc.args[3:5]} died with {proc.returncode}"
    status = query_status(pool.master)
    assert [a["alive"] for a in status["aggregators"]] == [True]


def test_a_job_larger_than_the_machine_is_refused_and_the_pool_stays_up(pool):
    """512 GiB is under the declaration limit, but no aggregator here can hold it: the
    aggregator says so instead of allocating."""
    agent = Agent(pool.master, "too-big", 0, 1, average=False, num_aggregators=0, timeout=30,
                  partition_bytes=1 << 40, secret=secret_for("too-big"))
    try:
        refused = r"refused the assignment: job 'too-big': .* bytes, this machine has \d+ available"
        with pytest.raises(AutoPSError, match=refused):
            agent.declare([("huge", (1 << 37,), "float32")])
    finally:
        agent.close()
    for proc in pool.procs:
        assert proc.poll() is None, f"{proc.args[3:5]} died with {proc.returncode}"
    assert [a["alive"] for a in query_status(pool.master)["aggregators"]] == [True]
