"""pMaster's pool state queries and its outbox to the aggregators, on a fake clock."""
from __future__ import annotations

from autops.wire import protocol as wire
from autops.master.outbox import AggregatorOutbox
from autops.wire.partition import KeySpec
from autops.master.pool import AggInfo, JobInfo, PoolState


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def pool_with(*names: str) -> tuple[PoolState, FakeClock]:
    clock = FakeClock()
    state = PoolState(heartbeat_timeout=5.0, clock=clock)
    for name in names:
        state.add_aggregator(AggInfo(name, name.encode(), {}, "host", 1, clock()))
    return state, clock


def job_on(state: PoolState, name: str, table: dict[str, str], nbytes: int = 400) -> JobInfo:
    job = JobInfo(name, "s", 1, 1, "sum", False, None, {}, 1 << 20, 1 << 10, sorted(set(table.values())))
    for key in table:
        job.keys[key] = KeySpec(key, key, 0, nbytes // 4, "float32", True)
    job.table.update(table)
    state.jobs[name] = job
    return job


def test_liveness_follows_the_clock_and_idle_aggregators_are_listed_by_name():
    state, clock = pool_with("b", "a", "c")
    state.aggs["c"].state = "active"
    assert [a.agg_id for a in state.idle()] == ["a", "b"] and state.busy_count() == 1
    clock.t += 5.0
    state.aggs["b"].last_seen = clock()
    clock.t += 0.5
    assert [a.agg_id for a in state.live_aggregators()] == ["b"]
    assert [a.agg_id for a in state.idle()] == ["b"] and state.busy_count() == 0


def test_forgetting_an_aggregator_drops_its_identity_too():
    state, _ = pool_with("a", "b")
    state.forget_aggregator("a")
    assert list(state.aggs) == ["b"] and state.by_identity == {b"b": "b"}


def test_bytes_tasks_and_loads_per_aggregator():
    state, _ = pool_with("a", "b", "c")
    one = job_on(state, "J1", {"x": "a", "y": "b"})
    one.moves["y"] = ("c", 7)                    # y is being handed over to c
    two = job_on(state, "J2", {"z": "a"}, nbytes=800)
    assert state.load_bytes() == {"a": 1200, "b": 400, "c": 0}
    assert state.tasks_on("a") == {"J1": ["x"], "J2": ["z"]}
    assert state.tasks_on("c") == {"J1": ["y"]} and state.tasks_on("b") == {"J1": ["y"]}
    one.standalone, one.e = 2.0, {"x": 0.5, "y": 0.25}
    two.e = {"z": 1.0}                            # not profiled yet: left out of the loads
    assert state.loads(["a", "b"]) == {"a": {"J1": (2.0, 0.5)}, "b": {"J1": (2.0, 0.25)}}


def test_cluster_aggregators_are_the_active_shared_ones():
    state, _ = pool_with("a", "b", "c", "d")
    cluster = state.open_cluster()
    assert cluster.name == "c0" and state.open_cluster().name == "c1"
    cluster.aggs.update({"a", "b", "c", "gone"})
    state.aggs["a"].state = state.aggs["b"].state = "active"
    state.aggs["b"].exclusive = "J"
    assert state.cluster_aggs(cluster) == ["a"]


def test_outbox_matches_replies_and_answers_none_when_they_are_overdue():
    state, clock = pool_with("a")
    sent, answers = [], []
    outbox = AggregatorOutbox(state, lambda identity, frames: sent.append((identity, wire.decode(frames))), 10.0)
    outbox.send_agg("a", wire.CYCLE, None, jobs={})
    outbox.send_agg("a", wire.RELEASE_JOB, answers.append, job="J1")
    outbox.send_agg("a", wire.RELEASE_JOB, answers.append, job="J2")
    outbox.send_agg("gone", wire.RELEASE_JOB, answers.append, job="J3")
    assert answers == [None]                     # unknown aggregator: answered at once
    assert [(i, m.op, m.get("job"), m.get("req")) for i, m in sent] == [
        (b"a", wire.CYCLE, None, None), (b"a", wire.RELEASE_JOB, "J1", 1), (b"a", wire.RELEASE_JOB, "J2", 2)]
    ok = wire.decode(wire.encode(wire.OK, req=2))
    assert outbox.deliver(ok) and answers == [None, ok]
    assert not outbox.deliver(ok)                 # answered once only
    clock.t += 10.0
    outbox.expire(clock())
    assert answers == [None, ok]
    clock.t += 0.1
    outbox.expire(clock())
    assert answers == [None, ok, None]
    assert not outbox.deliver(wire.decode(wire.encode(wire.OK, req=1)))
