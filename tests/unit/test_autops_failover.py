"""Failure handling as plain decisions: where a lost aggregator's keys go (pMaster's
``Failover`` on a fake clock and a recording outbox), where replicas live, and how an
aggregator's store rebuilds a key from the workers' reports or continues from a replica."""
from __future__ import annotations

import numpy as np
import pytest

from autops.wire import protocol as wire
from autops.master.failover import Failover
from autops.master.migration import Migrations
from autops.wire.partition import KeySpec
from autops.master.pool import AggInfo, JobInfo, PoolState
from autops.master.replication import pick_replica
from autops.aggregator.store import Store, StoreError

from test_autops_elastic import FakeClock, RecordingOutbox, message


# --- replica placement --------------------------------------------------------------------
def test_a_replica_goes_to_another_host_before_a_less_loaded_one():
    candidates = [("a", "h1", 0), ("b", "h1", 0), ("c", "h2", 500)]
    assert pick_replica("a", "h1", candidates) == "c"


def test_a_replica_on_the_same_host_when_there_is_no_other():
    assert pick_replica("a", "h1", [("a", "h1", 0), ("b", "h1", 9), ("c", "h1", 3)]) == "c"
    assert pick_replica("a", "h1", [("a", "h1", 0)]) is None


# --- pMaster: a lost aggregator's keys ------------------------------------------------------
def pool_with_job(mode: str, clock: FakeClock, replicate: bool = True):
    state = PoolState(heartbeat_timeout=5.0, clock=clock)
    for i, host in enumerate(["h1", "h1", "h2"]):
        state.add_aggregator(AggInfo(f"agg-{i}", f"id{i}".encode(), {"tcp": f"tcp://x:{i}"}, host, i, clock()))
    job = JobInfo("j", "s", 2, 2, mode, True, "adam" if mode == "server" else None, {}, 1 << 20, 1 << 16,
                  ["agg-0", "agg-1"])
    job.replicate = replicate
    conf = {"mode": mode, "average": True, "optimizer": job.optimizer, "hp": {}}
    job.tensors = {"w": ((1000,), "float32", conf), "b": ((10,), "float32", conf)}
    job.keys = {"w": KeySpec("w", "w", 0, 1000, "float32", False), "b": KeySpec("b", "b", 0, 10, "float32", False)}
    job.table = {"w": "agg-0", "b": "agg-1"}
    if mode == "server" and replicate:
        job.replicas = {"w": "agg-2", "b": "agg-2"}
    state.jobs["j"] = job
    outbox = RecordingOutbox()
    flushed = []
    failover = Failover(state, outbox, Migrations(state, outbox), flushed.append)
    return state, job, outbox, failover, flushed


def silence(state: PoolState, agg: str, clock: FakeClock) -> None:
    """Every aggregator but ``agg`` heartbeats now; then the clock passes the timeout."""
    clock.t += 6.0
    for a in state.aggs.values():
        if a.agg_id != agg:
            a.last_seen = clock.t


def test_a_sum_mode_key_is_rebuilt_on_a_live_aggregator_of_the_job():
    clock = FakeClock()
    state, job, outbox, failover, flushed = pool_with_job("sum", clock)
    silence(state, "agg-0", clock)
    assert failover.check(clock()) == ["agg-0"]
    assert job.table == {"w": "agg-1", "b": "agg-1"}
    (agg, fields), = outbox.to(wire.FAILOVER)
    assert agg == "agg-1" and not fields["promote"] and [k[0] for k in fields["keys"]] == ["w"]
    assert job.epoch == 1 and job.lost_aggs == {"agg-0"} and "agg-0" not in state.aggs
    assert job.pending_acks, "the table waits for the take-over's answer"
    for _, _, reply, _ in outbox.waiting:
        reply(message(wire.OK))
    assert not job.pending_acks and flushed and job.failure is None


