"""Aggregators SIGKILLed while a job trains: no step lost or applied twice.

A W=2 job trains on a pool of three aggregator processes; at random points one aggregator
is killed (and a fresh one started so the pool keeps its size). pMaster declares it lost
after its heartbeat timeout and moves its keys: ``sum``-mode keys are rebuilt from the
pushes the workers kept, ``server``-mode keys continue on their replica. The result must be
bit-identical to the same job trained without failures, in both modes, also when the kill
hits a migration; and when the workers' kept pushes are corrupted the check must catch it.
"""
from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from autops.worker import agent as agent_mod
from autops.worker import ioloop as ioloop_mod
from autops.admin import AdminClient
from autops.worker.agent import Agent, AutoPSError
from autops.local import LocalPool
from autops.wire.partition import plan_keys
from autops_testlib import TENSORS, W, ServerKeyJob, check_same, grad, holding, reported, secret_for

ITERS = 12
PARTITION_BYTES = 256 << 10
KEYS = len(plan_keys(TENSORS, PARTITION_BYTES))        # the keys of a job of TENSORS
_jobs = itertools.count()
_names = itertools.count(3)


@pytest.fixture(scope="module")
def pool():
    pool = LocalPool(3, master_args=["--static", "--heartbeat-timeout", "2.0"],
                     aggregator_args=["--heartbeat-interval", "0.2"])
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


class Killer:
    """Kills aggregators of the pool as the schedule says; ``replace`` starts as many new
    ones (from the main thread: a child started from a worker thread dies with that thread)."""

    def __init__(self, pool: LocalPool) -> None:
        self.pool = pool
        self.killed: list[tuple[str, float]] = []

    def kill(self, choice: int, owners: list[str]) -> None:
        names = sorted(self.pool.aggregators)
        victim = owners[choice % len(owners)] if choice >= 0 and owners else names[choice % len(names)]
        if victim not in self.pool.aggregators:
            return
        self.pool.kill_aggregator(victim)
        self.killed.append((victim, time.monotonic()))

    def replace(self) -> None:
        for _ in self.killed:
            self.pool.add_aggregator(f"agg-{next(_names)}")


