"""The shared core: message envelope and versions, addresses, waker, child processes, and
the CLI convention (errors as one line and an exit status, argument types)."""
import argparse
import collections
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import threading

import msgpack
import pytest
import zmq

from dlrt import cli
from dlrt.endpoints import endpoint, host_port, is_loopback
from dlrt.messages import Protocol, ProtocolError, VersionMismatch
from dlrt.procs import THREAD_NAME_MAX, kill_tree, name_this_thread, stop_processes
from dlrt.trace import NoValidJob, TraceError
from dlrt.waker import Waker

V1 = Protocol("demo", 1, error_op="error")
V2 = Protocol("demo", 2, error_op="error")


def test_envelope_round_trip_carries_name_and_version():
    raw = V1.pack("ping", {"n": 3})
    assert msgpack.unpackb(raw) == {"proto": "demo", "v": 1, "op": "ping", "n": 3}
    assert V1.unpack(raw) == ("ping", {"n": 3})


def test_other_version_is_a_clear_error_naming_both_versions():
    with pytest.raises(VersionMismatch) as exc:
        V1.unpack(V2.pack("ping", {}))
    text = str(exc.value)
    assert "v2" in text and "v1" in text and "demo" in text
    assert isinstance(exc.value, ProtocolError)


def test_error_replies_are_readable_across_versions():
    op, fields = V2.unpack(V1.pack("error", {"message": "peer speaks v2"}))
    assert op == "error" and fields == {"message": "peer speaks v2"}


def test_another_protocol_is_refused():
    with pytest.raises(ProtocolError, match="not a demo message"):
        V1.unpack(Protocol("other", 1).pack("ping", {}))


@pytest.mark.parametrize("data, text", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2]), "not a dict"),
    (msgpack.packb({"op": "x"}), "version"),
    (msgpack.packb({"v": 1}), "op"),
    (msgpack.packb({"v": True, "op": "x"}), "version"),
    (msgpack.packb({"v": 1, "op": 5}), "op"),
    ("text", "bytes"),
])
def test_malformed_input_is_only_protocol_error(data, text):
    with pytest.raises(ProtocolError, match=text):
        V1.unpack(data)


@pytest.mark.parametrize("addr, bind, want", [
    ("tcp://127.0.0.1:7300", False, "tcp://127.0.0.1:7300"),
    ("127.0.0.1:7300", False, "tcp://127.0.0.1:7300"),
    ("mem1.example:7300", False, "tcp://mem1.example:7300"),
    ("tcp://127.0.0.1:0", True, "tcp://127.0.0.1:*"),
    ("tcp://*:7300", True, "tcp://*:7300"),
    ("[::1]:7300", False, "tcp://[::1]:7300"),
    ("ipc:///tmp/isw.sock", False, "ipc:///tmp/isw.sock"),
    (" tcp://h:1 ", False, "tcp://h:1"),
])
def test_endpoint_accepts(addr, bind, want):
    assert endpoint(addr, bind=bind) == want


@pytest.mark.parametrize("addr, text", [
    ("", "bad address"),
    ("host", "expected tcp://HOST:PORT"),
    ("tcp://host", "expected tcp://HOST:PORT"),
    ("udp://host:1", "only tcp://, ipc://"),
    ("tcp://host:0", "a port is needed to connect"),
    ("tcp://host:65536", "out of range"),
    ("ipc://", "the path is empty"),
])
def test_endpoint_rejects_with_the_address_named(addr, text):
    with pytest.raises(ValueError, match=text):
        endpoint(addr)


