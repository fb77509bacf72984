"""What a peer can make a shared aggregator hold (docs/autops.md, "Limits on what a peer can
make an aggregator hold"): idle connections to its plaintext stream endpoint beyond its
open-file limit do not kill it nor flood its log, and a job's push_pull still works; idle
connections on its tcp and ipc stream endpoints together hold no more than one cap for the
process; a job declaring more than the per-job limit is refused with a clear error, and the
aggregator's memory does not grow; in a memory cgroup, a declaration past what the cgroup can
hold is refused the same way instead of getting the aggregator OOM-killed."""
from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import psutil
import pytest

from autops.aggregator import memroom
from autops.worker.agent import Agent, AutoPSError
from autops.local import LocalPool
from autops_testlib import secret_for
from dlrt.procs import die_with_parent
from waiting import wait_for

NOFILE = 256
FLOOD = 400          # more connections than the aggregator can have descriptors
HANDSHAKE_S = 4


def _push_pull(master: str, job: str) -> None:
    agent = Agent(master, job, 0, 1, average=False, timeout=30, transport="tcp", secret=secret_for(job))
    try:
        agent.declare([("w", (1000,), "float32")])
        x = np.arange(1000, dtype=np.float32)
        out = np.empty_like(x)
        for it in (1, 2):
            agent.push_pull("w", x * it, out, it).wait()
            np.testing.assert_array_equal(out, x * it)
    finally:
        agent.close()


def _stream_endpoint(pool: LocalPool, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        aggs = [a for a in pool.status()["aggregators"] if a["alive"]]
        if aggs:
            return aggs[0]["endpoints"]["stream"]
        time.sleep(0.2)
    raise AssertionError("the aggregator did not register")


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_idle_connections_past_the_open_file_limit_leave_the_aggregator_serving(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD + 400), hard))
    logfile = tmp_path / "aggregator.log"
    with LocalPool(0, master_args=["--static"]) as pool, open(logfile, "w") as log:
        env = {**pool.env, "AUTOPS_STREAM_HANDSHAKE_S": str(HANDSHAKE_S), "DLRT_CURVE": "0"}
        proc = subprocess.Popen(["prlimit", f"--nofile={NOFILE}", sys.executable, "-m", "autops.cli", "aggregator",
                                 "--master", pool.master, "--name", "agg-0", "--bind-host", "127.0.0.1",
                                 "--log-level", "WARNING"], env=env, stdin=subprocess.DEVNULL, stderr=log)
        pool.procs.append(proc)
        pool.aggregators["agg-0"] = proc
        host, port = _stream_endpoint(pool)[len("tcp://"):].rsplit(":", 1)
        idle = []
        try:
            for _ in range(FLOOD):
                s = socket.socket()
                s.settimeout(5)
                s.connect((host, int(port)))     # the backlog takes them even while the aggregator does not
                idle.append(s)
            time.sleep(1.0)
            assert proc.poll() is None, f"the aggregator died with {proc.returncode}"
            _push_pull(pool.master, "during-flood")     # its connection makes room (oldest idle one closed)
            # past the handshake deadline every idle connection is closed by the aggregator
            deadline = time.monotonic() + HANDSHAKE_S + 10
            open_ones = list(idle)
            while open_ones and time.monotonic() < deadline:
                still = []
                for s in open_ones:
                    s.settimeout(0.01)
                    try:
                        if s.recv(1) == b"":
                            continue                  # closed by the aggregator
                    except (socket.timeout, BlockingIOError):
                        still.append(s)
                        continue
                    except OSError:
                        continue                      # reset: closed too
                    still.append(s)
                open_ones = still
                time.sleep(0.2)
            assert not open_ones, f"{len(open_ones)} idle connections still open past the handshake deadline"
        finally:
            for s in idle:
                s.close()
        assert proc.poll() is None, f"the aggregator died with {proc.returncode}"
        _push_pull(pool.master, "after-flood")
        assert proc.poll() is None
    lines = logfile.read_text().splitlines()
    assert len(lines) < 60, f"{len(lines)} log lines for {FLOOD} idle connections:\n" + "\n".join(lines[:20])
    assert not any("Traceback" in line for line in lines), "\n".join(lines)