def answer_all(outbox: RecordingOutbox, op: str, reply: wire.Message | None = None) -> list[tuple[str, dict]]:
    """Answer (OK, or ``reply``) every request of ``op`` waiting; returns (aggregator, fields)."""
    answered = [w for w in outbox.waiting if w[1] == op]
    outbox.waiting = [w for w in outbox.waiting if w[1] != op]
    for _, _, callback, _ in answered:
        callback(reply if reply is not None else message(wire.OK))
    return [(agg, fields) for agg, _, _, fields in answered]


def test_a_server_mode_key_is_promoted_on_its_replica_which_gets_a_new_replica():
    clock = FakeClock()
    state, job, outbox, failover, _ = pool_with_job("server", clock)
    silence(state, "agg-0", clock)
    failover.check(clock())
    # the new replica first makes the memory for the state ready, at once; the owner waits
    (ready_at, ready), = outbox.to(wire.REPLICA_PREPARE)
    assert ready_at == "agg-1" and ready["at_once"] is True and [k[0] for k in ready["keys"]] == ["w"]
    assert ready["mode"] == "server" and ready["optimizer"] == "adam" and ready["secret"] == "s"
    assert not outbox.to(wire.FAILOVER) and job.pending_acks
    answer_all(outbox, wire.REPLICA_PREPARE)
    (agg, fields), = outbox.to(wire.FAILOVER)
    assert agg == "agg-2" and fields["promote"] is True
    assert job.table["w"] == "agg-2"
    assert job.replicas["w"] == "agg-1" and fields["replicas"]["w"]["agg"] == "agg-1"
    assert job.pending_acks, "the table waits for the take-over's answer"
    answer_all(outbox, wire.FAILOVER)
    assert not job.pending_acks and job.failure is None


def test_a_lost_replica_is_replaced():
    clock = FakeClock()
    state, job, outbox, failover, _ = pool_with_job("server", clock)
    silence(state, "agg-2", clock)
    failover.check(clock())
    assert not outbox.to(wire.FAILOVER) and not outbox.to(wire.REPLICA_SET)
    readied = answer_all(outbox, wire.REPLICA_PREPARE)
    sets = outbox.to(wire.REPLICA_SET)
    assert {agg for agg, _ in sets} == {"agg-0", "agg-1"}
    assert all(fields["replica"]["agg"] in ("agg-0", "agg-1") and fields["replica"]["agg"] != agg
               for agg, fields in sets)
    # each new replica was asked for the keys it backs up
    assert sorted((agg, [k[0] for k in f["keys"]]) for agg, f in readied) == \
        sorted((f["replica"]["agg"], f["keys"]) for _, f in sets)


@pytest.mark.parametrize("reply", ["error", "none"])
def test_a_new_replica_that_cannot_make_memory_ready_does_not_hold_the_take_over(reply):
    clock = FakeClock()
    state, job, outbox, failover, _ = pool_with_job("server", clock)
    silence(state, "agg-0", clock)
    failover.check(clock())
    (_, _, callback, _), = [w for w in outbox.waiting if w[1] == wire.REPLICA_PREPARE]
    # None: what the outbox answers once the wait expired
    callback(message(wire.ERROR, message="out of memory") if reply == "error" else None)
    (agg, fields), = outbox.to(wire.FAILOVER)
    assert agg == "agg-2" and fields["replicas"]["w"]["agg"] == "agg-1" and job.failure is None