def settled(pool: LocalPool, timeout: float = 30.0) -> None:
    """Wait until pMaster sees exactly the pool's aggregator processes alive (replacements
    registered, the killed ones declared lost)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {a["id"] for a in pool.status()["aggregators"] if a["alive"]}
        if alive == set(pool.aggregators):
            return
        time.sleep(0.05)
    raise TimeoutError(f"pool did not settle: {alive} vs {sorted(pool.aggregators)}")


def train(pool: LocalPool, mode: str, kills: dict[int, tuple], migrate_at: int | None = None,
          timeout: float = 30.0, iteration_hook=None, num_aggregators: int = 2, settle: bool = True,
          iters: int = ITERS, fused: bool | str = False, transport: str = "auto") -> dict:
    """One W=2 job of ``iters`` iterations. ``kills``: iteration -> (phase, choice, delay):
    phase ``start`` kills before the iteration's pushes, ``pushed`` once both ranks' pushes
    were acknowledged and before any pull, ``async`` ``delay`` seconds into the iteration from
    another thread. ``choice`` >= 0 picks among the job's owners, < 0 among all aggregators.
    ``fused``: each iteration is one in-place ``push_pull`` per tensor (as ``autops.torch``
    does), so ``pushed`` means once both ranks have the iteration's values; ``"rank0"``: only
    rank 0 does so, so at ``pushed`` rank 0 has pulled the iteration and rank 1 has not."""
    if settle:
        settled(pool)
    job = f"fail-{mode}-{next(_jobs)}"
    kw = dict(mode=mode, average=mode == "server", num_aggregators=num_aggregators, timeout=timeout,
              partition_bytes=PARTITION_BYTES, secret=secret_for(job), transport=transport)
    if mode == "server":
        kw.update(optimizer="adam", hp={"lr": 0.05})
    agents = [Agent(pool.master, job, r, W, **kw) for r in range(W)]
    killer = Killer(pool)
    barrier = threading.Barrier(W, timeout=timeout)
    results: dict = {}
    errors: list = []
    pauses: list[float] = []
    hooked: list[int] = []
    timers: list[threading.Timer] = []
    try:
        for a in agents:
            a.declare(TENSORS)
        if mode == "server":
            for n, s, _ in TENSORS:
                agents[0].init(n, np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)).wait()

        def work(rank: int) -> None:
            try:
                agent = agents[rank]
                out = {n: np.empty(s, np.float32) for n, s, _ in TENSORS}
                acc = {n: np.zeros(s, np.float64) for n, s, _ in TENSORS}
                for it in range(1, iters + 1):
                    t0 = time.monotonic()
                    phase, choice, delay = kills.get(it, (None, 0, 0.0))
                    barrier.wait()
                    if rank == 0 and iteration_hook is not None:
                        hooked.append(it)
                        while hooked:        # the main thread runs it (children die with their thread)
                            time.sleep(0.01)
                    if rank == 0:
                        owners = sorted(agent.placement())
                        if migrate_at == it:
                            with AdminClient(pool.master, 5) as admin:
                                admin.migrate(job)
                        if phase == "start":
                            killer.kill(choice, owners)
                        elif phase == "async":
                            timer = threading.Timer(delay, killer.kill, (choice, owners))
                            timers.append(timer)
                            timer.start()
                    if fused is True or (fused == "rank0" and rank == 0):
                        for n, s, _ in TENSORS:
                            np.copyto(out[n], grad(rank, it, n, s))
                        pushes = [agent.push_pull(n, out[n], out[n], it) for n, _, _ in TENSORS]
                    else:
                        pushes = [agent.push(n, grad(rank, it, n, s), it) for n, s, _ in TENSORS]
                    for h in pushes:
                        h.wait(timeout * 2)
                    barrier.wait()
                    if rank == 0 and phase == "pushed":
                        killer.kill(choice, sorted(agent.placement()))
                    barrier.wait()
                    pulls = [agent.pull(n, out[n], it) for n, _, _ in TENSORS if not (fused is True or
                                                                                       (fused and rank == 0))]
                    for h in pulls:
                        h.wait(timeout * 2)
                    for n in acc:
                        acc[n] += out[n]       # every pulled value counts: a stale read changes the sum
                    for timer in timers:       # a kill "during" this iteration happens before the next
                        timer.join()
                    pauses.append(time.monotonic() - t0)
                results[rank] = {n: (out[n].copy(), acc[n]) for n in out}
            except BaseException as exc:  # surfaced below
                errors.append(exc)
                barrier.abort()

        # daemons: a rank stuck after a failure must not keep the test process alive
        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(W)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            if hooked:
                try:
                    iteration_hook(hooked[0], job)
                except BaseException as exc:  # the ranks stop at their next barrier
                    errors.insert(0, exc)
                    barrier.abort()
                hooked.clear()
            time.sleep(0.005)
        if errors:
            raise errors[0]
    finally:
        for a in agents:
            a.close()
        killer.replace()
    return {"results": results, "killed": killer.killed, "longest_iteration_s": max(pauses), "job": job}


@pytest.fixture(scope="module")
def references(pool):
    return {mode: train(pool, mode, {}) for mode in ("sum", "server")}


kill_points = st.tuples(st.integers(2, ITERS - 2),
                        st.sampled_from(["start", "pushed", "async"]),
                        st.integers(-3, 3),
                        st.floats(0.0, 0.05))


@pytest.mark.parametrize("mode", ["sum", "server"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.generate])    # no shrinking: each example takes seconds
@given(point=kill_points)
def test_an_aggregator_killed_at_a_random_point_costs_no_step(pool, references, mode, point):
    it, phase, choice, delay = point
    got = train(pool, mode, {it: (phase, choice, delay)})
    assert got["killed"], "the schedule killed nothing"
    check_same(got, references[mode])
    print(f"{mode}: killed {got['killed'][0][0]} at iteration {it} ({phase}); longest iteration "
          f"{got['longest_iteration_s']:.2f}s")


@pytest.mark.parametrize("mode", ["sum", "server"])
@pytest.mark.parametrize("victim", ["source", "destination"])
def test_an_aggregator_killed_during_a_migration_costs_no_step(pool, references, mode, victim):
    # every key moves at iteration 4; the old (or a new) owner dies while the copies are under way
    got = train(pool, mode, {4: ("async", 0 if victim == "source" else -1, 0.0)}, migrate_at=4)
    assert got["killed"]
    check_same(got, references[mode])


def test_the_staged_push_is_the_kept_copy_and_replays_exactly(pool, references, monkeypatch):
    # same host: a large key's push is staged in shared memory the aggregator reads in place;
    # the staged buffer itself is what the worker keeps for a replay (no second copy), so the
    # next push must go to the key's other staged buffer and the replay must still be exact
    keep = ioloop_mod.IOLoop.keep
    kinds: list[str] = []

    def record(self, spec, iteration, data, staged=None, borrow=False):
        kinds.append("staged" if staged is not None else "copied")
        keep(self, spec, iteration, data, staged, borrow)
        if staged is not None:
            assert not any(arr is staged.array for it, arr in self.kept[spec.key].items() if it != iteration), \
                "a staged buffer was reused while it still held a kept push"

    monkeypatch.setattr(ioloop_mod.IOLoop, "keep", record)
    got = train(pool, "sum", {5: ("pushed", 0, 0.0)})
    assert got["killed"]
    assert kinds.count("staged") > kinds.count("copied"), kinds[:20]
    check_same(got, references["sum"])


@pytest.mark.parametrize("mode", ["sum", "server"])
def test_a_kept_push_still_holds_what_was_pushed_after_the_aggregation(pool, monkeypatch, mode):
    # what a rank replays after a failure must be its own push, whatever the aggregator did
    # with the staged memory it read it from (in server mode it sums into the first one)
    settled(pool)
    keep = ioloop_mod.IOLoop.keep
    loops: dict[int, object] = {}

    def capture(self, spec, iteration, data, staged=None, borrow=False):
        loops[self.config.rank] = self
        keep(self, spec, iteration, data, staged, borrow)

    monkeypatch.setattr(ioloop_mod.IOLoop, "keep", capture)
    job = f"kept-{mode}-{next(_jobs)}"
    kw = dict(mode=mode, average=True, num_aggregators=1, timeout=10, partition_bytes=256 << 10,
              secret=secret_for(job))
    if mode == "server":
        kw.update(optimizer="sgd", hp={"lr": 0.1})
    agents = [Agent(pool.master, job, r, W, **kw) for r in range(W)]
    try:
        for a in agents:
            a.declare([("big", (120_000,), "float32")])
        if mode == "server":
            agents[0].init("big", np.zeros(120_000, np.float32)).wait()
        out = [np.empty(120_000, np.float32) for _ in range(W)]
        for it in (1, 2):
            grads = [grad(r, it, "big", (120_000,)) for r in range(W)]
            handles = [a.push_pull("big", grads[r], out[r], it) for r, a in enumerate(agents)]
            for h in handles:
                h.wait(10)
            for r in range(W):
                kept = loops[r].kept
                assert kept, "nothing kept"
                for key, by_iteration in kept.items():
                    spec = next(s for s in agents[r].keys_of("big") if s.key == key)
                    np.testing.assert_array_equal(by_iteration[it], grads[r][spec.offset:spec.offset + spec.numel],
                                                  err_msg=f"rank {r} key {key} iteration {it}")
    finally:
        for a in agents:
            a.close()


def test_corrupted_replay_is_caught(pool, references, monkeypatch):
    keep = ioloop_mod.IOLoop.keep

    def corrupt(self, spec, iteration, data, staged=None, borrow=False):
        keep(self, spec, iteration, data + 1)       # a wrong copy instead of the staged push

    monkeypatch.setattr(ioloop_mod.IOLoop, "keep", corrupt)
    # killed after both pushes, before any pull: the new owners rebuild the iteration from the
    # workers' kept copies, which are wrong now
    got = train(pool, "sum", {5: ("pushed", 0, 0.0)})
    with pytest.raises(AssertionError):
        check_same(got, references["sum"])


@pytest.mark.parametrize("phase, fused", [("start", True), ("async", True), ("pushed", "rank0")])
def test_push_pull_over_a_socket_recovers_from_the_values_the_workers_pulled(pool, references, monkeypatch,
                                                                           phase, fused):
    # sum mode over ipc: a push_pull's push is kept by reference, not copied, and once its
    # value is pulled the value stands in for it; after a kill the new owners start from the
    # values the workers hand over in RECOVER (and from replayed pushes for what nobody pulled).
    # "rank0": killed when rank 0 has pulled the iteration and rank 1 (plain push, then pull)
    # has not: rank 1 reads the value rank 0 handed over
    keep, request = ioloop_mod.IOLoop.keep, ioloop_mod.IOLoop.request
    kinds: list[str] = []
    recovered_values: list[int] = []

    def record(self, spec, iteration, data, staged=None, borrow=False):
        kinds.append("borrowed" if borrow else "staged" if staged is not None else "copied")
        keep(self, spec, iteration, data, staged, borrow)

    def count(self, agg, kind, parts, op, payloads=(), **fields):
        if op == agent_mod.wire.RECOVER:
            recovered_values.append(len(payloads))
        request(self, agg, kind, parts, op, payloads, **fields)

    monkeypatch.setattr(ioloop_mod.IOLoop, "keep", record)
    monkeypatch.setattr(ioloop_mod.IOLoop, "request", count)
    got = train(pool, "sum", {5: (phase, 0, 0.01)}, fused=fused, transport="ipc")
    assert got["killed"]
    assert "borrowed" in kinds and (fused is not True or set(kinds) == {"borrowed"}), sorted(set(kinds))
    assert sum(recovered_values) > 0, recovered_values
    check_same(got, references["sum"])


@pytest.fixture(scope="module")
def pool_cma():
    from autops.transport.cma import available
    if available() is not None:
        pytest.skip(f"cma unavailable: {available()}")
    pool = LocalPool(3, master_args=["--static", "--heartbeat-timeout", "2.0"],
                     aggregator_args=["--heartbeat-interval", "0.2", "--transport", "cma"])
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.mark.parametrize("mode, phase, fused", [("sum", "async", True), ("sum", "pushed", "rank0"),
                                                ("server", "pushed", False)])
def test_over_cma_a_killed_aggregator_costs_no_step(pool_cma, references, mode, phase, fused):
    """A READ from a killed aggregator fails (the process is gone): the request waits for the
    failover like any other; the pushes, kept by reference as over a socket, replay exactly."""
    got = train(pool_cma, mode, {5: (phase, 0, 0.01)}, fused=fused, transport="cma")
    assert got["killed"]
    check_same(got, references[mode])


def test_a_corrupted_recovered_value_is_caught(pool, references, monkeypatch):
    answered = ioloop_mod.IOLoop.pulled_answered

    def corrupt(self, key, iteration, value=None):
        answered(self, key, iteration, None if value is None else value + 1)

    monkeypatch.setattr(ioloop_mod.IOLoop, "pulled_answered", corrupt)
    # killed when rank 0 has pulled iteration 5 and rank 1 has not: rank 1 reads the value
    # rank 0 kept, which is wrong now
    got = train(pool, "sum", {5: ("pushed", 0, 0.0)}, fused="rank0", transport="ipc")
    with pytest.raises(AssertionError):
        check_same(got, references["sum"])


def test_server_mode_without_replication_fails_clearly(pool):
    settled(pool)
    job = f"norep-{next(_jobs)}"
    agents = [Agent(pool.master, job, r, 1, mode="server", optimizer="sgd", hp={"lr": 0.1}, timeout=10,
                    fault_tolerant=False, num_aggregators=1, secret=secret_for(job)) for r in range(1)]
    try:
        a = agents[0]
        a.declare([("w", (1000,), "float32")])
        a.init("w", np.zeros(1000, np.float32)).wait()
        out = np.empty(1000, np.float32)
        a.push_pull("w", np.ones(1000, np.float32), out, 1).wait()
        (owner,) = a.placement()
        settled(pool)
        pool.kill_aggregator(owner)
        pool.add_aggregator(f"agg-{next(_names)}")
        with pytest.raises(AutoPSError, match="no replica"):
            a.push_pull("w", np.ones(1000, np.float32), out, 2).wait(30)
    finally:
        for a in agents:
            a.close()


VANISHING_WORKER = """
import sys, time
import numpy as np
from autops.agent import Agent
a = Agent(sys.argv[1], sys.argv[2], 0, 1, mode="server", optimizer="adam", hp={"lr": 0.1}, timeout=10,
          secret=sys.argv[3])
