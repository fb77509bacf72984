"""Live migration without processes: the state a server-mode key sends ahead of its switch,
the old owner's bookkeeping of it, buffers kept for keys that come back, pMaster's phases,
and memory populated without holding the GIL.

The new owner's copy of a key must equal the old owner's bit for bit at the switch, whether
it came ahead and followed the old owner's steps, or this aggregator was the key's replica;
anything else is refused (the old owner then sends the whole state).
"""
from __future__ import annotations

import mmap
import resource
import time

import numpy as np
import pytest

from autops.master import migration
from autops.wire import protocol as wire
from autops.master.migration import LEAD_ITERATIONS, Migrations
from autops.wire.partition import KeySpec
from autops.master.pool import AggInfo, JobInfo, PoolState
from autops.aggregator.moves_state import Arrival, Move
from autops.aggregator.precopy import Follower, Precopies
from autops.aggregator.spare import SpareBuffers
from autops.aggregator.store import Store, StoreError
from autops.transport import prefault, shm
from autops.transport.base import Shared
from test_autops_elastic import FakeClock, RecordingOutbox, message

SPEC = KeySpec("w", "w", 0, 6, "float32", False)
ADAM = {"optimizer": "adam", "hp": {"lr": 0.1}}


def owner(world: int = 2) -> tuple[Store, object, list]:
    """A server-mode key (adam) with its master copy; ``steps`` collects each step's gradient."""
    s = Store()
    steps: list = []
    s.on_step = lambda ks, grad: steps.append((ks.completed + 1, grad.copy(), dict(ks.optimizer.hp)))
    s.assign("j", "secret", world, "server", [SPEC], average=True, **ADAM)
    s.init(s.jobs["j"], "w", np.linspace(-1, 1, 6, dtype=np.float32))
    return s, s.jobs["j"].keys["w"], steps


def incoming() -> tuple[Store, object]:
    s = Store()
    s.assign("j", "secret", 2, "server", [SPEC], average=True, **ADAM)
    ks = s.jobs["j"].keys["w"]
    ks.arrival = Arrival(7)
    return s, ks


def iterate(s: Store, ks, it: int) -> None:
    for rank in (0, 1):
        g = np.full(6, 0.1 * (rank + 1) * it, np.float32)
        s.push(s.check_push(s.jobs["j"], rank, "w", it, g), rank, g)


def hold(ks, it: int) -> None:
    """Both ranks' pushes of ``it`` held by a key that is still incoming."""
    for rank in (0, 1):
        ks.held.append((rank, it, np.full(6, 0.1 * (rank + 1) * it, np.float32), False, False))


def same_state(a, b) -> None:
    np.testing.assert_array_equal(a.param, b.param)
    for name, arr in a.optimizer.state_arrays().items():
        np.testing.assert_array_equal(arr, b.optimizer.state_arrays()[name])
    assert a.optimizer.step_count == b.optimizer.step_count and a.completed == b.completed


# --- the new owner's store -----------------------------------------------------------------
def test_a_key_sent_ahead_and_kept_current_is_taken_over_with_its_counter_only():
    src, old, steps = owner()
    iterate(src, old, 1)
    dst, new = incoming()
    dst.precopy(new, *Store.export_key(old))          # the state after iteration 1, sent ahead
    for it in (2, 3):
        iterate(src, old, it)
        n, grad, hp = steps[-1]
        assert dst.replica_accepts(new, n, grad)
        dst.replica_step(new, n, grad, hp)              # the old owner's steps follow
    hold(new, 4)                                        # the workers pushed the next iteration early
    assert not dst.pull_ready(new, 4)
    dst.take_ahead(new, 3, None)
    assert not new.arrival.copy_missing and dst.apply_held(new) == (1, [])
    iterate(src, old, 4)
    same_state(new, old)                                # bit-identical to staying put


def test_a_state_behind_the_cutover_is_refused_and_the_key_stays_incoming():
    src, old, steps = owner()
    iterate(src, old, 1)
    dst, new = incoming()
    dst.precopy(new, *Store.export_key(old))
    iterate(src, old, 2)                                # step 2 never reached the new owner
    with pytest.raises(StoreError, match="no state of iteration 2"):
        dst.take_ahead(new, 2, None)
    assert new.arrival.copy_missing and new.arrival.mid == 7 and new.completed == 1
    dst.take_copy(new, *Store.export_key(old))          # the whole state, as the fallback sends it
    same_state(new, old)


def test_the_new_owner_that_was_the_replica_takes_the_state_from_its_replica():
    src, old, steps = owner()
    iterate(src, old, 1)
    dst, new = incoming()
    meta, arrays = Store.export_key(old)
    replica = dst.install_replica(dst.jobs["j"], SPEC, "server", True, "adam", {"lr": 0.1}, meta,
                                  [a.copy() for a in arrays])
    iterate(src, old, 2)
    dst.replica_step(replica, *steps[-1])
    dst.take_ahead(new, 2, replica)
    same_state(new, old)
    assert new.param is not replica.param               # a copy: the replica can go


def test_a_sum_key_is_taken_over_from_its_counter():
    s = Store()
    s.assign("j", "secret", 2, "sum", [SPEC])
    ks = s.jobs["j"].keys["w"]
    ks.arrival = Arrival(3)
    s.take_ahead(ks, 5, None)
    assert ks.completed == 5 and not ks.arrival.copy_missing


def test_only_a_server_key_migrating_here_takes_state_ahead():
    s = Store()
    s.assign("j", "secret", 2, "sum", [SPEC])
    ks = s.jobs["j"].keys["w"]
    ks.arrival = Arrival(3)
    with pytest.raises(StoreError, match="not a server-mode key migrating here"):
        s.precopy(ks, {"completed": 1}, [])
    _, new = incoming()
    new.arrival = None
    with pytest.raises(StoreError, match="not a server-mode key migrating here"):
        Store().precopy(new, {"completed": 1}, [])