def test_a_job_declaring_past_the_per_job_limit_is_refused_and_nothing_is_allocated():
    with LocalPool(1, master_args=["--static"], aggregator_args=["--max-job-bytes", "64M"]) as pool:
        agg = psutil.Process(pool.aggregators["agg-0"].pid)
        before = agg.memory_info().rss
        agent = Agent(pool.master, "greedy", 0, 1, average=False, num_aggregators=0, timeout=30,
                      partition_bytes=1 << 40, secret=secret_for("greedy"))
        try:
            with pytest.raises(AutoPSError, match=r"job 'greedy': its keys need \d+ bytes .*over this aggregator's "
                                                  r"limit of 67108864 bytes per job \(--max-job-bytes\)"):
                agent.declare([("huge", (1 << 28,), "float32")])      # 1 GiB, in one message
        finally:
            agent.close()
        grown = agg.memory_info().rss - before
        assert grown < 32 << 20, f"the aggregator's RSS grew by {grown} bytes"
        assert pool.aggregators["agg-0"].poll() is None
        _push_pull(pool.master, "modest")           # under the limit: served


PROCESS_CAP = 8      # $AUTOPS_STREAM_MAX_CONNECTIONS for the aggregator: one cap over all its endpoints


def _open_to(address: str) -> socket.socket:
    if address.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address[len("ipc://"):])
    else:
        host, port = address[len("tcp://"):].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
    return s


def _still_open(sockets: list) -> list:
    """Those of ``sockets`` the aggregator has not closed (nothing is ever sent on them)."""
    still = []
    for s in sockets:
        s.settimeout(0.01)
        try:
            if s.recv(1) == b"":
                continue
        except (socket.timeout, BlockingIOError):
            still.append(s)
            continue
        except OSError:
            continue
        still.append(s)
    return still


def test_idle_connections_on_both_stream_endpoints_share_one_cap_and_a_job_still_works():
    """An attacker opening idle connections on the tcp ``stream`` endpoint and on the ``ipc``
    one at once holds no more than the process's cap in all (each endpoint had a cap of its
    own before: twice as many); the oldest make room for the newer ones, and a victim job's
    connection still gets in and trains."""
    env = {"AUTOPS_STREAM_MAX_CONNECTIONS": str(PROCESS_CAP), "AUTOPS_STREAM_HANDSHAKE_S": "60",
           "DLRT_CURVE": "0"}
    with LocalPool(1, env=env, master_args=["--static"]) as pool:
        endpoints = next(a for a in pool.status()["aggregators"] if a["alive"])["endpoints"]
        assert endpoints["stream"].startswith("tcp://") and endpoints["ipc"].startswith("ipc://"), endpoints
        idle = []
        try:
            for i in range(3 * PROCESS_CAP):          # alternately on each endpoint
                idle.append(_open_to(endpoints["stream" if i % 2 == 0 else "ipc"]))
            open_ones = wait_for(lambda: (lambda left: left if len(left) <= PROCESS_CAP else None)(
                _still_open(idle)), timeout=15, what=f"at most {PROCESS_CAP} idle connections left open")
            assert len(open_ones) == PROCESS_CAP, len(open_ones)     # not a cap per endpoint (2x)
            assert pool.aggregators["agg-0"].poll() is None
            _push_pull(pool.master, "victim")          # its connection makes room (the oldest idle one)
            assert len(_still_open(idle)) <= PROCESS_CAP - 1
        finally:
            for s in idle:
                s.close()
        assert pool.aggregators["agg-0"].poll() is None


CGROUP_LIMIT = 192 << 20       # the aggregator's memory cgroup (v2 memory.max / v1 memory.limit_in_bytes)
PAST_CGROUP = 1 << 27          # float32 elements: 512 MiB, more than the cgroup can ever hold


