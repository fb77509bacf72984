"""The agent follows pMaster's table: a REDIRECT reply makes it refetch and resend; dead
aggregators are noticed through missing heartbeats and get no new jobs."""
from __future__ import annotations

import copy
import os
import signal
import threading
import time

import numpy as np
import pytest
import zmq

from autops.wire import protocol as wire
from autops.worker.agent import Agent, AutoPSError
from autops.worker.commands import TableCmd
from autops.local import LocalPool


def test_redirect_reply_refreshes_the_table_and_resends(pool1):
    agent = Agent(pool1.master, "redir", 0, 1, timeout=10, transport="tcp", average=False,
                  secret="redir-secret-0123456789")
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    seen = []

    def serve_redirects():
        while not seen and fake.poll(20000):      # the agent sends at once; a loaded machine may lag
            frames = fake.recv_multipart()
            msg = wire.decode(frames[1:])
            seen.append(msg.op)
            fake.send_multipart([frames[0], *wire.encode(wire.REDIRECT, req=msg.get("req"), items=[])])

    try:
        agent.declare([("w", (100_000,), "float32")])
        stale = copy.deepcopy(agent.table)
        stale.aggs["agg-0"] = {"endpoints": {"tcp": f"tcp://127.0.0.1:{port}"}, "host": "elsewhere"}
        agent._submit(TableCmd(stale))            # as if the key had lived on another aggregator
        server = threading.Thread(target=serve_redirects)
        server.start()
        out = np.empty(100_000, np.float32)
        agent.push_pull("w", np.full(100_000, 3.0, np.float32), out, 1).wait(20)
        server.join()
        assert seen == [wire.PUSH_PULL]           # the stale owner was asked, then redirected
        assert np.all(out == 3.0)                 # and the real aggregator served the resent request
    finally:
        fake.close(0)
        ctx.term()
        agent.close()


def test_dead_aggregator_is_noticed_and_not_given_new_jobs():
    pool = LocalPool(2, master_args=["--heartbeat-timeout", "1.5"])
    pool.start()
    try:
        victim = pool.procs[2]                    # agg-1, started by this test
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = {a["id"]: a["alive"] for a in pool.status()["aggregators"]}
            if alive == {"agg-0": True, "agg-1": False}:
                break
            time.sleep(0.2)
        assert alive == {"agg-0": True, "agg-1": False}
        # admission control: the worst case (2 aggregators of its own) cannot be met any more
        with pytest.raises(AutoPSError, match="admission refused.*asks for 2 aggregator"):
            Agent(pool.master, "after", 0, 1, num_aggregators=2, timeout=10, secret="after-secret-0123456789")
        agent = Agent(pool.master, "after", 0, 1, num_aggregators=1, timeout=10, secret="after-secret-0123456789")
        try:
            assert agent.aggregators == ["agg-0"]
        finally:
            agent.close()
    finally:
        pool.stop()