# --- the old owner's bookkeeping -------------------------------------------------------------
class Key:
    def __init__(self, key: str, job: str = "j") -> None:
        self.job, self.spec = job, KeySpec(key, key, 0, 1, "float32", False)


def follower(agg: str) -> Follower:
    return Follower({"agg": agg}, incoming=True)


def test_states_go_out_within_the_window_and_a_key_can_switch_once_all_its_followers_hold_it():
    p = Precopies(window_bytes=100)
    a, b = Key("a"), Key("b")
    p.start(a, [follower("x")], 60)
    p.start(b, [follower("x"), follower("y")], 30)
    assert [(k.spec.key, f.agg) for k, f in p.due()] == [("a", "x"), ("b", "x")]    # 90 bytes
    p.start(Key("c"), [follower("x")], 60)
    assert p.due() == []                                  # b to y would make 120
    assert p.holds("j", "a", "x")                         # a's only follower: a can switch
    assert [(k.spec.key, f.agg) for k, f in p.due()] == [("b", "y")]                # c: 120 again
    assert not p.holds("j", "b", "x")                     # b still waits for y
    assert p.holds("j", "b", "y")
    assert [(k.spec.key, f.agg) for k, f in p.due()] == [("c", "x")]
    assert p.holds("j", "c", "x") and not p.holds("j", "c", "x")                     # told once
    assert p.in_flight == {} and p.waiting == {}


def test_one_state_larger_than_the_window_still_goes_out_alone():
    p = Precopies(window_bytes=10)
    p.start(Key("a"), [follower("x")], 50)
    p.start(Key("b"), [follower("x")], 5)
    assert [k.spec.key for k, _ in p.due()] == ["a"]
    p.holds("j", "a", "x")
    assert [k.spec.key for k, _ in p.due()] == ["b"]


def test_forgetting_a_job_frees_its_window_and_a_requeued_state_goes_out_again():
    p = Precopies(window_bytes=100)
    a, x = Key("a"), follower("x")
    p.start(a, [x], 10)
    p.start(Key("c", job="k"), [follower("x")], 10)
    p.due()
    p.requeue(a, x, 10)
    assert [k.spec.key for k, _ in p.due()] == ["a"]
    p.forget("k")
    p.forget("j", {"a"})
    assert p.in_flight == {} and not p.queue and p.waiting == {}


# --- buffers of keys that moved away ------------------------------------------------------------
def buffers(*sizes: int) -> list[Shared]:
    return [Shared(np.zeros(n, np.float32), ["s", f"seg-{n}", 1, 2, 4 * n, 0]) for n in sizes]


def test_spare_buffers_serve_only_a_complete_request_of_the_same_job():
    spare = SpareBuffers()
    kept = buffers(8, 8, 4)
    spare.keep("j", kept)
    assert spare.take("other", [(8, "float32")]) is None
    assert spare.take("j", [(8, "float32")] * 3) is None and spare.held("j") == 80    # nothing taken
    got = spare.take("j", [(4, "float32"), (8, "float32")])
    assert [b.array.size for b in got] == [4, 8] and all(any(b is k for k in kept) for b in got)
    assert spare.held("j") == 32
    spare.release("j")
    assert spare.take("j", [(8, "float32")]) is None


# --- pMaster's phases ------------------------------------------------------------------------------
def pool(*aggs: str) -> tuple[PoolState, RecordingOutbox, Migrations]:
    state = PoolState(heartbeat_timeout=5.0, clock=FakeClock())
    for name in aggs:
        state.add_aggregator(AggInfo(name, name.encode(), {"tcp": f"tcp://{name}"}, name, 1, state.clock()))
    outbox = RecordingOutbox()
    return state, outbox, Migrations(state, outbox)


def server_job(state: PoolState, owner: str, replica: str | None) -> JobInfo:
    job = JobInfo("J", "s", 2, 1, "server", False, "adam", {"lr": 0.1}, 4 << 20, 64 << 10, [])
    job.tensors["w"] = ((6,), "float32", {"mode": "server", "average": True, "optimizer": "adam",
                                          "hp": {"lr": 0.1}})
    job.keys["w"] = SPEC
    job.table["w"] = owner
    if replica is not None:
        job.replicas["w"] = replica
    state.jobs["J"] = job
    return job


def answer(outbox: RecordingOutbox, op: str, **fields) -> dict:
    agg, sent, reply, request = outbox.waiting.pop(0)
    assert sent == op, (sent, op)
    reply(message(wire.OK, **fields))
    return {"agg": agg, **request}


def test_a_server_key_switches_once_its_state_went_ahead():
    state, outbox, migrations = pool("a", "b", "c")
    job = server_job(state, "a", replica="c")
    [mid] = migrations.start(job, {"w": "b"})
    answer(outbox, wire.MIGRATE_PREPARE, segments=[])
    init = answer(outbox, wire.MIGRATE_INIT, cutovers={})    # the state goes ahead first
    assert init["agg"] == "a" and init["to"] == "b" and init["lead"] == LEAD_ITERATIONS
    assert [f["agg"] for f in init["followers"]["w"]] == ["b"]   # the replica c stays: only b follows
    assert "w" not in job.moves
    report = message(wire.MIGRATE_CUTOVER, mid=mid, job="J", cutovers={"w": 9})
    migrations.cutover(report, "c")                         # only the old owner decides
    assert "w" not in job.moves
    migrations.cutover(report, "a")
    assert job.moves["w"] == ("b", 10)
    migrations.copy_done(message(wire.TENSOR_COPY_DONE, mid=mid, job="J", keys=["w"]), "a")
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=["w"]), "b")
    assert job.table["w"] == "b" and job.replicas["w"] == "c" and "w" not in job.moves
    recent = migrations.status()["recent"]
    assert recent[-1]["first_iterations"] == [10, 10] and recent[-1]["precopied_keys"] == 1


