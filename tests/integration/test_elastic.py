"""AutoPS elasticity end to end, with real pMaster and aggregator processes: the standby and
local providers, admission control, the status command, and a job profiled and packed while
pMaster publishes its reports.

The elastic decisions themselves (packing after a profile, revert below LossLimit, recycling
on job exit, scaling periods, job timeouts) are unit tests on a fake clock
(``tests/unit/test_autops_elastic.py``); nothing here depends on how long a sleep took: the
tests poll the pool's status until a condition holds, with generous deadlines.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from autops.worker.agent import Agent, AutoPSError
from autops_testlib import secret_for
from autops.local import LocalPool

TENSORS = [("w", (4000,), "float32"), ("b", (100,), "float32")]
FAST = ["--warmup-iters", "2", "--profile-iters", "5", "--period", "2"]


def wait_for(pool: LocalPool, pred, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    status = pool.status()
    while time.monotonic() < deadline:
        status = pool.status()
        if pred(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; status: {status}")


def job_of(status: dict, name: str) -> dict | None:
    return next((j for j in status["jobs"] if j["job"] == name), None)


class Job:
    """A W=2 sum-mode job in threads; ``sleep(it)`` is the emulated compute per iteration."""

    def __init__(self, master: str, name: str, sleep, iters: int, num_aggregators: int = 1) -> None:
        self.name, self.sleep, self.iters = name, sleep, iters
        self.agents = [Agent(master, name, r, 2, num_aggregators=num_aggregators, average=False, timeout=30,
                             secret=secret_for(name)) for r in range(2)]
        for a in self.agents:
            a.declare(TENSORS)
        self.errors: list = []
        self.wrong: list = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(r,)) for r in range(2)]
        for t in self.threads:
            t.start()

    def _work(self, rank: int) -> None:
        try:
            agent = self.agents[rank]
            out = {n: np.empty(s, np.float32) for n, s, _ in TENSORS}
            for it in range(1, self.iters + 1):
                if self.stop.is_set():
                    return
                time.sleep(self.sleep(it))
                handles = [agent.push_pull(n, np.full(s, it + rank, np.float32), out[n], it)
                           for n, s, _ in TENSORS]
                for h in handles:
                    h.wait(30)
                for n in out:
                    if not np.all(out[n] == 2 * it + 1):
                        self.wrong.append((rank, it, n, float(out[n][0])))
        except BaseException as exc:
            self.errors.append(exc)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        for a in self.agents:
            a.close()
        assert not self.errors, self.errors
        assert not self.wrong, self.wrong[:5]


def test_standby_aggregators_started_separately_and_admission_control():
    with LocalPool(0, master_args=FAST) as pool:
        with pytest.raises(AutoPSError, match="no aggregator is registered"):
            Agent(pool.master, "early", 0, 1, num_aggregators=1, timeout=5, secret=secret_for("early"))
        # an operator starts one aggregator on "another machine"
        pool._spawn("aggregator", "--master", pool.master, "--name", "cpu-7", "--bind-host", "127.0.0.1")
        wait_for(pool, lambda s: any(a["id"] == "cpu-7" and a["state"] == "idle" for a in s["aggregators"]),
                 20, "standby registration")
        with pytest.raises(AutoPSError, match="admission refused.*asks for 2"):
            Agent(pool.master, "big", 0, 1, num_aggregators=2, timeout=5, secret=secret_for("big"))
        job = Job(pool.master, "small", lambda it: 0.01, iters=30)
        try:
            assert job.agents[0].aggregators == ["cpu-7"]
            with pytest.raises(AutoPSError, match="admission refused.*can give 0"):
                Agent(pool.master, "second", 0, 1, num_aggregators=1, timeout=5, secret=secret_for("second"))
        finally:
            job.finish()
        # the job left: the aggregator is idle again and the next job is admitted
        wait_for(pool, lambda s: not s["jobs"] and all(a["state"] == "idle" for a in s["aggregators"]),
                 20, "release")
        Job(pool.master, "next", lambda it: 0.0, iters=3).finish()


def test_local_provider_starts_aggregators_on_demand_and_stops_them_after():
    with LocalPool(0, master_args=[*FAST, "--provider", "local", "--max-aggregators", "2"]) as pool:
        with pytest.raises(AutoPSError, match="admission refused.*asks for 3"):
            Agent(pool.master, "huge", 0, 1, num_aggregators=3, timeout=10, secret=secret_for("huge"))
        job = Job(pool.master, "spawned", lambda it: 0.01, iters=20, num_aggregators=2)
        try:
            started = {a["id"] for a in pool.status()["aggregators"]}
            assert len(started) == 2 and all(a.startswith("local-") for a in started)
        finally:
            job.finish()
        wait_for(pool, lambda s: not s["aggregators"], 20, "the started aggregators to stop")


def test_cli_status_prints_the_pool(pool2):
    job = Job(pool2.master, "shown", lambda it: 0.01, iters=10)
    try:
        out = subprocess.run([sys.executable, "-m", "autops.cli", "status", "--master", pool2.master],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "agg-0" in out.stdout and "shown" in out.stdout
    finally:
        job.finish()


def test_master_publishes_utilization_reports_and_prometheus_metrics():
    import urllib.request

    from autops.local import free_port
    from autops.master.report import subscribe
    pub, http = free_port(), free_port()
    with LocalPool(2, master_args=[*FAST, "--report-bind", f"tcp://127.0.0.1:{pub}", "--metrics-port", str(http),
                                   "--report-period", "0.3"]) as pool:
        job = Job(pool.master, "reported", lambda it: 0.02, iters=10_000, num_aggregators=2)
        try:
            wait_for(pool, lambda s: (job_of(s, "reported") or {}).get("state") == "packed"
                     and s["migrations"]["active"] == 0, 30, "packing")
            deadline = time.monotonic() + 15
            while True:
                report = subscribe(f"tcp://127.0.0.1:{pub}", timeout=5)
                jobs = {j["job"]: j for j in report["jobs"]}
                if jobs.get("reported", {}).get("state") == "packed" or time.monotonic() > deadline:
                    break
            assert report["type"] == "autops.utilization"
            j = jobs["reported"]
            assert j["tensors"] == 2 and j["bytes"] == 4100 * 4 and j["skew"] == pytest.approx(4000 / 4100, abs=1e-3)
            assert j["iteration_time_s"] > 0 and j["standalone_iteration_time_s"] > 0
            assert j["requested_aggregators"] == 2 and len(j["aggregators"]) == 1
            assert report["totals"]["aggregators_requested"] == 2
            text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5).read().decode()
            assert 'autops_job_tensors{job="reported"} 2.0' in text
            assert "autops_aggregator_cpu_percent" in text and "autops_migrations_completed_total" in text
        finally:
            job.finish()