@pytest.fixture
def memory_cgroup():
    """A fresh memory cgroup limited to ``CGROUP_LIMIT`` (``infiniswap.cgroup.MemoryCgroup``:
    v2 when its memory controller is there, else v1), removed afterwards -- what is still in it
    killed by pid first -- also when the test fails; skips without root or a memory controller."""
    from infiniswap.cgroup import MemoryCgroup, available
    why = available()
    if why is not None:
        pytest.skip(f"no memory cgroup to run the aggregator in: {why}")
    group = MemoryCgroup.create(CGROUP_LIMIT, name=f"autops-test-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        yield group
    finally:
        group.remove()


def _cgroup_figures(group) -> dict[str, int]:
    """The cgroup's limit hits and OOM events: v1 ``memory.failcnt`` and ``memory.oom_control``
    (``under_oom``, ``oom_kill``), v2 ``memory.events`` (``max``, ``oom``, ``oom_kill``)."""
    def read(name: str) -> str:
        with open(os.path.join(group.path, name)) as f:
            return f.read()

    if group.version == "v2":
        return {k: int(v) for k, v in (line.split() for line in read("memory.events").splitlines())}
    out = {"failcnt": int(read("memory.failcnt"))}
    out.update({k: int(v) for k, v in (line.split() for line in read("memory.oom_control").splitlines())})
    return out


def test_a_declaration_past_the_cgroups_memory_is_refused_not_oom_killed(memory_cgroup):
    """A peer registers its own job and declares one tensor larger than the aggregator's memory
    cgroup, on a host with far more MemAvailable and with --max-job-bytes far above the cgroup:
    only the cgroup's limit less usage (``memroom.cgroup_room``) stands in the way. The
    aggregator, in the cgroup from its first instruction, refuses it naming the cgroup limit
    and what it can give (less than the cgroup's limit), allocates nothing, is not OOM-killed
    (no limit hit, no OOM event), and still serves a modest job."""
    procs_file = os.path.join(memory_cgroup.path, "cgroup.procs")

    def enter_cgroup() -> None:          # in the child, before exec: every page it touches is charged
        with open(procs_file, "w") as f:
            f.write(str(os.getpid()))
        die_with_parent()

    with LocalPool(0, master_args=["--static"]) as pool:
        proc = subprocess.Popen([sys.executable, "-m", "autops.cli", "aggregator", "--master", pool.master,
                                 "--name", "agg-0", "--bind-host", "127.0.0.1", "--max-job-bytes", "64G",
                                 "--log-level", "WARNING"],
                                env=pool.env, stdin=subprocess.DEVNULL, preexec_fn=enter_cgroup)
        pool.procs.append(proc)
        pool.aggregators["agg-0"] = proc
        _stream_endpoint(pool)
        assert memory_cgroup.procs() == [proc.pid], "the aggregator is not (alone) in its memory cgroup"
        assert memroom.mem_available() > PAST_CGROUP * 4 + memroom.DEFAULT_HEADROOM, \
            "the host itself cannot give the declaration: its refusal would not show the cgroup's is read"
        agg = psutil.Process(proc.pid)
        before = agg.memory_info().rss
        agent = Agent(pool.master, "greedy", 0, 1, average=False, num_aggregators=0, timeout=30,
                      partition_bytes=1 << 40, secret=secret_for("greedy"))
        try:
            with pytest.raises(AutoPSError, match=r"job 'greedy': its keys need \d+ bytes, this machine has "
                                                  r"\d+ available for them \(host MemAvailable and cgroup "
                                                  r"limit") as refused:
                agent.declare([("huge", (PAST_CGROUP,), "float32")])
        finally:
            agent.close()
        need, offered = map(int, re.search(r"need (\d+) bytes, this machine has (\d+) available",
                                           str(refused.value)).groups())
        assert need >= PAST_CGROUP * 4 > CGROUP_LIMIT
        assert offered < CGROUP_LIMIT, f"it offered {offered} bytes: more than its cgroup's limit"
        grown = agg.memory_info().rss - before
        assert grown < 4 << 20, f"the aggregator's RSS grew by {grown} bytes"
        assert proc.poll() is None, f"the aggregator died with {proc.returncode}"
        figures = _cgroup_figures(memory_cgroup)
        hits = {k: v for k, v in figures.items() if k in ("failcnt", "under_oom", "oom_kill", "max", "oom") and v}
        assert not hits, f"the aggregator's cgroup hit its limit: {figures}"
        _push_pull(pool.master, "victim")           # a job that fits: served, by the same process
        assert proc.poll() is None, f"the aggregator died with {proc.returncode}"
        assert memory_cgroup.procs() == [proc.pid]