def sum_batch_switching() -> tuple[Migrations, int]:
    """A sum-mode key ``w`` moving from ``a`` to ``b``, its cutover decided (iteration 4)."""
    state, outbox, migrations = pool("a", "b")
    job = server_job(state, "a", replica=None)
    job.tensors["w"][2]["mode"] = "sum"
    [mid] = migrations.start(job, {"w": "b"})
    answer(outbox, wire.MIGRATE_PREPARE, segments=[])
    answer(outbox, wire.MIGRATE_INIT, cutovers={"w": 4})
    return migrations, mid


def test_a_batch_reports_the_longest_hand_over_wait_its_new_owner_saw():
    migrations, mid = sum_batch_switching()
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=[], wait_ms=7.5), "b")
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=[], wait_ms=3.0), "b")
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=[], wait_ms=9.0), "a")  # not its report
    migrations.copy_done(message(wire.TENSOR_COPY_DONE, mid=mid, job="J", keys=["w"]), "a")
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=["w"]), "b")   # no figure: 0
    assert migrations.status()["recent"][-1]["handover_wait_ms"] == 7.5


def test_a_batch_keeps_the_switch_as_its_new_owner_saw_it():
    """The earliest first push and hand-over and the latest completion over the new owner's
    reports; another aggregator's report and a value that is no number are ignored."""
    migrations, mid = sum_batch_switching()
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=[], first_push_at=10.5,
                                   handover_at=10.2, done_at=11.0), "b")
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=[], first_push_at=10.4,
                                   handover_at="soon", done_at=11.3), "b")
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=[], first_push_at=1.0), "a")
    migrations.copy_done(message(wire.TENSOR_COPY_DONE, mid=mid, job="J", keys=["w"]), "a")
    migrations.worker_done(message(wire.WORKER_DONE, mid=mid, job="J", keys=["w"]), "b")
    assert migrations.status()["recent"][-1]["switch_seen"] == {"first_push_at": 10.4, "handover_at": 10.2,
                                                                "done_at": 11.3}


def test_moving_to_the_replica_sends_the_state_ahead_only_to_the_new_replica():
    state, outbox, migrations = pool("a", "b", "c")
    job = server_job(state, "a", replica="b")
    migrations.start(job, {"w": "b"})
    answer(outbox, wire.MIGRATE_PREPARE, segments=[])
    # the new replica makes the memory for the state ready before the old owner sends it
    ready = answer(outbox, wire.REPLICA_PREPARE)
    assert ready["agg"] == "c" and ready["keys"] == [SPEC.to_wire()]
    assert ready["mode"] == "server" and ready["optimizer"] == "adam" and ready["secret"] == "s"
    init = answer(outbox, wire.MIGRATE_INIT, cutovers={})
    assert [f["agg"] for f in init["followers"]["w"]] == ["c"]      # b holds the state already


def test_the_hand_over_waits_for_the_new_owner_and_the_new_replica_whichever_answers_last():
    state, outbox, migrations = pool("a", "b", "c")
    job = server_job(state, "a", replica="b")
    migrations.start(job, {"w": "b"})
    assert [w[:2] for w in outbox.waiting] == [("b", wire.MIGRATE_PREPARE), ("c", wire.REPLICA_PREPARE)]
    prepare = outbox.waiting.pop(0)
    answer(outbox, wire.REPLICA_PREPARE)
    assert not outbox.waiting                                        # the new owner has not answered
    prepare[2](message(wire.OK, segments=[]))
    assert answer(outbox, wire.MIGRATE_INIT, cutovers={})["agg"] == "a"


def test_a_failed_move_tells_the_new_replica_to_free_what_it_readied():
    state, outbox, migrations = pool("a", "b", "c")
    job = server_job(state, "a", replica="b")
    migrations.start(job, {"w": "b"})
    agg, sent, callback, _ = outbox.waiting.pop(0)
    assert sent == wire.MIGRATE_PREPARE
    callback(message(wire.ERROR, message="out of memory"))
    assert ("c", {"job": "J", "keys": ["w"], "backups": True}) in outbox.to(wire.MIGRATE_DROP)
    assert job.table["w"] == "a" and not migrations.batches


@pytest.mark.parametrize("lost, copied, dropped", [("b", False, True), ("b", True, True),
                                                    ("a", False, True), ("a", True, False)])
def test_a_move_abandoned_for_a_lost_aggregator_frees_the_new_replicas_memory_unless_the_state_stays(
        lost, copied, dropped):
    """The new owner (b) lost: the key stays with the old owner (a), so the new replica (c)
    drops what it readied. The old owner lost: a key it had handed over goes to the new owner
    and keeps c as its replica; one it had not is promoted elsewhere, so c drops it."""
    state, outbox, migrations = pool("a", "b", "c")
    job = server_job(state, "a", replica="b")
    [mid] = migrations.start(job, {"w": "b"})
    answer(outbox, wire.MIGRATE_PREPARE, segments=[])
    answer(outbox, wire.REPLICA_PREPARE)
    answer(outbox, wire.MIGRATE_INIT, cutovers={})
    if copied:
        migrations.copy_done(message(wire.TENSOR_COPY_DONE, mid=mid, job="J", keys=["w"]))
    migrations.abandon(migrations.batches[mid], lost)
    drops = outbox.to(wire.MIGRATE_DROP)
    assert drops == ([("c", {"job": "J", "keys": ["w"], "backups": True})] if dropped else [])
    assert not migrations.batches and not migrations.moving


