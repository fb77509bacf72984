"""Live tensor migration while a job trains (thesis §4.3.2, Fig. 4.5).

Random migration schedules (which keys, where to, at which iteration, several at once)
must leave the result bit-identical to the same job trained without migrations, in
``sum`` and ``server`` mode: no update lost or applied twice, no stale read.
"""
from __future__ import annotations

import itertools
import mmap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from autops.wire import protocol as wire
from autops.admin import AdminClient
from autops.worker.agent import Agent
from autops.local import LocalPool
from autops.aggregator.optim import make_optimizer
from autops_testlib import TENSORS, W, ServerKeyJob, check_same, grad, holding, reported, secret_for

ITERS = 24
_jobs = itertools.count()


@pytest.fixture(scope="module")
def pool3():
    pool = LocalPool(3, master_args=["--static"])
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


def admin_migrate(master: str, job: str, keys=None, to=None) -> None:
    with AdminClient(master, 5) as admin:
        admin.migrate(job, keys=keys, to=to)


def migrations_done(master: str, job: str, timeout: float = 30.0) -> None:
    """Until no key of ``job`` is moving (keys still moving are skipped by a new request)."""
    deadline = time.monotonic() + timeout
    with AdminClient(master, 5) as admin:
        while time.monotonic() < deadline:
            if settled(admin.status(), job):
                return
            time.sleep(0.01)
    raise TimeoutError(f"migrations of {job} did not finish within {timeout:.0f}s")


def settled(status: dict, job: str) -> bool:
    """In pMaster's ``status``: no key of ``job`` is moving."""
    record = next(j for j in status["jobs"] if j["job"] == job)
    return record["migrating_keys"] == 0 and status["migrations"]["batches_active"] == 0


def moved(master: str, job: str) -> bool:
    with AdminClient(master, 5) as admin:
        return settled(admin.status(), job)


def train(master: str, mode: str, schedule: dict[int, list], transport: str = "auto",
          settle_at: frozenset = frozenset(), resize_at: dict[int, int] | None = None, **agent_kw) -> dict:
    """Run one W=2 job; at iteration i rank 0 first asks for the migrations schedule[i] --
    when i is in ``settle_at``, at the first iteration from i on by which those under way
    finished (they finish only as the job goes on: a worker that stopped to wait for them
    would stop them too). ``resize_at``: at iteration i, rank 0 asks for the job's keys spread over
    ``resize_at[i]`` aggregators (``AdminClient.resize``), once the moves under way are done.
    ``asked`` in the result: the iteration each was asked at."""
    job = f"mig-{mode}-{next(_jobs)}"
    kw = dict(mode=mode, average=mode == "server", num_aggregators=1, timeout=20, transport=transport,
              partition_bytes=256 << 10, secret=secret_for(job), **agent_kw)
    if mode == "server":
        kw.update(optimizer="adam", hp={"lr": 0.05})
    agents = [Agent(master, job, r, W, **kw) for r in range(W)]
    results: dict = {}
    errors: list = []
    asked: dict[int, int] = {}          # scheduled iteration -> the iteration it was asked at
    resized: list[dict] = []
    try:
        for a in agents:
            a.declare(TENSORS)
        if mode == "server":
            for n, s, _ in TENSORS:
                agents[0].init(n, np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)).wait()
        keys = sorted(agents[0].table.keys)

        def work(rank: int) -> None:
            try:
                agent = agents[rank]
                out = {n: np.empty(s, np.float32) for n, s, _ in TENSORS}
                acc = {n: np.zeros(s, np.float64) for n, s, _ in TENSORS}
                for it in range(1, ITERS + 1):
                    if rank == 0:
                        for at in sorted(i for i in schedule if i <= it and i not in asked):
                            if at in settle_at and not moved(master, job):
                                break           # asked for once the earlier moves are done
                            asked[at] = it
                            for pick, target in schedule[at]:
                                chosen = [keys[i % len(keys)] for i in pick] or None
                                admin_migrate(master, job, keys=sorted(set(chosen)) if chosen else None,
                                              to=[target])
                        for at in sorted(i for i in (resize_at or {}) if i <= it and -i not in asked):
                            if not moved(master, job):
                                break
                            asked[-at] = it
                            with AdminClient(master, 5) as admin:
                                resized.append(admin.resize(job, resize_at[at]))
                    handles = [agent.push_pull(n, grad(rank, it, n, s), out[n], it) for n, s, _ in TENSORS]
                    for h in handles:
                        h.wait(30)
                    for n in acc:
                        acc[n] += out[n]       # every pulled value counts: a stale read changes the sum
                results[rank] = {n: (out[n].copy(), acc[n]) for n in out}
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert set(asked) == set(schedule) | {-i for i in resize_at or {}}, f"moves asked for at {asked}"
        placement = agents[0].placement()
    finally:
        for a in agents:
            a.close()
    return {"results": results, "placement": placement, "redirects": sum(a.redirects for a in agents),
            "warmed": sum(a.warmed for a in agents), "asked": asked, "resized": resized}