a.declare([("w", (50_000,), "float32")])
a.init("w", np.zeros(50_000, np.float32)).wait()
out = np.empty(50_000, np.float32)
for it in range(1, 4):
    a.push_pull("w", np.ones(50_000, np.float32), out, it).wait()
print("trained", flush=True)
time.sleep(600)
"""


def test_a_new_replica_after_a_failure_makes_the_states_memory_ready_before_it_comes():
    """Server mode, a key large enough to be populated off the loops, on three aggregators:
    its replica is killed. The aggregator that replaces it readies the master copy and the
    momentum at once (``replica_prepare``) before the owner is told to send it the state,
    then backs the key up; the results stay exact through the loss."""
    shape = (1_500_000,)                # 6 MiB: populated by a helper thread
    job = f"rereplicate-{next(_jobs)}"
    with LocalPool(3, master_args=["--static", "--heartbeat-timeout", "2.0"],
                   aggregator_args=["--heartbeat-interval", "0.2"]) as small:
        with ServerKeyJob(small, job, shape, timeout=30) as run:
            owner = run.owner()
            replica = next(iter(holding(small, job) - {owner}))
            (third,) = set(small.aggregators) - {owner, replica}
            for it in range(1, 9):
                if it == 3:
                    small.kill_aggregator(replica)
                run.step(it)
            assert third in holding(small, job, including=third), "the third aggregator backs the key up"
        nbytes = int(np.prod(shape)) * 4
        stats = reported(small, [third], "at_once_prefaulted_bytes")[third]
    assert stats["at_once_prefaulted_bytes"] >= 2 * nbytes, stats      # master copy, momentum
    assert stats["at_once_prefault_cpu_s"] > 0 and stats["prefaulted_bytes"] == 0, stats


def test_a_job_whose_workers_vanish_is_released_with_its_replicas():
    import subprocess
    import sys
    with LocalPool(2, master_args=["--static", "--job-timeout", "1.0"]) as small:
        job = f"vanish-{next(_jobs)}"
        worker = subprocess.Popen([sys.executable, "-c", VANISHING_WORKER, small.master, job, secret_for(job)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout.readline().strip() == "trained"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:      # until both have heartbeated since
                status = small.status()
                holders = {a["id"] for a in status["aggregators"] if job in a["holds_jobs"]}
                if len(holders) == 2:
                    break
                time.sleep(0.1)
            (entry,) = [j for j in status["jobs"] if j["job"] == job]
            assert holders == {"agg-0", "agg-1"}, "owner and replica both hold the job"
            assert len(entry["aggregators"]) == 1, "one owner: the other aggregator holds the replica"
            worker.kill()          # gone without shutdown(): no JOB_DONE
            worker.wait()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                status = small.status()
                if not status["jobs"] and not any(job in a["holds_jobs"] for a in status["aggregators"]):
                    break
                time.sleep(0.1)
            assert not status["jobs"], "the job was released after --job-timeout"
            assert all(a["bytes_held"] == 0 for a in status["aggregators"]), status["aggregators"]
        finally:
            worker.kill()
            worker.wait()


@pytest.mark.parametrize("mode", ["sum", "server"])
def test_a_restarted_pmaster_adopts_its_running_jobs(pool, references, mode):
    # pMaster is SIGKILLed before iteration 4 and started again on the same address before 7
    # (training goes on meanwhile); before 10 the aggregators must have registered again with
    # what they hold and both workers joined the rebuilt job again
    def hook(it: int, job: str) -> None:
        if it == 4:
            pool.kill_master()
        elif it == 7:
            pool.start_master()
        elif it == 10:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    status = pool.status()
                except Exception:  # not answering yet
                    status = {"jobs": [], "aggregators": []}
                rejoined = [j for j in status["jobs"] if j["job"] == job
                            and j["ranks_joined"] == [0, 1] and j["keys"] == KEYS]
                alive = {a["id"] for a in status["aggregators"] if a["alive"]}
                if rejoined and alive == set(pool.aggregators):
                    return
                time.sleep(0.1)
            raise AssertionError(f"the job was not rebuilt: {status}")

    got = train(pool, mode, {}, iteration_hook=hook)
    check_same(got, references[mode])
    status = pool.status()
    assert got["job"] not in {j["job"] for j in status["jobs"]}, "released at the end"


def test_with_no_aggregator_left_the_provider_starts_one_that_takes_the_keys():
    # a pool whose aggregators pMaster starts itself (local provider): the job's only
    # aggregator is killed; the recovered keys go to a fresh one
    small = LocalPool(0, master_args=["--static", "--provider", "local", "--max-aggregators", "1",
                                      "--heartbeat-timeout", "2.0"])
    with small:
        ref = train(small, "sum", {}, num_aggregators=1, settle=False)

        def kill_owner(it: int, job: str) -> None:
            if it == 5:
                (agg,) = [a for a in small.status()["aggregators"] if a["alive"]]
                os.kill(agg["pid"], signal.SIGKILL)

        got = train(small, "sum", {}, num_aggregators=1, settle=False, iteration_hook=kill_owner)
        check_same(got, ref)
        status = small.status()
        assert status["failover"]["lost_aggregators"] and status["failover"]["recovered_keys"] == KEYS


ITERS_PACKED = 300


def test_a_packed_jobs_lost_keys_are_packed_again_in_its_cluster():
    # an elastic pool: the job is profiled and packed, then the aggregator holding its keys is
    # killed; its keys are packed again (Pseudocode 3) on an aggregator that joins the job's
    # cluster, and the result is bit-identical to a run without the failure
    fast = ["--warmup-iters", "2", "--profile-iters", "5", "--period", "2", "--heartbeat-timeout", "2.0"]
    with LocalPool(3, master_args=fast, aggregator_args=["--heartbeat-interval", "0.2"]) as elastic:
        ref = train(elastic, "sum", {}, num_aggregators=1, iters=ITERS_PACKED)
        seen: dict = {}

        def kill_when_packed(it: int, job: str) -> None:
            status = elastic.status()
            (record,) = [j for j in status["jobs"] if j["job"] == job]
            if "victim" not in seen and record["state"] == "packed" and status["migrations"]["active"] == 0:
                seen["victim"], seen["cluster"] = record["aggregators"][0], record["cluster"]
                os.kill(next(a["pid"] for a in status["aggregators"] if a["id"] == seen["victim"]), signal.SIGKILL)
            elif "victim" in seen and "after" not in seen and seen["victim"] not in record["aggregators"]:
                seen["after"] = (record, {a["id"]: a for a in status["aggregators"]})
            elif "victim" not in seen:
                time.sleep(0.05)          # slower iterations while pMaster profiles the job

        got = train(elastic, "sum", {}, num_aggregators=1, iters=ITERS_PACKED, iteration_hook=kill_when_packed)
        check_same(got, ref)
        assert "after" in seen, f"the job was not packed, or its keys did not move: {seen}"
        record, aggs = seen["after"]
        assert record["state"] == "packed" and record["cluster"] == seen["cluster"]
        assert all(aggs[a]["cluster"] == seen["cluster"] and aggs[a]["state"] == "active"
                   for a in record["aggregators"]), (record, aggs)
        assert aggs[seen["victim"]]["state"] == "lost"