@pytest.mark.parametrize("reply", ["error", "none"])
def test_a_replica_that_cannot_make_memory_ready_does_not_stop_the_move(reply):
    state, outbox, migrations = pool("a", "b", "c")
    job = server_job(state, "a", replica="b")
    migrations.start(job, {"w": "b"})
    answer(outbox, wire.MIGRATE_PREPARE, segments=[])
    agg, sent, callback, _ = outbox.waiting.pop(0)
    assert sent == wire.REPLICA_PREPARE and not outbox.waiting        # no hand-over before its answer
    callback(message(wire.ERROR, message="out of memory") if reply == "error" else None)
    init = answer(outbox, wire.MIGRATE_INIT, cutovers={})
    assert [f["agg"] for f in init["followers"]["w"]] == ["c"]


def test_without_a_third_aggregator_nothing_goes_ahead_and_a_sum_key_never_does():
    state, outbox, migrations = pool("a", "b")
    job = server_job(state, "a", replica="b")
    migrations.start(job, {"w": "b"})                 # the new replica would be a, the old owner
    answer(outbox, wire.MIGRATE_PREPARE, segments=[])
    assert answer(outbox, wire.MIGRATE_INIT, cutovers={"w": 3})["followers"] == {}
    assert job.moves["w"] == ("b", 4)
    job.tensors["w"][2]["mode"] = "sum"
    job.table["w"], job.moves = "b", {}
    migrations.moving.clear()
    migrations.start(job, {"w": "a"})
    answer(outbox, wire.MIGRATE_PREPARE, segments=[])
    assert answer(outbox, wire.MIGRATE_INIT, cutovers={"w": 5})["followers"] == {}


def test_recent_batches_are_bounded():
    assert migration.RECENT >= 1
    _, _, migrations = pool("a")
    migrations.recent = [{"mid": i} for i in range(migration.RECENT)]
    assert len(migrations.status()["recent"]) == migration.RECENT


