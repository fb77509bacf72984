"""What a peer can make a shared aggregator hold (docs/autops.md, "Limits on what a peer can
make an aggregator hold"): idle connections to its plaintext stream endpoint beyond its
open-file limit do not kill it nor flood its log, and a job's push_pull still works; a job
declaring more than the per-job limit is refused with a clear error, and the aggregator's
memory does not grow."""
from __future__ import annotations

import resource
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from autops.agent import Agent, AutoPSError
from autops.local import LocalPool
from autops_testlib import secret_for

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