def test_a_new_replica_lost_while_it_makes_memory_ready_lets_the_take_over_go_on_and_is_replaced():
    clock = FakeClock()
    state, job, outbox, failover, _ = pool_with_job("server", clock)
    state.add_aggregator(AggInfo("agg-3", b"id3", {"tcp": "tcp://x:3"}, "h3", 3, clock()))
    job.table["b"] = "agg-0"            # both keys promoted on agg-2; agg-1 and agg-3 own nothing
    silence(state, "agg-0", clock)
    failover.check(clock())
    (new_replica, ready), = outbox.to(wire.REPLICA_PREPARE)
    assert sorted(k[0] for k in ready["keys"]) == ["b", "w"] and not outbox.to(wire.FAILOVER)
    for _ in range(4):                  # it stops heartbeating while pMaster's loop runs on
        clock.t += 2.0
        for agg in state.aggs.values():
            if agg.agg_id != new_replica:
                agg.last_seen = clock.t
        failover.check(clock())
    assert new_replica not in state.aggs
    # the promotion went on at once, then the keys got another new replica instead
    (owner, fields), = outbox.to(wire.FAILOVER)
    assert owner == "agg-2" and {r["agg"] for r in fields["replicas"].values()} == {new_replica}
    (other, again), = outbox.to(wire.REPLICA_PREPARE)[1:]
    assert other not in (new_replica, "agg-2") and sorted(k[0] for k in again["keys"]) == ["b", "w"]
    assert not outbox.to(wire.REPLICA_SET)
    answer_all(outbox, wire.REPLICA_PREPARE)
    (to, replica_set), = outbox.to(wire.REPLICA_SET)
    assert to == "agg-2" and replica_set["replica"]["agg"] == other and job.replicas == {"w": other, "b": other}


@pytest.mark.parametrize("mode", ["sum", "server"])
def test_without_fault_tolerance_the_job_fails_with_a_message(mode):
    clock = FakeClock()
    state, job, outbox, failover, _ = pool_with_job(mode, clock, replicate=False)
    silence(state, "agg-0", clock)
    failover.check(clock())
    assert not outbox.to(wire.FAILOVER)
    assert "agg-0" in job.failure and ("fault tolerance" in job.failure or "replication" in job.failure)


def test_a_pause_of_pmaster_itself_declares_nobody_lost():
    clock = FakeClock()
    state, job, outbox, failover, _ = pool_with_job("sum", clock)
    assert failover.check(clock()) == []
    clock.t += 10.0            # pMaster's loop did not run: heartbeats are waiting in its socket
    assert failover.check(clock()) == []
    assert "agg-0" in state.aggs


def packed_pool(clock: FakeClock, idle: int = 0, provider=None):
    """Cluster c0 of agg-0..agg-2 (same D=1 s): job j packed on agg-0 (w, e=0.3) and agg-1
    (b, e=0.1); job k fills agg-1 (e=0.8) and half of agg-2 (e=0.5). ``idle`` more
    aggregators wait in the pool."""
    state = PoolState(heartbeat_timeout=5.0, clock=clock)
    for i in range(3 + idle):
        state.add_aggregator(AggInfo(f"agg-{i}", f"id{i}".encode(), {"tcp": f"tcp://x:{i}"}, "h1", i, clock()))
    cluster = state.open_cluster()
    for i in range(3):
        state.aggs[f"agg-{i}"].state, state.aggs[f"agg-{i}"].cluster = "active", cluster.name
        cluster.aggs.add(f"agg-{i}")
    conf = {"mode": "sum", "average": True, "optimizer": None, "hp": {}}
    for name, keys in {"j": {"w": ("agg-0", 0.3), "b": ("agg-1", 0.1)},
                       "k": {"x": ("agg-1", 0.8), "y": ("agg-2", 0.5)}}.items():
        job = JobInfo(name, "s", 2, 2, "sum", True, None, {}, 1 << 20, 1 << 16,
                      sorted({a for a, _ in keys.values()}))
        job.tensors = {key: ((1000,), "float32", conf) for key in keys}
        job.keys = {key: KeySpec(key, key, 0, 1000, "float32", False) for key in keys}
        job.table = {key: agg for key, (agg, _) in keys.items()}
        job.e = {key: e for key, (_, e) in keys.items()}
        job.state, job.cluster, job.standalone = "packed", cluster.name, 1.0
        cluster.jobs.add(name)
        state.jobs[name] = job
    outbox = RecordingOutbox()
    flushed = []
    failover = Failover(state, outbox, Migrations(state, outbox), flushed.append, provider)
    return state, outbox, failover, flushed