# --- memory populated without the GIL ------------------------------------------------------------
def test_populated_shared_memory_takes_no_page_fault_on_first_use():
    if not prefault.CAN_POPULATE:
        pytest.skip("this kernel cannot populate through madvise (MAP_POPULATE is used instead)")
    assert not shm._flags(True) & getattr(mmap, "MAP_POPULATE", 0)      # mmap would hold the GIL
    pages = 2048
    seg = shm.Segment.create(pages * 4096, "test", populate=True)
    try:
        view = np.frombuffer(seg.buf, np.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        view[::4096] = 1
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del view
    finally:
        seg.close()
    assert faults < pages // 8, f"{faults} page faults touching {pages} populated pages"


# --- the benchmark's figures ---------------------------------------------------------------------
def records(comm: dict[int, float], period: float = 1.0) -> list[tuple[int, float, float, float]]:
    """(iteration, begin, communication start, end): iteration i begins at i * period."""
    return [(it, it * period, it * period + 0.5, it * period + 0.5 + c) for it, c in sorted(comm.items())]


def test_the_pause_is_the_excess_of_the_switch_iterations_and_the_window_keeps_the_rest():
    from dlrt_bench.autops_migrate import pauses
    comm = {it: 0.2 for it in range(1, 21)}
    comm[8] = 0.5          # background work while the state moves (inside the window)
    comm[10] = 0.23        # the switch
    per_rank = {0: records(comm), 1: records({**comm, 10: 0.25})}
    repeats = [{"switch_iterations": [10, 10]}]
    got = pauses(per_rank, repeats, [(7.6, 10.6)], skip=2, gap=3)
    assert got["baseline_comm_ms"] == pytest.approx(200.0) and repeats[0]["baseline_comm_ms"] == pytest.approx(200.0)
    assert got["max_pause_ms"] == pytest.approx(50.0) and got["median_pause_ms"] == pytest.approx(50.0)
    assert got["max_window_excess_ms"] == pytest.approx(300.0)
    assert repeats[0]["pause_ms"] == pytest.approx(50.0)


def test_the_pause_is_taken_against_the_jobs_time_not_the_median_worker():
    from dlrt_bench.autops_migrate import pauses
    # rank 0 pushes first and waits for rank 1 in every iteration: its communication is
    # always 40 ms longer. The job's time is rank 0's; the switch costs the job 10 ms.
    early = {it: 0.24 for it in range(1, 21)}
    late = {it: 0.2 for it in range(1, 21)}
    early[10], late[10] = 0.25, 0.21
    repeats = [{"switch_iterations": [10, 10]}]
    got = pauses({0: records(early), 1: records(late)}, repeats, [(7.6, 10.6)], skip=2, gap=3)
    assert repeats[0]["job_baseline_comm_ms"] == pytest.approx(240.0)
    assert repeats[0]["baseline_comm_ms"] == pytest.approx(220.0)      # the median of both workers
    assert got["pause_baseline"] == "job"
    assert got["max_pause_ms"] == pytest.approx(10.0) and repeats[0]["pause_ms"] == pytest.approx(10.0)
    # the definition before counts the spread as a pause, in the switch and without a migration
    assert got["max_pause_vs_worker_ms"] == pytest.approx(30.0)
    assert repeats[0]["pause_vs_worker_ms"] == pytest.approx(30.0)
    assert got["quiet_pause_ms_median"] == pytest.approx(0.0)
    assert got["quiet_pause_vs_worker_ms_median"] == pytest.approx(20.0)
    assert len(got["quiet_pause_ms"]) == len(got["quiet_pause_vs_worker_ms"]) == 6


def test_the_old_owners_last_iteration_is_measured_and_the_spread_it_leaves():
    from dlrt_bench.autops_migrate import pauses
    comm = {it: 0.2 for it in range(1, 21)}
    comm[9] = 0.32         # the cutover: the old owners' last iteration, 120 ms long for rank 1
    per_rank = {0: records({**comm, 9: 0.22}), 1: records(comm)}
    repeats = [{"switch_iterations": [10, 10]}, {"switch_iterations": None}]
    got = pauses(per_rank, repeats, [(7.6, 10.6), (15.6, 16.6)], skip=2, gap=3)
    assert repeats[0]["cutover_ms"] == pytest.approx(120.0)
    # rank 1 ended it 100 ms after rank 0: the switch starts that far apart
    assert repeats[0]["cutover_end_skew_ms"] == pytest.approx(100.0)
    assert repeats[1]["cutover_ms"] is None and repeats[1]["cutover_end_skew_ms"] is None
    assert got["cutover_ms_per_repeat"] == [pytest.approx(120.0)]
    assert got["max_cutover_ms"] == pytest.approx(120.0) and got["median_cutover_ms"] == pytest.approx(120.0)


def test_the_noise_alone_gives_the_same_statistic_over_iterations_without_a_migration():
    from dlrt_bench.autops_migrate import pauses
    comm = {it: 0.2 for it in range(1, 31)}
    comm.update({12: 0.26, 13: 0.21, 21: 0.24})       # noise before and after the migration
    comm[16] = comm[17] = 0.3                          # the switch spans two iterations
    repeats = [{"switch_iterations": [16, 17]}]
    got = pauses({0: records(comm), 1: records({**comm, 13: 0.29})}, repeats, [(15.6, 17.6)], skip=2, gap=6)
    # quiet stretches: 9..14 before, 19..24 after (15..17 overlap the migration, 18 is the
    # first after it); two-iteration spans, ms over 200: before 0 0 60 90 90, after 0 40 40 0 0
    assert got["max_pause_ms"] == pytest.approx(100.0)
    assert got["quiet_pause_ms_median"] == pytest.approx(20.0)
    assert got["quiet_pause_ms_p90"] == pytest.approx(90.0)


def test_the_goals_are_the_median_and_in_sum_mode_the_longest_pause():
    from dlrt_bench.autops_migrate import targets_met
    assert targets_met([10.0, 30.0, 0.0, 61.0], "sum") == {"median_pause_le_20ms": True, "max_pause_le_60ms": False}
    assert targets_met([10.0, 30.0, 25.0, 60.0], "sum") == {"median_pause_le_20ms": False, "max_pause_le_60ms": True}
    assert targets_met([90.0, 400.0, 100.0], "server") == {"median_pause_le_100ms": True}
    assert targets_met([], "sum") == {"median_pause_le_20ms": False, "max_pause_le_60ms": False}


def test_the_noise_alone_meets_the_goals_in_the_share_its_draws_allow():
    from dlrt_bench.autops_migrate import noise_only_share
    # every quiet value under both goals: every run without a pause meets them
    assert noise_only_share([-5.0, 0.0, 10.0], 4, "sum") == {"median_pause_le_20ms": 1.0,
                                                             "max_pause_le_60ms": 1.0, "all": 1.0}
    # half the values above 60 ms: a run of 4 moves stays under it when all 4 draws do
    # (1/16); its median (the mean of the middle two) is <= 20 when at least 3 of the 4 are
    # low (5/16), or when 2 are (6/16) -- never, (0 + 100) / 2 > 20
    got = noise_only_share([0.0, 100.0], 4, "sum", draws=200000)
    assert got["max_pause_le_60ms"] == pytest.approx(1 / 16, abs=0.005)
    assert got["median_pause_le_20ms"] == pytest.approx(5 / 16, abs=0.005)
    assert got["all"] == pytest.approx(1 / 16, abs=0.005)
    assert noise_only_share([0.0, 100.0], 4, "sum") == noise_only_share([0.0, 100.0], 4, "sum")   # a fixed seed
    assert noise_only_share([150.0, 50.0], 1, "server") == {"median_pause_le_100ms": pytest.approx(0.5, abs=0.02),
                                                            "all": pytest.approx(0.5, abs=0.02)}
    assert noise_only_share([], 4, "sum") is None and noise_only_share([1.0], 0, "sum") is None


def test_the_quiet_values_behind_the_noise_statistic_are_kept():
    from dlrt_bench.autops_migrate import pauses
    comm = {it: 0.2 for it in range(1, 21)}
    comm[6] = 0.25
    repeats = [{"switch_iterations": [10, 10]}]
    got = pauses({0: records(comm)}, repeats, [(8.6, 9.6)], skip=2, gap=4)
    # quiet: 4..7 before (6 is 50 ms over) and 11..14 after (8, 9 and 10, the first after it, are the window's)
    assert sorted(got["quiet_pause_ms"]) == pytest.approx([0.0] * 7 + [50.0])


def test_the_end_skew_is_how_far_apart_the_workers_iterations_end():
    from dlrt_bench.autops_migrate import end_skew
    late = {it: 0.2 for it in range(1, 12)}
    late.update({5: 0.23, 6: 0.25, 7: 0.21, 8: 0.29})      # ends 30, 50, 10, 90 ms after the other
    got = end_skew({0: records({it: 0.2 for it in range(1, 12)}), 1: records(late)}, skip=2)
    # iterations 3..11: skews 0 0 30 50 10 90 0 0 0 ms
    assert got["worker_end_skew_ms_median"] == pytest.approx(0.0)
    assert got["worker_end_skew_ms_p90"] == pytest.approx(58.0)
    one_rank = end_skew({0: records({1: 0.2, 2: 0.2, 3: 0.2})}, skip=0)
    assert one_rank == {"worker_end_skew_ms_median": None, "worker_end_skew_ms_p90": None}


def test_the_neighbour_cost_compares_its_iterations_during_and_outside_migrations():
    from dlrt_bench.autops_migrate import neighbour_cost
    comm = {it: (0.1 if 5 <= it <= 6 else 0.05) for it in range(1, 13)}
    got = neighbour_cost([records(comm)], [(5.2, 6.4)], skip=1)
    assert got["iterations_during"] == 2 and got["iterations_outside"] == 9
    assert got["comm_ratio"] == pytest.approx(2.0)
    assert got["iteration_ratio"] == pytest.approx(0.6 / 0.55, rel=1e-3)


def test_each_repeat_is_measured_against_the_iterations_around_it():
    from dlrt_bench.autops_migrate import pauses
    comm = {it: (0.2 if it < 12 else 0.6) for it in range(1, 31)}     # the machine got busier
    comm[20] = 0.65                                                     # a switch under that load
    repeats = [{"switch_iterations": [20, 20]}]
    pauses({0: records(comm)}, repeats, [(18.6, 20.6)], skip=2, gap=4)
    assert repeats[0]["baseline_comm_ms"] == pytest.approx(600.0)
    assert repeats[0]["pause_ms"] == pytest.approx(50.0)


def test_the_first_reply_counts_from_the_later_workers_start():
    from dlrt_bench.autops_migrate import first_reply
    comm = {it: 0.3 for it in range(1, 17)}
    late = [(it, b, s + (0.02 if it == 10 else 0.0), e) for it, b, s, e in records(comm)]    # rank 1 starts 10 late
    per_rank = {0: records(comm), 1: late}
    # the first operation completes 40 ms after the start (60 ms in iteration 14); in the
    # switch (10), 100 ms after rank 1's later start
    first = {it: it + 0.5 + (0.06 if it == 14 else 0.04) for it in range(1, 17)}
    first[10] = 10.62
    firsts = {0: list(first.items()), 1: [(it, t + 0.01) for it, t in first.items()]}
    repeats = [{"switch_iterations": [10, 10]}]
    got = first_reply(per_rank, firsts, repeats, [(7.6, 10.6)], skip=2)
    assert repeats[0]["first_reply_ms"] == pytest.approx(100.0)
    assert got["first_reply_ms_per_repeat"] == [pytest.approx(100.0)]
    assert repeats[0]["cutover_first_reply_ms"] == pytest.approx(40.0)     # iteration 9, the old owners' last
    # quiet: 3..6 and 12..16 -- eight at 40 ms, one at 60
    assert got["first_reply_ms_quiet_median"] == pytest.approx(40.0)
    assert got["first_reply_ms_quiet_p90"] == pytest.approx(44.0)


def test_tcp_loss_is_attributed_to_the_switch_the_lead_and_each_quiet_iteration():
    from dlrt_bench.autops_migrate import tcp_loss
    from dlrt_bench.tcp_loss import window_delta

    class Sampler:
        """One host's counters stepping at given times: retransmissions, and a timeout at 9.7."""
        events = {4.6: 10, 9.7: 400, 10.85: 50, 14.7: 7}      # 10.85: only rank 1 still communicates

        def window(self, t0, t1):
            seen = lambda t: {"h": {"RetransSegs": sum(n for at, n in self.events.items() if at <= t),  # noqa: E731
                                    "TCPTimeouts": int(t >= 9.7)}}
            return window_delta(seen(t0), seen(t1))

    comm = {it: 0.3 for it in range(1, 17)}
    per_rank = {0: records(comm), 1: records({**comm, 10: 0.4})}      # comm phases [i + .5, i + .8]
    repeats = [{"switch_iterations": [10, 10]}]
    got = tcp_loss(Sampler(), per_rank, repeats, [(7.6, 10.6)], skip=2)
    assert repeats[0]["tcp_switch"]["RetransSegs"] == 50 and repeats[0]["tcp_switch"]["TCPTimeouts"] == 0
    assert repeats[0]["tcp_lead"]["RetransSegs"] == 400 and repeats[0]["tcp_lead"]["TCPTimeouts"] == 1
    assert repeats[0]["tcp_lead"]["by_host"] == {"h": {"RetransSegs": 400, "TCPTimeouts": 1}}
    # iterations 3..16 less 7..11 (the window and the first one after it): 9 quiet, two lost segments
    assert got["iterations"] == 9 and got["retrans_max"] == 10 and got["retrans_median"] == 0
    assert got["iterations_with_timeout"] == 0
    assert [it for it, n, _, busy in got["per_iteration"] if n] == [4, 9, 10, 14]
    assert [it for it, *_, busy in got["per_iteration"] if busy] == [7, 8, 9, 10, 11]


@pytest.mark.parametrize("at_once", [False, True])
def test_memory_the_helper_thread_cannot_make_comes_back_as_an_allocation_error(monkeypatch, at_once):
    """A helper thread that runs out of memory readying a key's arrays hands the loop an
    allocation error (answered to pMaster), never nothing: the loop would wait forever."""
    from autops.aggregator import reserve as reserve_mod, service as aggregator_mod

    def no_memory(sizes, pace=None):
        raise MemoryError("no room for the optimizer state")

    monkeypatch.setattr(reserve_mod, "zeroed_arrays", no_memory)
    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="tcp", register_timeout=0.1)
    try:
        got = []
        agg.readier.ready_in_background("j", [(1024, "float32")], [(1024, "float32")], 8192, 0,
                                        lambda made, arrays: got.append((made, arrays)), at_once=at_once)
        deadline = time.monotonic() + 10
        while len(agg.readier.finished) < 2 and time.monotonic() < deadline:      # the figures, then the answer
            time.sleep(0.01)
        agg.readier.run_ready()
        [((buffers, error), arrays)] = got
        assert buffers is None and arrays is None and isinstance(error, MemoryError)
        assert agg.stats["prefaulted_bytes"] == agg.stats["at_once_prefaulted_bytes"] == 0
    finally:
        agg.close()


