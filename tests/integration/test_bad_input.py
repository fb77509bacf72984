"""Bad requests get an error reply naming the problem, to that client only; the aggregator
keeps serving every other job. Bad command lines get one clear line and exit status 2."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq

from autops.wire import protocol as wire
from autops.worker.agent import Agent


@pytest.fixture
def setup(pool1):
    good = [Agent(pool1.master, "good", r, 2, timeout=20, average=False, secret="good-secret-0123456789")
            for r in range(2)]
    victim = Agent(pool1.master, "victim", 0, 2, timeout=20, secret="victim-secret-0123456789")
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


# ---- the autops command line: bad input is one line and exit status 2 (dlrt.cli convention) ----

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_autops_bench_without_a_name_lists_the_benchmarks_and_starts_nothing():
    out = run_module("autops.cli", "bench")
    assert out.returncode == 2 and out.stderr == ""
    for name in ("pushpull", "packing", "migrate"):
        assert name in out.stdout


@pytest.mark.parametrize("args, texts", [
    (["bench", "--help"], ["pushpull", "packing", "migrate"]),
    (["bench", "pushpull", "--help"], ["autops bench pushpull", "--transport", "(default: 12)", "--json FILE"]),
    (["bench", "packing", "--help"], ["autops bench packing", "--jobs", "(default: 0.1)"]),
    (["bench", "migrate", "--help"], ["autops bench migrate", "--repeats", "(default: 3)"]),
    (["master", "--help"], ["(default: 127.0.0.1:5555)", "--log-level LEVEL"]),
    (["simulate", "--help"], ["--json FILE", "(default: 300.0)"]),
])
def test_autops_help_lists_benchmarks_and_shows_defaults(args, texts):
    out = run_module("autops.cli", *args)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())                  # help lines wrap
    for t in texts:
        assert t in text, t


def test_autops_status_takes_host_port_log_level_after_the_command_and_json_to_stdout(pool1, tmp_path):
    host_port = pool1.master[len("tcp://"):]
    out = run_module("autops.cli", "status", "--master", host_port, "--log-level", "warning", "--json", "-")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)                      # only JSON on stdout
    assert [a["id"] for a in status["aggregators"]] == ["agg-0"]
    saved = tmp_path / "status.json"                     # --json FILE: the file, and the table on stdout
    out = run_module("autops.cli", "--log-level", "WARNING", "status", "--master", pool1.master, "--json",
                     str(saved))
    assert out.returncode == 0, out.stderr
    assert "agg-0" in out.stdout and json.loads(saved.read_text())["aggregators"][0]["id"] == "agg-0"


@pytest.fixture
def bad_trace(tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("when,who\n1,2\n")
    return trace


@pytest.mark.parametrize("args, text", [
    (["status", "--log-level", "chatty"], "invalid choice: 'CHATTY'"),
    (["--log-level", "chatty", "status"], "invalid choice: 'CHATTY'"),
    (["status", "--json"], "--json: expected one argument"),
    (["status", "--master", "nowhere"], "bad address 'nowhere'"),
    (["master", "--bind", "tcp://127.0.0.1:99999"], "port 99999 is out of range"),
    (["aggregator", "--master", "127.0.0.1:5555", "--bind", "127.0.0.1:port"], "bad address '127.0.0.1:port'"),
    (["aggregator", "--master", "127.0.0.1:5555", "--prefault-share", "0"],
     "expected a number above 0 and at most 1, got '0'"),
    (["local"], "give the command to run after --"),
    (["simulate", "--trace", "BAD", "--no-progress"], "unrecognised trace header"),
    (["simulate", "--trace", "/nonexistent/trace.csv", "--no-progress"], "no such trace file"),
    (["bench", "frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "pushpull", "--model", "nosuch"], "model 'nosuch' is not in"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_autops_usage_errors_are_one_line_and_exit_2(bad_trace, args, text):
    out = run_module("autops.cli", *[str(bad_trace) if a == "BAD" else a for a in args])
    assert out.returncode == 2, out.stderr
    assert text in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_pushpull_on_cuda_without_a_gpu_fails_at_once_with_one_line():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tests/gpu runs the benchmark on it instead")
    out = run_module("autops.cli", "bench", "pushpull", "--device", "cuda", "--model", "flat64m", "--workers", "2")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "autops bench: error: --device cuda: no CUDA device here (torch.cuda.is_available() is False)"]


def test_the_same_bad_trace_exits_2_from_autops_simulate_and_tiresias(bad_trace):
    autops = run_module("autops.cli", "simulate", "--trace", str(bad_trace), "--no-progress")
    tiresias = run_module("tiresias.cli", "simulate", "--trace", str(bad_trace), "--cluster", "2x4")
    for out in (autops, tiresias):
        assert out.returncode == 2 and f"{bad_trace}:1: unrecognised trace header" in out.stderr
        assert "Traceback" not in out.stderr


def test_the_libraries_and_their_clis_do_not_import_the_benchmarks():
    code = ("import sys, autops, infiniswap, tiresias, autops.cli, infiniswap.cli, tiresias.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dlrt_bench'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    sim = subprocess.run([sys.executable, "-c", "import sys, autops.master.simulate; "
                          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tiresias'))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert sim.returncode == 0 and sim.stdout.strip() == "[]", sim.stderr    # reports and traces are data