def test_a_packed_jobs_lost_key_is_packed_where_it_fits_not_on_the_jobs_least_loaded():
    clock = FakeClock()
    state, outbox, failover, _ = packed_pool(clock)
    silence(state, "agg-0", clock)
    failover.check(clock())
    # agg-1 is the job's own and least loaded by bytes, but has 0.1 s free of its 1 s cycle;
    # agg-2 has 0.5 s free: Pseudocode 3 puts w (0.3 s) there.
    assert state.jobs["j"].table["w"] == "agg-2"
    (agg, fields), = outbox.to(wire.FAILOVER)
    assert agg == "agg-2" and [k[0] for k in fields["keys"]] == ["w"]


def test_without_room_in_the_cluster_an_idle_aggregator_joins_it():
    clock = FakeClock()
    state, outbox, failover, _ = packed_pool(clock, idle=1)
    state.jobs["j"].e["w"] = 0.7                 # fits neither agg-1 (0.1 free) nor agg-2 (0.5)
    silence(state, "agg-0", clock)
    failover.check(clock())
    assert state.jobs["j"].table["w"] == "agg-3"
    assert state.aggs["agg-3"].state == "active" and "agg-3" in state.clusters["c0"].aggs


class StartingProvider:
    """Starts aggregators by name only; they register when the test says so."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def can_start(self, running: int) -> int:
        return 4

    def start(self, n: int) -> list[str]:
        names = [f"new-{len(self.started) + i}" for i in range(n)]
        self.started += names
        return names


def test_without_room_or_idle_aggregators_a_fresh_one_is_started_and_joins_the_cluster():
    clock = FakeClock()
    provider = StartingProvider()
    state, outbox, failover, flushed = packed_pool(clock, provider=provider)
    job = state.jobs["j"]
    job.e["w"] = 0.7
    silence(state, "agg-0", clock)
    failover.check(clock())
    assert provider.started == ["new-0"] and not outbox.to(wire.FAILOVER)
    assert ("starting", "new-0") in job.pending_acks, "the table waits for the new aggregator"
    info = AggInfo("new-0", b"idn", {"tcp": "tcp://x:9"}, "h1", 9, clock())
    state.add_aggregator(info)
    assert failover.aggregator_registered(info)
    assert job.table["w"] == "new-0" and info.state == "active" and "new-0" in state.clusters["c0"].aggs
    (agg, fields), = outbox.to(wire.FAILOVER)
    assert agg == "new-0" and [k[0] for k in fields["keys"]] == ["w"]


def test_without_room_and_nothing_to_start_the_key_goes_to_the_jobs_least_loaded():
    clock = FakeClock()
    state, outbox, failover, _ = packed_pool(clock)
    state.jobs["j"].e["w"] = 0.7
    silence(state, "agg-0", clock)
    failover.check(clock())
    assert state.jobs["j"].table["w"] == "agg-1" and state.jobs["j"].failure is None


# --- the aggregator's store -------------------------------------------------------------------
def sum_key(world: int = 2) -> tuple[Store, object]:
    store = Store()
    store.assign("j", "s", world, "sum", [KeySpec("k", "k", 0, 4, "float32", False)], average=False)
    return store, store.jobs["j"].keys["k"]


def test_a_rebuilt_key_resumes_after_the_smallest_iteration_pulled():
    store, ks = sum_key()
    store.start_recovery(ks)
    a, b = np.full(4, 1.0, np.float32), np.full(4, 2.0, np.float32)
    # rank 0 pulled 6 and pushed 7; rank 1 pulled only 5: it resends 6, rank 0 its kept 6 and 7
    ks.held += [(0, 7, a, False, True), (0, 6, a, False, True), (1, 6, b, False, True)]
    assert store.recover_report(ks, 0, 6) == (False, [])
    assert not store.pull_ready(ks, 6)
    resumed, problems = store.recover_report(ks, 1, 5)
    assert resumed and not problems
    assert ks.completed == 6 and ks.ranks == {0}         # 6 rebuilt from both; 7 half pushed
    np.testing.assert_array_equal(ks.value(6), a + b)
    assert store.pull_ready(ks, 6)


def test_a_rebuilt_key_resumes_after_the_latest_value_a_rank_gave():
    store, ks = sum_key()
    store.start_recovery(ks)
    pulled6 = np.full(4, 9.0, np.float32)
    a, b = np.full(4, 1.0, np.float32), np.full(4, 2.0, np.float32)
    # rank 0 pulled 6 and kept its value; rank 1 pulled only 5: its replayed 6 is already in
    # the value rank 0 gave, and rank 0's push of 7 waits for rank 1's
    ks.held += [(0, 7, a, False, True), (1, 6, b, False, True)]
    assert store.recover_report(ks, 0, 6, pulled6) == (False, [])
    assert not store.pull_ready(ks, 6), "nothing is answered before every rank reported"
    resumed, problems = store.recover_report(ks, 1, 5, np.full(4, 5.0, np.float32))
    assert resumed and not problems
    assert ks.completed == 6 and ks.ranks == {0}
    np.testing.assert_array_equal(ks.value(6), pulled6)
    assert store.push(ks, 1, np.full(4, 3.0, np.float32))
    assert ks.completed == 7
    np.testing.assert_array_equal(ks.value(7), a + 3.0)


def test_without_the_latest_value_a_rebuilt_key_resumes_after_the_smallest():
    store, ks = sum_key()
    store.start_recovery(ks)
    a, b = np.full(4, 1.0, np.float32), np.full(4, 2.0, np.float32)
    ks.held += [(0, 6, a, False, True), (1, 6, b, False, True)]
    store.recover_report(ks, 0, 6)                               # lent memory: no value kept
    resumed, _ = store.recover_report(ks, 1, 5, np.full(4, 5.0, np.float32))
    assert resumed and ks.completed == 6
    np.testing.assert_array_equal(ks.value(6), a + b)           # rebuilt from both pushes


def test_a_recovered_value_of_the_wrong_size_or_type_is_refused():
    store, ks = sum_key()
    store.start_recovery(ks)
    with pytest.raises(StoreError, match="value of 3"):
        store.recover_report(ks, 0, 2, np.zeros(3, np.float32))
    with pytest.raises(StoreError, match="float64"):
        store.recover_report(ks, 0, 2, np.zeros(4, np.float64))


def test_replayed_pushes_the_key_has_are_skipped():
    store, ks = sum_key()
    ks.completed = 3
    ks.ranks = {1}
    assert store.already_has(ks, 0, 3) and store.already_has(ks, 1, 4)
    assert not store.already_has(ks, 0, 4)


def test_a_replica_takes_the_owners_steps_and_can_be_promoted():
    spec = KeySpec("p", "p", 0, 8, "float32", False)
    owner = Store()
    owner.assign("j", "s", 1, "server", [spec], optimizer="adam", hp={"lr": 0.1})
    ks = owner.jobs["j"].keys["p"]
    owner.init(owner.jobs["j"], "p", np.linspace(0, 1, 8, dtype=np.float32))
    backup = Store()
    state = backup.ensure_job("j", "s", 1, "server", True, "adam", {"lr": 0.1})
    meta, arrays = owner.export_key(ks)
    rks = backup.install_replica(state, spec, "server", True, "adam", {"lr": 0.1}, meta, [a.copy() for a in arrays])
    grads = []
    owner.on_step = lambda k, g: grads.append(g.copy())
    for it in (1, 2, 3):
        owner.push(ks, 0, np.full(8, 0.5 * it, np.float32))
        assert backup.replica_accepts(rks, it, grads[-1])
        backup.replica_step(rks, it, grads[-1], dict(ks.optimizer.hp))
    assert not backup.replica_accepts(rks, 5, grads[-1]), "a missing step is noticed"
    np.testing.assert_array_equal(rks.param, ks.param)
    promoted = backup.promote(state, "p")
    assert promoted is rks and state.keys["p"].completed == 3 and not state.replicas


def test_a_backup_left_by_a_move_that_did_not_complete_is_dropped_and_only_it():
    """The state a move sent ahead to a new replica made a backup there; when the move is
    abandoned, MIGRATE_DROP with ``backups`` frees it -- not the keys this aggregator owns."""
    spec, other = KeySpec("p", "p", 0, 8, "float32", False), KeySpec("q", "q", 0, 8, "float32", False)
    owner = Store()
    owner.assign("j", "s", 1, "server", [spec], optimizer="adam", hp={"lr": 0.1})
    ks = owner.jobs["j"].keys["p"]
    owner.init(owner.jobs["j"], "p", np.linspace(0, 1, 8, dtype=np.float32))
    backup = Store()
    backup.assign("j", "s", 1, "server", [other], optimizer="adam", hp={"lr": 0.1})
    state = backup.jobs["j"]
    meta, arrays = owner.export_key(ks)
    rks = backup.install_replica(state, spec, "server", True, "adam", {"lr": 0.1}, meta, [a.copy() for a in arrays])
    assert backup.drop_replicas("j", ["p", "q"]) == [rks]
    assert not state.replicas and list(state.keys) == ["q"]
    assert backup.drop_replicas("j", ["p"]) == [] and backup.drop_replicas("nobody", ["p"]) == []


def test_a_replica_installs_its_state_in_memory_made_ready_for_it():
    """``ready_replica`` keeps arrays for a key's coming backup (``private_sizes`` without an
    accumulator: Adam's two slots); ``install_replica`` fills them, steps in them as in its
    own, and counts them in ``bytes_held`` either way."""
    spec = KeySpec("p", "p", 0, 8, "float32", False)
    owner = Store()
    owner.assign("j", "s", 1, "server", [spec], optimizer="adam", hp={"lr": 0.1})
    ks = owner.jobs["j"].keys["p"]
    owner.init(owner.jobs["j"], "p", np.linspace(0, 1, 8, dtype=np.float32))
    owner.push(ks, 0, np.full(8, 0.5, np.float32))
    backup = Store()
    state = backup.ensure_job("j", "s", 1, "server", True, "adam", {"lr": 0.1})
    sizes = Store.private_sizes("server", "adam", {"lr": 0.1}, [spec], accumulator=False)
    assert sizes == [(8, "float32")] * 2
    param, slots = np.zeros(8, np.float32), [np.zeros(n, d) for n, d in sizes]
    assert not backup.ready_replica(state, spec, np.zeros(7, np.float32), None, slots)     # does not fit
    assert backup.ready_replica(state, spec, param, "ref", slots)
    assert backup.bytes_held() == 3 * 32
    assert backup.take_readied("j", ["p", "q"]) == ["ref"]      # the move failed: the memory goes
    assert backup.bytes_held() == 0 and not state.readied
    assert backup.ready_replica(state, spec, param, "ref", slots)
    meta, arrays = owner.export_key(ks)
    rks = backup.install_replica(state, spec, "server", True, "adam", {"lr": 0.1}, meta, [a.copy() for a in arrays])
    assert rks.param is param and rks.param_ref == "ref" and not state.readied
    assert {id(a) for a in rks.optimizer.state_arrays().values()} == {id(s) for s in slots}
    assert not backup.ready_replica(state, spec, param, "ref", slots)       # backed up here already
    assert backup.bytes_held() == 3 * 32
    np.testing.assert_array_equal(rks.param, ks.param)
    grads = []
    owner.on_step = lambda k, g: grads.append(g.copy())
    owner.push(ks, 0, np.full(8, 0.25, np.float32))
    backup.replica_step(rks, 2, grads[-1], dict(ks.optimizer.hp))
    np.testing.assert_array_equal(rks.param, ks.param)
    for name, a in ks.optimizer.state_arrays().items():
        np.testing.assert_array_equal(rks.optimizer.state_arrays()[name], a)