def test_the_room_check_counts_the_memory_an_aggregator_holds_ready(monkeypatch):
    """A reserve takes memory from what the machine reports available in order to give it
    to jobs: a job it can hold is accepted, on a machine that now reports less than the job
    needs; one larger than the memory available plus what is held ready is refused."""
    from autops.aggregator import commitments as commitments_mod, service as aggregator_mod
    from autops.aggregator.store import StoreError

    from autops.aggregator import memroom

    available = 100 << 20
    monkeypatch.setattr(memroom, "mem_available", lambda: available)
    monkeypatch.setattr(memroom, "cgroup_room", lambda: None)          # no cgroup limit
    monkeypatch.setattr(commitments_mod, "heap_free", lambda: 24 << 20)
    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="shm", register_timeout=0.1)
    try:
        # the room alone (memroom's own tests: the rest)
        agg.commitments.headroom, agg.commitments.max_job_bytes = 0, 1 << 50
        piece = agg.memory.reserve.piece
        agg.memory.reserve.fill(2 * piece)
        held = agg.memory.reserve.held
        assert held == 2 * piece
        agg.commitments.check_room("fits", available + (24 << 20) + held)
        with pytest.raises(StoreError, match=rf"'too-big'.* has {available + (24 << 20) + held} available"):
            agg.commitments.check_room("too-big", available + (24 << 20) + held + 1)
        agg.memory.reserve.take([(piece, "uint8")] * 2, "fits")     # handed to a job: ready no more
        with pytest.raises(StoreError):
            agg.commitments.check_room("next", available + (24 << 20) + 1)
    finally:
        agg.close()


