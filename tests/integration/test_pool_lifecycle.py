"""The lives of pMaster and the aggregators its local provider starts, with real processes.

* An aggregator is not tied to pMaster's life: it serves on after pMaster's SIGKILL and, heard
  from by no pMaster for ``--orphan-timeout`` seconds, exits by itself (the decision itself is
  a unit test on a fake clock, ``tests/unit/test_autops_orphan.py``).
* pMaster reaps every aggregator it started, whether killed or stopped on a scale-down, and a
  SIGTERMed pMaster stops the ones it runs.
* ``autops status`` shows the CPUs the aggregators can use, the pool's counting this host once.
* A pMaster restarted on the same address and state directory adopts its predecessor's
  aggregators with the job packed on them, the cluster and the aggregators' states, and stops
  them when it is stopped.
"""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import psutil

from autops.master import poolfiles
from autops.worker.agent import Agent
from autops.local import LocalPool
from autops.master.report import utilization_report
from autops_testlib import secret_for
from dlrt.cpus import usable_cpus
from test_elastic import FAST, Job, job_of, wait_for
from waiting import until

LOCAL = [*FAST, "--provider", "local", "--heartbeat-timeout", "2"]


def zombies(proc: psutil.Process) -> list[int]:
    return [c.pid for c in proc.children() if c.status() == psutil.STATUS_ZOMBIE]


def test_an_aggregator_serves_on_without_pmaster_and_exits_after_its_orphan_timeout():
    orphan = 4.0
    with LocalPool(0, master_args=[*LOCAL, "--max-aggregators", "1",
                                   "--aggregator-orphan-timeout", str(orphan)]) as pool:
        agent = Agent(pool.master, "lonely", 0, 1, num_aggregators=1, timeout=10, secret=secret_for("lonely"))
        try:
            agent.declare([("w", (1000,), "float32")])
            out = np.empty(1000, np.float32)
            agent.push_pull("w", np.full(1000, 1, np.float32), out, 1).wait(10)
            ((rec, agg),) = poolfiles.running(pool.state_dir).values()
            assert f"--orphan-timeout {orphan}" in " ".join(agg.cmdline()), "passed through by the provider"
            pool.kill_master()
            killed = time.monotonic()
            agent.push_pull("w", np.full(1000, 2, np.float32), out, 2).wait(10)     # served on
            assert out[0] == 2 and agg.is_running()
            agg.wait(timeout=orphan + 20)        # it exits by itself (init reaps it: pMaster is gone)
            gone = time.monotonic() - killed
            # pMaster answered its last heartbeat at most a heartbeat interval (1 s) before the kill
            assert orphan - 1.2 < gone < orphan + 20, gone
            assert poolfiles.running(pool.state_dir) == {}
        finally:
            agent.close()


def test_pmaster_reaps_every_aggregator_it_started_and_a_sigterm_stops_them():
    with LocalPool(0, master_args=[*LOCAL, "--max-aggregators", "2"]) as pool:
        master = psutil.Process(pool.procs[0].pid)
        job = Job(pool.master, "reaped", lambda it: 0.02, iters=100_000, num_aggregators=2)
        try:
            first = master.children()
            assert len(first) == 2 and all("aggregator" in c.cmdline() for c in first)
            # the CPUs: what each aggregator can use, the pool's counted once for the one host
            status = wait_for(pool, lambda s: all(a.get("cpus") for a in s["aggregators"]), 10, "heartbeats")
            assert [a["cpus"] for a in status["aggregators"]] == [usable_cpus()] * 2
            assert utilization_report(status)["totals"]["cpus"] == usable_cpus()
            shown = subprocess.run([sys.executable, "-m", "autops.cli", "status", "--master", pool.master],
                                   capture_output=True, text=True, timeout=30)
            cpus = usable_cpus()
            assert f"Aggregators: 2 (2 allocated), {cpus} CPU{'s' if cpus != 1 else ''} on 1 host\n" in shown.stdout
            first[0].kill()
            # reaped at once, before the heartbeat timeout (2 s) even declares it lost
            until("the killed aggregator to be reaped", lambda: first[0].pid not in {c.pid for c in master.children()},
                  1.5)
            assert not zombies(master)
            # the job's keys recover on the other one; then the job leaves
            wait_for(pool, lambda s: all(a["alive"] for a in s["aggregators"]
                                         if a["id"] in (job_of(s, "reaped") or {}).get("aggregators", ())), 20,
                     "the job's keys to recover")
        finally:
            job.finish()
        # released on the job's exit: stopped by pMaster and reaped, none left a zombie
        until("the released aggregators to be reaped", lambda: not master.children(), 30)
        agent = Agent(pool.master, "last", 0, 1, num_aggregators=1, timeout=3, secret=secret_for("last"))
        try:
            (agg,) = master.children()
            pool.procs[0].terminate()            # SIGTERM: pMaster stops the aggregators it started
            assert pool.procs[0].wait(15) == 0
            assert not psutil.pid_exists(agg.pid)
            assert poolfiles.running(pool.state_dir) == {}
            assert not list(poolfiles.records_dir(pool.state_dir).glob("*.json"))
        finally:
            agent.close()


def view(status: dict) -> dict:
    """What a restarted pMaster must have rebuilt: the alive aggregators' states and clusters,
    the clusters, and the jobs' packing (not timings, which go on changing)."""
    return {"aggregators": sorted((a["id"], a["state"], a["cluster"], a["exclusive"]) for a in status["aggregators"]
                                  if a["alive"]),
            "clusters": sorted((c["name"], c["aggregators"], c["jobs"]) for c in status["clusters"]),
            "jobs": sorted((j["job"], j["state"], j["cluster"], j["aggregators"], j["requested_aggregators"],
                            j["standalone_iteration_time_s"] is not None) for j in status["jobs"])}


def test_a_restarted_pmaster_adopts_its_predecessors_aggregators_packing_and_clusters():
    with LocalPool(0, master_args=[*LOCAL, "--max-aggregators", "3"]) as pool:
        job = Job(pool.master, "packed", lambda it: 0.02, iters=100_000, num_aggregators=2)
        try:
            wait_for(pool, lambda s: (job_of(s, "packed") or {}).get("state") == "packed"
                     and s["migrations"]["active"] == 0 and len(s["aggregators"]) == 1, 40,
                     "packing and the empty temporary's release")
            time.sleep(1.5)                      # a heartbeat answer carries the latest note
            before = view(pool.status())
            assert before["clusters"] and before["jobs"][0][1] == "packed"
            recorded = poolfiles.running(pool.state_dir)
            assert len(recorded) == 1
            pool.kill_master()
            pool.start_master()
            after = wait_for(pool, lambda s: (job_of(s, "packed") or {}).get("ranks_joined") == [0, 1], 20,
                             "the ranks to join the restarted pMaster")
            assert view(after) == before
            job.stop.set()
            for t in job.threads:
                t.join(60)
            assert not job.errors and not job.wrong
            adopted = [proc for _, proc in recorded.values()]
            assert all(proc.is_running() for proc in adopted)
            pool.procs[0].terminate()            # the restarted pMaster stops what it adopted
            assert pool.procs[0].wait(15) == 0
            _, alive = psutil.wait_procs(adopted, timeout=10)
            assert not alive and poolfiles.running(pool.state_dir) == {}
        finally:
            job.stop.set()
            for a in job.agents:
                a._master.timeout = 1.0          # pMaster is gone: do not wait long to say goodbye
                a.close()