def test_host_port_and_loopback():
    assert host_port("tcp://10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert is_loopback("127.0.0.1") and is_loopback("tcp://127.0.0.1:1") and is_loopback("localhost:5")
    assert is_loopback("ipc:///tmp/s")
    assert not is_loopback("0.0.0.0") and not is_loopback("tcp://*:5555") and not is_loopback("10.0.0.1:5")


def test_waker_wakes_a_poller_until_cleared():
    w = Waker()
    try:
        assert select.select([w.fd], [], [], 0)[0] == []
        w.wake()
        w.wake()
        assert select.select([w.fd], [], [], 0)[0] == [w.fd]
        w.clear()
        assert select.select([w.fd], [], [], 0)[0] == []
    finally:
        w.close()
        w.close()        # idempotent
    w.wake()             # a closed waker ignores wakes


def test_a_wake_during_clear_is_not_lost(monkeypatch):
    """A thread that wakes while ``clear`` drains the pipe: its command is seen by the caller of
    ``clear`` (it was queued before), and the next wake must reach the pipe again."""
    w = Waker()
    real_read = os.read
    calls = []

    def read_with_a_wake_racing(fd, n):
        calls.append(fd)
        if len(calls) == 1:
            w.wake()
        return real_read(fd, n)

    try:
        w.wake()
        monkeypatch.setattr(os, "read", read_with_a_wake_racing)
        w.clear()
        monkeypatch.setattr(os, "read", real_read)
        assert calls
        w.wake()
        assert select.select([w.fd], [], [], 0)[0] == [w.fd]
    finally:
        w.close()


def test_waker_writes_once_per_wake_up_and_loses_no_command():
    w = Waker()
    try:
        for _ in range(5):
            w.wake()
        assert os.read(w.fd, 100) == b"x"       # one byte for the burst: one wake-up
        w.clear()
        w.wake()
        assert select.select([w.fd], [], [], 0)[0] == [w.fd]     # armed again after clear
        w.clear()

        # a producer thread queues and wakes; the consumer clears before it looks at the queue
        queue: collections.deque = collections.deque()
        done: list = []

        def consume() -> None:
            while len(done) < 20000:
                if not select.select([w.fd], [], [], 5)[0]:
                    return                      # a lost wake: the test fails on the count
                w.clear()
                while queue:
                    done.append(queue.popleft())

        consumer = threading.Thread(target=consume)
        consumer.start()
        for i in range(20000):
            queue.append(i)
            w.wake()
        consumer.join(30)
        assert done == list(range(20000))
    finally:
        w.close()


def test_stop_processes_kills_a_child_that_ignores_sigterm():
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stubborn.stdout.readline() == b"up\n"
        stop_processes([stubborn, polite], timeout=0.5)
        assert polite.returncode == -signal.SIGTERM
        assert stubborn.returncode == -signal.SIGKILL
    finally:
        for p in (stubborn, polite):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_exit_on_sigterm_unwinds_like_ctrl_c():
    code = ("import time; from dlrt.procs import exit_on_sigterm; exit_on_sigterm()\n"
            "try:\n    print('up', flush=True); time.sleep(60)\nfinally:\n    print('cleaned up', flush=True)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"up\n"
        child.terminate()
        assert child.wait(10) == 128 + signal.SIGTERM          # SystemExit(143), not death by signal
        assert child.stdout.read() == b"cleaned up\n"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_kill_tree_reaches_grandchildren():
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print(c.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        grandchild = int(parent.stdout.readline())
        assert kill_tree(parent.pid, include_root=True) == 2
        assert parent.wait(10) == -signal.SIGKILL
        import psutil
        try:
            psutil.Process(grandchild).wait(10)
        except psutil.NoSuchProcess:
            pass
        assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
        assert kill_tree(parent.pid) == 0        # gone: nothing to signal
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_periodic_fires_once_per_period_without_catch_up_bursts():
    from dlrt.periodic import Periodic
    t = Periodic(1.0, start=10.0)
    assert not t.due(9.5) and t.wait(9.5) == 0.5
    assert t.due(10.0) and t.deadline == 11.0
    assert not t.due(10.9)
    assert t.due(15.2)                  # a stall: one run, the next half a period away at least
    assert t.deadline == 15.7 and not t.due(15.6)
    never = Periodic(None, start=0.0)
    assert not never.due(1e9) and never.deadline == float("inf")
    import pytest
    with pytest.raises(ValueError):
        Periodic(0, start=0.0)


def test_control_thread_stops_a_loop_blocked_in_poll():
    import threading
    from dlrt.control import ControlThread
    entered = threading.Event()
    rounds = []

    def loop():
        while not ctl.stopping.is_set():
            entered.set()
            select.select([ctl.waker.fd], [], [], 60)      # blocks until woken
            ctl.waker.clear()
            rounds.append(1)

    ctl = ControlThread("test-loop", loop)
    ctl.start()
    assert entered.wait(10) and ctl.alive
    with pytest.raises(RuntimeError):
        ctl.start()
    ctl.stop()
    assert not ctl.alive and not ctl.started and rounds
    ctl.stop()                                            # idempotent
    ctl.close()


def failing(exc: BaseException):
    def run(_args):
        raise exc
    return run


@pytest.mark.parametrize("exc, status", [
    (NoValidJob("no valid job in t.csv: no rows after the header"), 1),
    (zmq.ZMQError(zmq.EADDRINUSE), 1),
    (sqlite3.OperationalError("unable to open database file"), 1),
    (TimeoutError("no answer within 1s"), 1),
    (ProtocolError("not msgpack"), 1),
    (RuntimeError("refused"), 1),
    (TraceError("t.csv:1: unrecognised trace header"), 2),
    (cli.UsageError("give --daemons"), 2),
    (ValueError("bad\nvalue\n"), 2),
])
def test_run_main_turns_expected_errors_into_one_line(capsys, exc, status):
    assert cli.run_main("demo cmd", failing(exc), argparse.Namespace()) == status
    err = capsys.readouterr().err
    assert err.startswith("demo cmd: error: ") and err.count("\n") == 1 and err.endswith("\n")
    assert " ".join(str(exc).split()) in err or str(exc) == ""


def test_run_main_keeps_the_traceback_of_a_bug():
    with pytest.raises(KeyError):
        cli.run_main("demo", failing(KeyError("bug")), argparse.Namespace())


def test_run_main_ctrl_c_is_130():
    assert cli.run_main("demo", failing(KeyboardInterrupt()), argparse.Namespace()) == 130


def test_usage_errors_are_one_line_and_exit_2(capsys):
    p = cli.parser("demo", "a demo")
    sub = cli.add_commands(p)
    c = cli.add_command(sub, "run", "run it")
    c.add_argument("--timeout", type=cli.positive(float), default=1.0)
    for argv, text in ((["run", "--timeout", "abc"], "expected a number, got 'abc'"),
                       (["run", "--timeout", "0"], "expected a number above 0, got '0'"),
                       (["run", "--log-level", "foo"], "invalid choice: 'FOO'"),
                       (["nope"], "invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as done:
            p.parse_args(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.count("\n") == 1 and ": error: " in err and text in err, err


@pytest.mark.parametrize("kind, text, ok", [
    (cli.positive(float), "0.5", 0.5), (cli.positive(int), "3", 3), (cli.non_negative(int), "0", 0),
    (cli.non_negative(float), "2.5", 2.5), (cli.port, "0", 0), (cli.port, "65535", 65535),
    (cli.share, "1", 1.0), (cli.share, "0.25", 0.25),
])
def test_number_types_accept(kind, text, ok):
    assert kind(text) == ok


@pytest.mark.parametrize("kind, text", [
    (cli.positive(float), "0"), (cli.positive(float), "-1"), (cli.positive(float), "nan"),
    (cli.positive(float), "inf"), (cli.positive(int), "1.5"), (cli.non_negative(int), "-1"),
    (cli.non_negative(float), "x"), (cli.port, "65536"), (cli.port, "-1"), (cli.port, "http"),
    (cli.share, "0"), (cli.share, "1.5"), (cli.share, "-0.1"), (cli.share, "nan"), (cli.share, "all"),
])
def test_number_types_refuse(kind, text):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
        kind(text)


def test_a_helper_thread_is_named_where_the_kernel_shows_it_and_the_main_thread_keeps_its_name():
    seen = {}

    def helper() -> None:
        seen["ok"] = name_this_thread("autops-reserve-of-a-long-name")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen["comm"] = f.read().strip()

    with open("/proc/self/comm") as f:
        before = f.read()
    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert seen["ok"] and seen["comm"] == "autops-reserve-of-a-long-name"[:THREAD_NAME_MAX]
    with open("/proc/self/comm") as f:
        assert f.read() == before