@pytest.mark.parametrize("shared, pieces", [(0.25, 1), (0.5, 2)])
def test_the_reserve_makes_its_shared_share_as_segments(shared, pieces):
    """``reserve_shared`` of the reserve becomes shared segments (whole pieces), the rest heap."""
    from autops.aggregator import service as aggregator_mod

    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="shm", register_timeout=0.1,
                                    reserve=64 << 20, reserve_shared=shared)
    try:
        piece = agg.memory.reserve.piece
        assert piece == 16 << 20
        agg.readier.keep_reserve()
        deadline = time.monotonic() + 30
        while not agg.readier.finished and time.monotonic() < deadline:      # the helper thread's figures
            time.sleep(0.01)
        agg.readier.run_ready()
        assert agg.memory.reserve.held == pieces * piece
        assert agg.stats["reserve_warmed_bytes"] >= pieces * piece
    finally:
        agg.close()


def test_a_reserve_share_outside_0_to_1_is_refused():
    from autops.aggregator import service as aggregator_mod

    for shared in (0.0, 1.5):
        with pytest.raises(ValueError, match="reserve_shared"):
            aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="shm", register_timeout=0.1, reserve=1,
                                      reserve_shared=shared)


@pytest.mark.parametrize("backups", [True, False])
def test_a_new_replicas_backup_goes_to_the_spares_when_its_move_is_abandoned(backups):
    """MIGRATE_DROP with ``backups`` (pMaster's, to the new replica of a move that did not
    complete) frees the backup the state sent ahead made there; without it (to an old owner
    after a move, or to a new owner that is the key's current replica) backups stay."""
    from autops.aggregator import service as aggregator_mod

    src, old, _ = owner()
    meta, arrays = Store.export_key(old)
    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="tcp", register_timeout=0.1)
    try:
        state = agg.store.ensure_job("j", "secret", 2, "server", True, "adam", {"lr": 0.1})
        agg.store.install_replica(state, SPEC, "server", True, "adam", {"lr": 0.1}, meta, [a.copy() for a in arrays])
        agg.moves_in.drop(message(wire.MIGRATE_DROP, job="j", keys=["w"], **({"backups": True} if backups else {})))
        assert ("w" in state.replicas) is not backups
        assert (agg.moves_in.spare.take("j", [(SPEC.numel, SPEC.dtype)]) is not None) is backups
    finally:
        agg.close()


@pytest.mark.parametrize("under_way", ["key moving in", "key moving out", "memory being readied",
                                       "key moved in, its first iteration here not done"])
def test_the_reserve_makes_its_segments_again_only_once_the_moves_here_are_over(under_way):
    """Segments a job took are made again on idle CPU, but not while a key moves in or out
    of this aggregator (in: until its first iteration here, the workers' switch, is done),
    nor while a helper thread readies memory for keys arriving (which took the segments):
    that work would land in the move's window."""
    from autops.aggregator import reserve as reserve_mod, service as aggregator_mod

    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="shm", register_timeout=0.1,
                                    reserve=64 << 20, reserve_shared=0.5)
    try:
        reserve = agg.memory.reserve
        agg.readier.keep_reserve()
        deadline = time.monotonic() + 30
        while reserve.held < 32 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reserve.held == 32 << 20
        state = agg.store.ensure_job("j", "secret", 2, "server", True, "adam", {"lr": 0.1})
        key = type("Key", (), {"arrival": None, "move": None})()
        state.keys["w"] = key
        if under_way == "key moving in":
            key.arrival = Arrival(5)
        elif under_way == "key moving out":
            key.move = Move(1, "agg-2", {}, 12)
        elif under_way == "memory being readied":
            agg.readier.readying = 1
        else:
            key.arrival = Arrival(5, copy_missing=False, first=12)
        reserve.take([(reserve.piece, "uint8")], "j")
        assert reserve.held == 16 << 20
        waited = time.monotonic() + 3 * reserve_mod.RESERVE_MOVE_POLL_S
        while time.monotonic() < waited:
            assert reserve.held == 16 << 20, "made again during the move"
            time.sleep(0.05)
        key.arrival, key.move, agg.readier.readying = None, None, 0   # the move is over
        deadline = time.monotonic() + 30
        while reserve.held < 32 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reserve.held == 32 << 20
    finally:
        agg.stop()
        agg.close()


