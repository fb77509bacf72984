"""Chaos over the whole runtime: SIGKILLs at random times while all three systems work.

At once, on this machine:

* AutoPS: a ``sum`` job and a ``server`` job (W=2, two aggregators each) train round after
  round on one pool of four aggregator processes (admission control reserves each job's
  worst case: three cannot hold both); every round must be bit-identical to a failure-free one;
* Infiniswap: three daemon processes lend memory to a device whose loop device (on its FUSE
  file) is paged through with ``O_DIRECT`` reads and writes, each read checked against a model;
* Tiresias: a live master (local executor) runs three counter jobs on two emulated nodes, one
  of them in a memory cgroup, one waiting for GPUs.

A seeded schedule (the seed is printed; ``DLRT_CHAOS_SEED`` repeats it) SIGKILLs, at random
times and in random order: an aggregator (a replacement is started), an Infiniswap daemon
that holds slabs of the device (restarted at its address shortly after), a Tiresias run (its
supervisor and job processes, as a crash of its node would) and the Tiresias master (started
again on the same state dir shortly after).  Then: every AutoPS round equal to the
reference, zero pages wrong, every Tiresias job finished exactly once (none lost, none run
twice), and nothing left behind -- no FUSE mount, loop device, swap area, cgroup, front-end
state file or process of the test.  Every restart is done from the main thread (children die
with the thread that started them).  A watchdog fails the test past its budget.

The second test covers what the chaos test steers around (it kills a run's supervisor and job
processes together, and never the run of the job in a memory cgroup): a run whose supervisor
alone dies must have its job processes stopped and its cgroup removed before it starts again.

Root only; skips with the reason when FUSE, loop devices or memory cgroups are missing.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import uuid

import pytest

from autops.local import LocalPool
from chaos_lib import (TAG_ENV, AutoPSJobs, Census, Fault, FaultLog, PagedDevice, TiresiasJob, TiresiasJobs,
                       Watchdog, kill_pids, remove_cgroups, tagged_processes, wait_gone)
from tiresias_live import wait_for      # tests/integration: on the path since chaos_lib

BUDGET_S = 150.0          # the watchdog's; the test takes about a third of it
WINDOW_S = (1.0, 8.0)     # when the faults strike, after the warm-up
RESTART_S = (0.3, 1.5)    # how long a killed daemon or master stays down


def _skip_reason() -> str | None:
    from dlrt_bench.infiniswap_stack import missing
    from tiresias.service.cgroup import unavailable
    return missing() or unavailable()


@pytest.fixture
def tagged(monkeypatch, tmp_path):
    """A tag every process the test starts inherits (``$DLRT_CHAOS_TAG``) and a census of
    what the test makes (files under ``tmp_path``, cgroups and processes of its own).
    Afterwards whatever carries the tag is killed (by pid) and the cgroups it held are
    removed."""
    reason = _skip_reason()
    if reason:
        print(f"\nSKIPPED chaos test: {reason}")
        pytest.skip(reason)
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_ENV, tag)
    census = Census(tag, tmp_path)
    census.start()
    yield tag, census
    census.stop()
    kill_pids(list(tagged_processes(tag)))
    remove_cgroups(census.left_behind().get("cgroups", set()), tag)


class Chaos:
    """The schedule: each fault at its time, from the main thread, and the restarts it
    calls for; what was done is recorded in ``log``."""

    def __init__(self, rng: random.Random, pool: LocalPool, autops: AutoPSJobs, paging: PagedDevice,
                 tiresias: TiresiasJobs) -> None:
        self.rng, self.pool, self.autops, self.paging, self.tiresias = rng, pool, autops, paging, tiresias
        self.log = FaultLog()
        self.queue: list[tuple[float, str, object]] = []
        self.aggregator: dict = {}
        self.daemon: dict = {}
        self.killed_run: dict = {}
        self.master_fault: Fault | None = None

    def plan(self) -> None:
        actions = {"aggregator": self.kill_aggregator, "infiniswap daemon": self.kill_daemon,
                   "tiresias run": self.kill_run, "tiresias master": self.kill_master}
        for name, action in actions.items():
            self.at(self.rng.uniform(*WINDOW_S), name, action)

    def at(self, t: float, name: str, action) -> None:
        self.queue.append((t, name, action))
        self.queue.sort(key=lambda e: e[0])

    def run_all(self, healthy) -> None:
        """Run every planned action at its time (and the restarts they add); stop early
        when ``healthy()`` says a workload already failed."""
        while self.queue:
            t, _, action = self.queue.pop(0)
            while self.log.now() < t and healthy():
                time.sleep(0.02)
            if not healthy():
                return
            action()

    # --- the faults -------------------------------------------------------------------
    def kill_aggregator(self) -> None:
        try:           # in the middle of both jobs' rounds, if they get there in time
            wait_for(self.autops.mid_round, 10, "both AutoPS jobs in mid-round", step=0.002)
        except AssertionError:
            pass
        at = dict(self.autops.at)
        victim = self.rng.choice(sorted(self.pool.aggregators))
        killed_at = time.monotonic()
        self.autops.kill_aggregator(victim)
        fault = self.log.injected("aggregator", f"{victim}, jobs at iterations {at}")
        replacement = f"agg-r{len(self.pool.procs)}"
        self.pool.add_aggregator(replacement)
        self.aggregator = {"fault": fault, "victim": victim, "killed_at": killed_at,
                           "replacement": replacement}

    def kill_daemon(self) -> None:
        holders = wait_for(self.paging.holders, 10, "a daemon holding slabs of the device")
        victim = self.rng.choice(sorted(holders, key=lambda d: d.address))
        st = self.paging.stats()
        before = {"failures": st["daemon_failures"], "instance": st["daemons"][victim.address]["instance"]}
        victim.kill(signal.SIGKILL)
        fault = self.log.injected("infiniswap daemon", f"{victim.address} holding slabs {holders[victim]} "
                                                       f"({self.paging.transport})")
        self.daemon = {"fault": fault, "victim": victim, **before}
        self.at(self.log.now() + self.rng.uniform(*RESTART_S), "restart daemon", self.restart_daemon)

    def restart_daemon(self) -> None:
        victim = self.daemon["victim"]
        victim.restart()
        self.daemon["reads"] = self.paging.churn.reads
        self.log.note(f"infiniswap daemon restarted at {victim.address}")

    def kill_run(self) -> None:
        # not the job in a memory cgroup: a killed run's cgroup is never removed (a runtime bug
        # shown by the test below); a run that logged steps already, so that the check sees it
        # as a segment of its own in the step log (one killed before its first step leaves none)
        def kill_one():
            jobs = [j for j in self.tiresias.jobs if not j.memory and self.tiresias.supervisor(j)
                    and 15 <= self.tiresias.steps_left(j) < j.steps]
            if not jobs:
                return None
            job = self.rng.choice(jobs)
            left, master = self.tiresias.steps_left(job), "up" if self.tiresias.master_up else "down"
            n = self.tiresias.kill_run(job)
            return n and (job, f"job {job.job_id} ({job.name}), {n} processes, {left} steps to go, "
                               f"master {master}")
        job, detail = wait_for(kill_one, 10, "a Tiresias run to kill")
        self.killed_run = {"fault": self.log.injected("tiresias run", detail), "job": job}

    def kill_master(self) -> None:
        self.tiresias.kill_master()
        self.master_fault = self.log.injected("tiresias master", "the scheduler process")
        self.at(self.log.now() + self.rng.uniform(*RESTART_S), "restart master", self.restart_master)

    def restart_master(self) -> None:
        self.tiresias.restart_master()
        self.log.note("tiresias master restarted on the same state dir")


def autops_survived(chaos: Chaos) -> list[str]:
    """The lost aggregator declared dead, its replacement in, one more round of each job
    after that, and every round equal to the reference."""
    autops, agg = chaos.autops, chaos.aggregator
    autops.settle(30)
    settled_at = time.monotonic()
    wait_for(lambda: all(autops.passed_since(settled_at).values()) or autops.errors(), 40,
             "an AutoPS round of each job after the pool settled")
    autops.stop()
    if autops.errors():
        return autops.errors()

    def released() -> bool:       # every round's job gone from pMaster and the aggregators
        st = chaos.pool.status()
        return not st["jobs"] and all(not a["holds_jobs"] and not a["bytes_held"]
                                      for a in st["aggregators"] if a["alive"])
    wait_for(released, 15, "every AutoPS job released by pMaster and the aggregators")
    per_mode = ", ".join(f"{n} {m}" for m, n in autops.passed_since(0).items())
    agg["fault"].survived = (f"declared lost, replaced by {agg['replacement']}; "
                             f"{len(autops.hit_by(agg['killed_at']))} round(s) in flight at the kill; "
                             f"rounds {per_mode}, each equal to the reference "
                             f"({autops.refused} admission refusals retried)")
    return []


def paging_survived(chaos: Chaos) -> list[str]:
    """The failure noticed, the daemon back, every slab mapped again (the survivors cannot
    hold them all, so some on the restarted daemon), paging going on, zero pages wrong."""
    paging, dmn = chaos.paging, chaos.daemon
    victim = dmn["victim"]

    def back() -> bool:
        st = paging.stats()
        again = st["daemons"][victim.address]
        return bool(paging.churn.errors) or (
            st["daemon_failures"] == dmn["failures"] + 1 and again["reachable"]
            and again["instance"] not in (None, dmn["instance"]) and paging.all_mapped()
            and bool(st["mapped"].get(victim.address)) and paging.churn.reads > dmn["reads"] + 100)
    wait_for(back, 30, "the device to use the restarted daemon again")
    on_restarted = paging.stats()["mapped"].get(victim.address)
    problems = paging.verify_after_paging()
    if not problems:
        dmn["fault"].survived = (f"failure noticed, restarted, slabs {on_restarted} mapped on it again; "
                                 f"{paging.churn.reads} page reads checked, 0 wrong")
    return problems


def tiresias_survived(chaos: Chaos) -> list[str]:
    """Every job ended, exactly once; the killed run lost and resumed; the restarted master
    recovered from its state dir."""
    tiresias = chaos.tiresias
    wait_for(tiresias.all_ended, 90, "every Tiresias job to end")
    problems = tiresias.verify()
    recovered = [e for e in tiresias.master.client.get("/api/v1/events?limit=500") if e["kind"] == "recovered"]
    if not recovered:
        problems.append("the restarted Tiresias master recorded no recovery")
    if not problems:
        run = tiresias.master.job(chaos.killed_run["job"].job_id)["run"]
        chaos.killed_run["fault"].survived = f"lost, resumed as run {run}, finished once"
        chaos.master_fault.survived = (f"restarted: {recovered[-1]['detail']}; "
                                       f"{len(tiresias.jobs)} jobs finished once each")
    return problems


@pytest.mark.timeout(240)         # the watchdog fires first
def test_sigkills_across_autops_infiniswap_and_tiresias_cost_nothing(tmp_path, tagged):
    tag, census = tagged
    seed = int(os.environ.get("DLRT_CHAOS_SEED") or random.SystemRandom().randrange(2 ** 32))
    rng = random.Random(seed)
    transport = rng.choice(["shm", "tcp"])
    print(f"\nchaos seed {seed} (DLRT_CHAOS_SEED={seed} repeats the schedule); Infiniswap over {transport}")
    t_start = time.monotonic()
    problems: list[str] = []
    phase = ["start-up"]
    chaos: Chaos | None = None

    def describe() -> str:
        return f"in {phase[0]}; {chaos.log.summary() if chaos else 'no fault injected yet'}"

    with contextlib.ExitStack() as stack:
        with Watchdog(BUDGET_S, describe):
            pool = LocalPool(4, master_args=["--static", "--heartbeat-timeout", "2.0"],
                             aggregator_args=["--heartbeat-interval", "0.2"])
            stack.callback(pool.stop)
            pool.start()
            autops = AutoPSJobs(pool)
            autops.train_references()
            stack.callback(autops.stop)
            autops.start()
            (tmp_path / "infiniswap").mkdir()
            paging = PagedDevice(tmp_path / "infiniswap", transport, seed)
            stack.callback(paging.stop)
            paging.start()
            tiresias = TiresiasJobs(tmp_path / "tiresias")
            stack.callback(tiresias.stop)
            tiresias.start()

            phase[0] = "warm-up"
            wait_for(lambda: all(autops.passed_since(0).values()) or autops.errors(), 30,
                     "a first AutoPS round of each job")
            wait_for(lambda: paging.all_mapped() or paging.churn.errors, 30, "every slab mapped")
            wait_for(lambda: len(tiresias.running()) == 2, 30, "two Tiresias jobs running")

            phase[0] = "chaos"
            chaos = Chaos(rng, pool, autops, paging, tiresias)
            chaos.plan()

            def healthy() -> bool:
                return not autops.errors() and not paging.churn.errors

            chaos.run_all(healthy)
            if healthy():
                phase[0] = "recovery"
                problems += autops_survived(chaos)
                problems += paging_survived(chaos)
                problems += tiresias_survived(chaos)
            else:
                problems += autops.errors() + paging.churn.errors
            phase[0] = "clean-up"
    wait_gone(tag, 15)
    seen = census.stop()
    left = census.left_behind()
    print(f"chaos seed {seed}: {chaos.log.summary()}")
    print(f"chaos: {time.monotonic() - t_start:.0f} s; made by the test (all checked gone after): "
          + ", ".join(f"{n} {kind}" for kind, n in seen.items() if n))
    assert not problems, "\n".join(problems)
    assert not left, f"left behind: {left}"
    for kind in ("fuse mounts", "loop devices", "cgroups", "processes"):
        assert seen.get(kind), f"no {kind} seen during the test: the clean-up check proves nothing for them"
    assert len(chaos.log.faults) == 4 and all(f.survived for f in chaos.log.faults), chaos.log.summary()


@pytest.mark.timeout(120)
def test_a_run_whose_supervisor_dies_runs_once_and_leaves_nothing(tmp_path, tagged):
    tag, census = tagged
    job = TiresiasJob("orphaned", 1, 40, memory=256 << 20)
    tiresias = TiresiasJobs(tmp_path / "tiresias", jobs=[job])
    try:
        tiresias.start()
        wait_for(lambda: tiresias.supervisor(job) and len(tiresias.running()) == 1 and
                 tiresias.steps_left(job) < job.steps - 5, 30, "the job to count a few steps")
        os.kill(tiresias.supervisor(job), signal.SIGKILL)
        wait_for(tiresias.all_ended, 60, "the job to end")
        problems = tiresias.finished_once(job)
        try:             # the master itself keeps running
            wait_for(lambda: not set(tagged_processes(tag)) - {tiresias.master.proc.pid}, 5,
                     "every process of the job to be gone once it ended")
        except AssertionError as exc:
            problems.append(str(exc))
        left = census.left_behind()
        left.pop("processes", None)            # the master's
    finally:
        tiresias.stop()
    assert not problems and not left, f"{problems}; left behind once the job ended: {left}"