@pytest.fixture(scope="module")
def references(pool3):
    return {mode: train(pool3.master, mode, {}) for mode in ("sum", "server")}


schedules = st.dictionaries(
    keys=st.integers(1, ITERS - 2),
    values=st.lists(st.tuples(st.lists(st.integers(0, 20), max_size=4), st.sampled_from(["agg-0", "agg-1", "agg-2"])),
                    min_size=1, max_size=3),
    min_size=1, max_size=5)


@pytest.mark.parametrize("mode, transport", [("sum", "auto"), ("server", "auto"), ("sum", "ipc")])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
def test_random_migration_schedules_leave_training_bit_identical(pool3, references, mode, transport, schedule):
    """Over shared memory (``auto`` on one host) and over a socket, where the agent sends
    several keys' pushes to one aggregator in one message and a move splits them."""
    got = train(pool3.master, mode, schedule, transport=transport)
    check_same(got, references[mode])


@pytest.fixture(scope="module")
def pool3_cma():
    """Aggregators that listen on cma too and move keys to each other over it."""
    from autops.transport.cma import available
    if available() is not None:
        pytest.skip(f"cma unavailable: {available()}")
    pool = LocalPool(3, master_args=["--static"], aggregator_args=["--transport", "cma"])
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.mark.parametrize("mode", ["sum", "server"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
def test_random_migration_schedules_over_cma_leave_training_bit_identical(pool3_cma, references, mode, schedule):
    """Every payload, the state copies between aggregators too, READ from its sender's memory."""
    got = train(pool3_cma.master, mode, schedule, transport="cma")
    check_same(got, references[mode])


def test_a_jobs_aggregator_count_changes_live_and_training_stays_identical(pool3, references):
    # one aggregator, then all three, then two: the scheduler's resize (AdminClient.resize)
    got = train(pool3.master, "sum", {}, resize_at={4: 3, 12: 2})
    check_same(got, references["sum"])
    assert [r["aggregators"] for r in got["resized"]] == [3, 2]
    assert len(set(got["placement"])) == 2, got["placement"]
    with AdminClient(pool3.master, 5) as admin:
        with pytest.raises(Exception, match="count must be an integer >= 1"):
            admin.resize("any", 0)
        with pytest.raises(Exception, match="without keys or to"):
            admin._client.call(wire.MIGRATE, job="any", count=2, to=["agg-1"], token=admin._operator_token())
        with pytest.raises(Exception, match="is not registered"):
            admin.resize("no-such-job", 2)


def test_a_resize_that_leaves_an_aggregator_without_keys_does_not_hold_it(pool3):
    """One key carries nearly all the bytes: spread over 3 aggregators, the third gets none;
    it must not stay allocated to the job, nor after the job ends."""
    job = f"lopsided-{next(_jobs)}"
    agent = Agent(pool3.master, job, 0, 1, mode="sum", num_aggregators=1, timeout=20, secret=secret_for(job))
    try:
        shapes = {"w": (100_000,), "b": (10,), "c": (10,)}
        agent.declare([(n, s, "float32") for n, s in shapes.items()])
        outs = {n: np.empty(s, np.float32) for n, s in shapes.items()}

        def step(it: int) -> None:
            for h in [agent.push_pull(n, np.ones(s, np.float32), outs[n], it) for n, s in shapes.items()]:
                h.wait(30)
        step(1)
        with AdminClient(pool3.master, 5) as admin:
            got = admin.resize(job, 3)
        assert got["aggregators"] == 2
        it = 2
        deadline = time.monotonic() + 30
        while not moved(pool3.master, job) and time.monotonic() < deadline:   # moves finish as it trains
            step(it)
            it += 1
        step(it)
        assert len(set(agent.placement())) == 2
    finally:
        agent.close()

    def all_idle() -> bool:
        with AdminClient(pool3.master, 5) as admin:
            return all(a["state"] == "idle" for a in admin.status()["aggregators"])
    deadline = time.monotonic() + 20
    while not all_idle() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all_idle()


def ahead_counts(pool: LocalPool) -> tuple[int, int]:
    """States the aggregators sent ahead of a switch, and keys taken over without a state copy."""
    aggs = pool.status()["aggregators"]
    return sum(a.get("states_sent_ahead", 0) for a in aggs), sum(a.get("taken_over_ahead", 0) for a in aggs)


def test_every_tensor_moves_and_the_job_ends_where_it_was_sent(pool3, references):
    before = ahead_counts(pool3)
    # all keys to agg-2 at iteration 3, then all to agg-1 at 9, once the first move is done
    # (a request skips keys still moving; overlapping requests are the property test's)
    got = train(pool3.master, "server", {3: [([], "agg-2")], 9: [([], "agg-1")]}, transport="tcp",
                settle_at=frozenset({9}))
    check_same(got, references["server"])
    assert set(got["placement"]) == {"agg-1"}, got["asked"]
    # the agents learnt of each move from the pull replies ahead of its cutover: no request
    # reached an old owner after its switch
    assert got["redirects"] == 0
    status = pool3.status()
    assert status["migrations"]["failed"] == 0
    assert status["migrations"]["completed"] > 0
    # the new owners reported how long a complete first iteration waited for its hand-over
    mine = [b for b in status["migrations"]["recent"] if b["job"].startswith("mig-server")][-2:]
    assert len(mine) == 2
    for batch in mine:
        assert 0.0 <= batch["handover_wait_ms"] <= 1e3 * batch["seconds"], batch
        # and when, on its clock, the first push and the hand-over came: before its keys'
        # first iteration there was complete
        seen = batch["switch_seen"]
        assert seen["first_push_at"] <= seen["done_at"] and seen["handover_at"] <= seen["done_at"], seen
    # server mode: the state went ahead (to the new owner, or it was the replica) and the
    # switches moved counters only (the counters reach pMaster with the heartbeats)
    deadline = time.monotonic() + 10
    while not all(now > then for now, then in zip(ahead_counts(pool3), before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(now > then for now, then in zip(ahead_counts(pool3), before)), (before, ahead_counts(pool3))
    # the old owners counted the hand-overs they sent, at most one message per key, and their
    # CPU (a heartbeat between a send and its answer counts the message, not yet its keys)
    def handed_over() -> tuple[int, int]:
        aggs = pool3.status()["aggregators"]
        return sum(a.get("handover_messages", 0) for a in aggs), sum(a.get("migrated_out", 0) for a in aggs)

    deadline = time.monotonic() + 10
    while not 0 < handed_over()[0] <= handed_over()[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    sent, keys = handed_over()
    assert 0 < sent <= keys, (sent, keys)
    assert all(a.get("handover_cpu_s", 0.0) >= 0.0 for a in pool3.status()["aggregators"])


@pytest.mark.parametrize("warm_bytes", [1 << 20, 0])
def test_the_agents_connect_to_a_new_owner_before_the_switch_needs_it(references, monkeypatch, warm_bytes):
    """A move's lead iterations tell the agents the new owner: they connect to it then (off
    the switch iteration's path), carry ``warm_bytes`` over each new connection and back
    (``warm``), and the switch's requests go over that connection."""
    from autops.transport.sockpoll import LinkChannel

    dials: list[tuple[str, str]] = []          # (address, "ahead" | "on send")
    connected, opened = LinkChannel._connected, LinkChannel.open
    ahead = threading.local()

    def record(self):
        had = self.link is not None and self.link.broken is None
        link = connected(self)
        if link is not None and not had:
            dials.append((self.address, "ahead" if getattr(ahead, "on", False) else "on send"))
        return link

    def open_ahead(self):
        ahead.on = True
        try:
            opened(self)
        finally:
            ahead.on = False

    monkeypatch.setattr(LinkChannel, "_connected", record)
    monkeypatch.setattr(LinkChannel, "open", open_ahead)
    with LocalPool(3, master_args=["--static"]) as pool:      # its own: no other job's warm counted
        got = train(pool.master, "sum", {3: [([], "agg-2")], 9: [([], "agg-1")]}, transport="tcp",
                    settle_at=frozenset({9}), warm_bytes=warm_bytes)
        echoed = echoed_by(pool, got["warmed"] * warm_bytes)
    check_same(got, references["sum"])
    assert got["redirects"] == 0
    made_ahead = [how for _, how in dials].count("ahead")
    assert made_ahead, dials                   # at least one move went to an aggregator not yet connected
    # never dialled again on send: the connections made ahead were the ones used
    assert not {a for a, how in dials if how == "ahead"} & {a for a, how in dials if how == "on send"}, dials
    # each connection made ahead was warmed, once: the answers came back to the agents, and the
    # aggregators report what they echoed (with their next heartbeat)
    assert got["warmed"] == (made_ahead if warm_bytes else 0), (got["warmed"], dials)
    assert echoed == made_ahead * warm_bytes


def test_a_moves_new_zeromq_tcp_connections_are_warmed_too(references, monkeypatch):
    """Over ZeroMQ's tcp (``AUTOPS_TCP_STREAM=0``; with CURVE the only tcp) as over the stream
    endpoints: each agent warms its connection to the new owner, and the result is exact."""
    monkeypatch.setenv("AUTOPS_TCP_STREAM", "0")
    with LocalPool(3, master_args=["--static"]) as pool:
        got = train(pool.master, "sum", {3: [([], "agg-2")], 9: [([], "agg-1")]}, transport="tcp",
                    settle_at=frozenset({9}), warm_bytes=1 << 20)
        echoed = echoed_by(pool, got["warmed"] << 20)
    check_same(got, references["sum"])
    assert got["warmed"] >= W, got["warmed"]       # every agent, at least the first move
    assert echoed == got["warmed"] << 20


def echoed_by(pool: LocalPool, expected: int, timeout: float = 10.0) -> int:
    """What the pool's aggregators report having echoed (``warm_bytes``), once it reached
    ``expected`` (their heartbeats carry it) or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        total = sum(a.get("warm_bytes", 0) for a in pool.status()["aggregators"])
        if total >= expected or time.monotonic() > deadline:
            return total
        time.sleep(0.1)


def test_an_aggregator_echoes_a_warm_by_value_up_to_its_limit(pool3):
    """``warm``: the payload comes back as it was sent; one over ``wire.MAX_WARM_BYTES`` gets
    an error, never an answer larger than what was asked with."""
    from autops.transport.stream import StreamChannel

    agg = next(a for a in pool3.status()["aggregators"] if "stream" in a["endpoints"])
    channel = StreamChannel(agg["endpoints"]["stream"])
    try:
        payload = np.arange(3 << 20, dtype=np.uint8)
        channel.send(wire.header(wire.WARM, req=7), [payload, payload[:1000]])
        msg = next_message(channel)
        assert msg.op == wire.WARM and msg.get("req") == 7
        assert [bytes(p) for p in msg.payloads] == [payload.tobytes(), payload[:1000].tobytes()]
        channel.send(wire.header(wire.WARM, req=8), [np.zeros(wire.MAX_WARM_BYTES + 1, np.uint8)])
        msg = next_message(channel)
        assert msg.op == wire.ERROR and msg.get("req") == 8 and "more than" in msg["message"], msg
    finally:
        channel.close()


def next_message(channel, timeout: float = 20.0) -> wire.Message:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inbound = channel.recv()
        if inbound is not None:
            return wire.parse(inbound.header, inbound.payloads, inbound.lent)
        time.sleep(0.005)
    raise AssertionError("no answer within the timeout")


# --- memory made ready ahead, at a pace ----------------------------------------------------------
def test_a_server_mode_jobs_arrival_makes_its_state_ready_on_the_owner_and_the_replica():
    """A server-mode job's new key, large enough to be populated off the loops: its owner
    readies the master copy, gradient accumulator and momentum, and its replica -- told by
    pMaster (``replica_prepare``) before the job gets its table -- the master copy and momentum
    the owner's first copy of the state will fill. Neither waits for CPU to spare (the job
    waits for them), and the results stay exact."""
    shape = (1_500_000,)                # 6 MiB: populated by a helper thread
    job = f"arrival-ready-{next(_jobs)}"
    with LocalPool(2, master_args=["--static"], aggregator_args=["--prefault-share", "0.5"]) as pool:
        with ServerKeyJob(pool, job, shape) as run:
            for it in range(1, 5):
                run.step(it)
            owner = run.owner()
            replica = next(iter(holding(pool, job) - {owner}))
        nbytes = int(np.prod(shape)) * 4
        aggs = reported(pool, [owner, replica], "at_once_prefaulted_bytes")
    owner_stats, replica_stats = aggs[owner], aggs[replica]
    assert owner_stats["at_once_prefaulted_bytes"] >= 3 * nbytes, owner_stats      # copy, accumulator, momentum
    assert replica_stats["at_once_prefaulted_bytes"] >= 2 * nbytes, replica_stats  # copy, momentum
    # at once: the migrations' paced figures are untouched
    for stats in (owner_stats, replica_stats):
        assert stats["at_once_prefault_cpu_s"] > 0 and stats["prefaulted_bytes"] == 0, stats


@pytest.mark.parametrize("reserve", [0, 64 << 20])
def test_an_aggregators_reserve_is_the_populated_memory_a_server_jobs_state_comes_from(reserve):
    """``--reserve``: each aggregator makes that much memory ready when it starts -- a
    quarter as shared segments, the rest as heap -- and a server-mode job arriving afterwards
    gets its state from it: the owner's master copy (shared memory the workers map),
    gradient accumulator and momentum, and the replica's master copy and momentum. Readying
    them takes no page fault then. Without a reserve every page of the state faults once."""
    shape = (1_500_000,)                # 6 MiB per array: populated by a helper thread
    pages = int(np.prod(shape)) * 4 // mmap.PAGESIZE
    job = f"reserve-{reserve}-{next(_jobs)}"
    with LocalPool(2, master_args=["--static"], aggregator_args=["--reserve", str(reserve)]) as pool:
        if reserve:
            aggs = [a["id"] for a in pool.status()["aggregators"]]
            ready = reported(pool, aggs, "reserve_warmed_bytes")
            assert len(aggs) == 2 and all(ready[a]["reserve_warmed_bytes"] >= reserve for a in aggs), ready
        with ServerKeyJob(pool, job, shape) as run:
            for it in range(1, 4):
                run.step(it)
            owner = run.owner()
            replica = next(iter(holding(pool, job) - {owner}))
        stats = reported(pool, [owner, replica], "at_once_prefaulted_bytes")
        if reserve:     # the shared segment the owner took is made again
            before, deadline = ready[owner]["reserve_warmed_bytes"], time.monotonic() + 15
            while (made := next(a["reserve_warmed_bytes"] for a in pool.status()["aggregators"]
                                if a["id"] == owner)) <= before and time.monotonic() < deadline:
                time.sleep(0.2)
            assert made > before, (made, before)
    owner_faults, replica_faults = stats[owner]["at_once_prefault_faults"], stats[replica]["at_once_prefault_faults"]
    if reserve:
        assert owner_faults < pages // 4 and replica_faults < pages // 4, (owner_faults, replica_faults, pages)
    else:       # owner: master copy, accumulator, momentum; replica: master copy, momentum
        assert owner_faults >= pages * 2.75 and replica_faults >= pages * 1.75, (owner_faults, replica_faults, pages)


@pytest.mark.parametrize("mode, aggregators", [("sum", 2), ("server", 2), ("server", 3)])
def test_keys_moving_to_an_aggregator_get_memory_and_heap_made_ready_at_its_pace(mode, aggregators):
    """Keys large enough to be populated off the aggregator's loop (``--prefault-share 0.5``):
    the new owner populates their buffers (server mode: the master copy, the gradient
    accumulator and the optimizer's state, here SGD's momentum) and warms the heap their pushes
    arrive in, pausing as long as it worked, and the job's results stay exact through the move.
    Server mode, moved to its replica with a third aggregator there: that one becomes the new
    replica and makes the memory for the state (master copy, momentum) ready before it comes."""
    shape = (1_500_000,)                # 6 MiB: its keys' buffers are populated by a helper thread
    job = f"mig-prefault-{mode}-{next(_jobs)}"
    kw = dict(mode=mode, average=False, num_aggregators=1, timeout=20, transport="tcp", secret=secret_for(job))
    hp = {"lr": 0.01, "momentum": 0.9}
    if mode == "server":
        kw.update(optimizer="sgd", hp=hp)
    with LocalPool(aggregators, master_args=["--static"], aggregator_args=["--prefault-share", "0.5"]) as pool:
        agents = [Agent(pool.master, job, r, W, **kw) for r in range(W)]
        try:
            for agent in agents:
                agent.declare([("w", shape, "float32")])
            param = np.linspace(-1, 1, shape[0], dtype=np.float32)
            reference = make_optimizer("sgd", hp)
            if mode == "server":
                agents[0].init("w", param).wait()
                param = param.copy()
            source = set(agents[0].placement())
            others = [a["id"] for a in pool.status()["aggregators"] if a["id"] not in source]
            # server mode: to the key's replica (with a third aggregator, a new replica is needed)
            target = next(iter(holding(pool, job) - source)) if mode == "server" else others[0]
            new_replica = next((a for a in others if a != target), None) if aggregators == 3 else None
            outs = [np.empty(shape, np.float32) for _ in range(W)]
            deadline = time.monotonic() + 30
            it, done_at = 0, None
            # the job trains on while the move waits for its memory (a busy host gets the
            # population only after the pace's patience), and two iterations past it
            while (done_at is None or it < max(8, done_at + 2)) and time.monotonic() < deadline:
                it += 1
                if done_at is None and it > 3 and moved(pool.master, job):
                    done_at = it
                if it == 3:
                    admin_migrate(pool.master, job, to=[target])
                handles = [agent.push_pull("w", grad(r, it, "w", shape), outs[r], it)
                           for r, agent in enumerate(agents)]
                for handle in handles:
                    handle.wait(30)
                total = grad(0, it, "w", shape) + grad(1, it, "w", shape)
                if mode == "server":
                    reference.step(param, total)
                for out in outs:
                    np.testing.assert_array_equal(out, total if mode == "sum" else param)
            migrations_done(pool.master, job)
            assert set(agents[0].placement()) == {target}
            if new_replica is not None:
                assert new_replica in holding(pool, job, including=new_replica)    # it backs the key up now
        finally:
            for agent in agents:
                agent.close()
        nbytes = int(np.prod(shape)) * 4
        aggs = reported(pool, [target] + ([new_replica] if new_replica else []), "prefaulted_bytes")
        stats, replica_stats = aggs[target], aggs.get(new_replica, {})
    # sum mode: two buffers per key; server mode: master copy, gradient accumulator, momentum
    assert stats["prefaulted_bytes"] >= (2 if mode == "sum" else 3) * nbytes, stats
    if new_replica is not None:
        assert replica_stats["prefaulted_bytes"] >= 2 * nbytes, replica_stats      # master copy, momentum
    assert stats["heap_warmed_bytes"] >= nbytes, stats
    assert stats["prefault_cpu_s"] > 0, stats
    # half a core: it slept as long as it worked, except on a core the host had idle (the
    # report rounds each to milliseconds)
    paced = stats["prefault_cpu_s"] - stats["prefault_idle_cpu_s"]
    assert stats["prefault_paused_s"] == pytest.approx(paced, abs=3e-3), stats