def test_the_reserves_segments_being_made_again_stop_while_a_move_here_is_under_way(monkeypatch):
    """A move that starts while the segments a job took are being made again makes their
    pace wait (its quiet probe says no) until it is over; memory readied for arriving keys
    does not wait for moves (it is part of one)."""
    from autops.aggregator import reserve as reserve_mod, service as aggregator_mod

    now = [100.0]
    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="tcp", register_timeout=0.1)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(aggregator_mod.time, "monotonic", lambda: now[0])
            refill, arrivals = agg.readier.background_pace(wait_out_moves=True), agg.readier.background_pace()
            assert refill.quiet() and arrivals.quiet()
            assert refill.quiet_patience == reserve_mod.RESERVE_QUIET_PATIENCE_S
            state = agg.store.ensure_job("j", "secret", 2, "sum", True, None, {})
            key = type("Key", (), {"arrival": None, "move": Move(1, "agg-2", {}, 12)})()
            state.keys["w"] = key
            assert not refill.quiet() and arrivals.quiet()
            key.move = None
            assert refill.quiet()
    finally:
        agg.close()


def test_memory_made_ready_in_the_background_waits_for_a_gap_in_the_jobs_messages(monkeypatch):
    """The reserve's and incoming keys' memory is populated between the jobs' communication
    phases: the pace's quiet probe says no while the loop took a job's message within
    ``DATA_QUIET_S`` or replies wait to be sent, yes after that; pMaster's messages and
    peers' replies do not count."""
    from autops.aggregator import reserve as reserve_mod, service as aggregator_mod

    class Requests:                         # a listener with nothing queued
        def recv(self):
            return None

    now = [100.0]
    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="tcp", register_timeout=0.1)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(aggregator_mod.time, "monotonic", lambda: now[0])
            pace = agg.readier.background_pace()
            assert pace.quiet is not None and pace.quiet()
            agg._drain(Requests())
            assert not pace.quiet()
            now[0] += reserve_mod.DATA_QUIET_S / 2
            assert not pace.quiet()
            now[0] += reserve_mod.DATA_QUIET_S / 2
            assert pace.quiet()
            agg._drain_master()             # nothing from pMaster either: still quiet
            assert pace.quiet()
            patched.setattr(agg.transport, "sending", lambda: True)     # replies still being drained
            assert not pace.quiet()
    finally:
        agg.close()


def test_the_transport_is_sending_while_one_of_its_listeners_is():
    from autops.aggregator import service as aggregator_mod

    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="tcp", register_timeout=0.1)
    try:
        assert agg.transport.listeners and not agg.transport.sending()
        agg.transport.listeners[-1].sending = lambda: True
        assert agg.transport.sending()
    finally:
        agg.close()


def test_the_warm_size_comes_from_the_environment_and_is_bounded(monkeypatch):
    """How much an agent warms a move's new connections with: ``$AUTOPS_WARM_BYTES`` (bytes;
    0 turns it off), else 32 MiB; a size outside 0..``wire.MAX_WARM_BYTES`` is refused when
    the agent is made, before it reaches for pMaster."""
    from autops.config import WARM_BYTES, WARM_ENV
    from autops.worker.agent import Agent, AutoPSError, config_from_env

    monkeypatch.delenv(WARM_ENV, raising=False)
    assert config_from_env().warm_bytes == WARM_BYTES == 32 << 20
    monkeypatch.setenv(WARM_ENV, "0")
    assert config_from_env().warm_bytes == 0
    monkeypatch.setenv(WARM_ENV, str(1 << 20))
    assert config_from_env().warm_bytes == 1 << 20
    monkeypatch.setenv(WARM_ENV, "32M")
    with pytest.raises(AutoPSError, match="AUTOPS_WARM_BYTES='32M' is not a number"):
        config_from_env()
    with pytest.raises(AutoPSError, match="AUTOPS_WARM_BYTES='32M' is not a number"):
        Agent("tcp://127.0.0.1:9", "warm-job", 0, 1, secret="s" * 16)
    monkeypatch.delenv(WARM_ENV)
    for bad in (-1, wire.MAX_WARM_BYTES + 1):
        with pytest.raises(AutoPSError, match=f"warm_bytes {bad} outside"):
            Agent("tcp://127.0.0.1:9", "warm-job", 0, 1, secret="s" * 16, warm_bytes=bad)


def test_heartbeats_count_the_current_schedules_outliers_too():
    """``late`` / ``postponed`` in a heartbeat (and so in pMaster's status) include the
    aggregations the schedule in force put off, not only those of schedules replaced."""
    from autops.aggregator import service as aggregator_mod

    agg = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="tcp", register_timeout=0.1)
    sent: list = []
    agg._to_master = sent.append
    try:
        agg.cycles.set({"a": [1.0, 0.9], "b": [1.0, 0.9]}, time.monotonic())   # a 1 s cycle, one slot each
        start = agg.cycles.schedule.start
        assert agg._admit("a", 1, start + 0.1)                   # a's slot: at once
        assert not agg._admit("a", 2, start + 0.2)               # a second one in the cycle: b's
        agg._heartbeat()                                         # 0.9 s is reserved, so it waits
        beat = wire.decode(sent[-1])
        assert (beat["late"], beat["postponed"]) == (1, 1)
        agg.cycles.set({}, time.monotonic())                     # replaced: counted once, not twice
        agg._heartbeat()
        beat = wire.decode(sent[-1])
        assert (beat["late"], beat["postponed"]) == (1, 1)
    finally:
        agg.close()
