"""pMaster's elastic decisions on a fake clock: packing after the profile, revert below
LossLimit, recycling on job exit, periodic scaling passes and job timeouts.

``Elastic`` and ``Migrations`` run on a ``PoolState`` with a recording outbox and a fake
clock: no processes, sockets or sleeps. Iteration durations and per-key CPU times are given
as the agents' and aggregators' reports would carry them, so every decision follows from
Pseudocode 3's arithmetic, not from measured time.
"""
from __future__ import annotations

import pytest

from autops.wire import protocol as wire
from autops.master.assignment import spread_by_bytes
from autops.master.elastic import Elastic, ElasticConfig
from autops.master.migration import Migrations
from autops.wire.partition import plan_keys
from autops.master.pool import AggInfo, JobInfo, PoolState
from autops.master.providers import Provider

TENSORS = [("w", (4000,), "float32"), ("b", (100,), "float32")]     # keys "w" and "b"
CONF = {"mode": "sum", "average": False, "optimizer": None, "hp": {}}
COUNT = 5                       # iterations per PROFILE record


def message(op: str, **fields) -> wire.Message:
    return wire.decode(wire.encode(op, **fields))


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class RecordingOutbox:
    """Records every control message; those expecting an answer wait in ``waiting``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict]] = []
        self.waiting: list[tuple[str, str, object, dict]] = []

    def send_agg(self, agg: str, op: str, reply, **fields) -> None:
        self.sent.append((agg, op, fields))
        if reply is not None:
            self.waiting.append((agg, op, reply, fields))

    def to(self, op: str) -> list[tuple[str, dict]]:
        return [(agg, fields) for agg, o, fields in self.sent if o == op]


class OwningProvider(Provider):
    """A provider that started (owns) the aggregators named in ``owned`` and can stop them."""

    kind = "fake"

    def __init__(self, owned=()) -> None:
        self.owned = set(owned)
        self.stopped: list[str] = []

    def owns(self, name: str) -> bool:
        return name in self.owned

    def stop(self, name: str) -> bool:
        self.stopped.append(name)
        return True


class Pool:
    """``Elastic`` and ``Migrations`` over a pool of aggregators, driven like pMaster drives them."""

    def __init__(self, aggregators: int, provider: Provider | None = None, **config) -> None:
        self.clock = FakeClock()
        self.state = PoolState(heartbeat_timeout=5.0, clock=self.clock)
        self.outbox = RecordingOutbox()
        self.migrations = Migrations(self.state, self.outbox)
        self.config = ElasticConfig(**{"warmup_iters": 2, "profile_iters": 5, **config})
        self.elastic = Elastic(self.state, self.outbox, self.config, provider or Provider(), self.migrations)
        for i in range(aggregators):
            self.add_aggregator(f"agg-{i}")

    def add_aggregator(self, name: str) -> None:
        info = AggInfo(name, name.encode(), {"tcp": f"tcp://{name}"}, "host", 1, self.clock())
        self.state.add_aggregator(info)
        if not self.elastic.registered_for_revert(info):
            self.elastic.aggregator_registered(info)

    def heartbeat_all(self) -> None:
        for info in self.state.aggs.values():
            info.last_seen = self.clock()

    def register(self, name: str, requested: int = 1) -> JobInfo:
        """A W=2 job joins and declares TENSORS (what pMaster's register and declare do)."""
        job = JobInfo(name, "secret", 2, requested, "sum", False, None, {}, 4 << 20, 64 << 10, [],
                      requested=requested, last_heard=self.clock(), last_progress=self.clock())
        self.elastic.reserve(job)
        job.home = job.aggregators[0] if job.aggregators else None
        self.state.jobs[name] = job
        job.ranks = {0, 1}
        keys = plan_keys(TENSORS)
        for tensor, shape, dtype in TENSORS:
            job.tensors[tensor] = (shape, dtype, CONF)
        job.keys.update({k.key: k for k in keys})
        job.table.update(spread_by_bytes([(k.key, k.nbytes) for k in keys], job.aggregators))
        job.touched.update(job.aggregators)
        return job

    def report(self, job: JobInfo, duration: float, records: int = 1, rank: int = 0) -> None:
        """``records`` PROFILE records of ``COUNT`` iterations, each ``duration`` seconds long."""
        for _ in range(records):
            iteration = job.iterations + COUNT
            self.elastic.on_profile(job, message(wire.PROFILE, job=job.job, secret=job.secret, rank=rank,
                                                 iteration=iteration, count=COUNT, duration=duration))

    def profile(self, job: JobInfo, duration: float, cost: dict[str, float]) -> None:
        """A complete profile: iteration ``duration`` and CPU seconds per iteration of each key."""
        self.report(job, duration, records=3)
        for _ in range(2):
            self.elastic.on_aggregator_profile({job.job: {k: [c * 10, 10] for k, c in cost.items()}})

    def tick(self, advance: float = 0.0) -> None:
        """One pass of pMaster's loop, ``advance`` seconds after the last."""
        self.clock.t += advance
        for job_id in self.elastic.expired_jobs(self.clock()):
            self.elastic.release_job(job_id)
        self.elastic.tick(self.clock())

    def settle(self) -> None:
        """Answer like aggregators do and let every migration in flight complete."""
        while self.outbox.waiting or self.migrations.batches:
            while self.outbox.waiting:
                agg, op, reply, fields = self.outbox.waiting.pop(0)
                if op == wire.MIGRATE_INIT:
                    reply(message(wire.OK, cutovers={k: self.state.jobs[fields["job"]].iterations
                                                     for k in fields["keys"]}))
                else:
                    reply(message(wire.OK))
            for batch in list(self.migrations.batches.values()):
                self.migrations.copy_done(message(wire.TENSOR_COPY_DONE, mid=batch.mid, job=batch.job,
                                                  keys=batch.keys))
                self.migrations.worker_done(message(wire.WORKER_DONE, mid=batch.mid, job=batch.job,
                                                    keys=batch.keys))

    def where(self, job: str) -> set[str]:
        return set(self.state.jobs[job].table.values())

    def states(self) -> dict[str, str]:
        return {a: info.state for a, info in self.state.aggs.items()}


def cost(total: float) -> dict[str, float]:
    """Per-key CPU seconds of a TENSORS job summing to ``total`` (by bytes: w 16000, b 400)."""
    return {"w": total * 16000 / 16400, "b": total * 400 / 16400}


def packed(pool: Pool, name: str, duration: float, total_cost: float, requested: int = 1) -> JobInfo:
    job = pool.register(name, requested)
    pool.profile(job, duration, cost(total_cost))
    pool.tick()
    pool.settle()
    return job


# --- packing after the profile -------------------------------------------------------------------
def test_a_job_is_not_packed_before_its_profile_is_complete():
    pool = Pool(2)
    job = pool.register("J")
    pool.report(job, 0.1, records=2)            # iterations 5 and 10, all past the warmup
    pool.elastic.on_aggregator_profile({"J": {"w": [0.1, 10], "b": [0.01, 10]}})
    pool.tick()
    assert job.state == "profiling"              # only one aggregator report so far
    pool.elastic.on_aggregator_profile({"J": {"w": [0.1, 10], "b": [0.01, 10]}})
    pool.tick()
    assert job.state == "packed" and job.standalone == pytest.approx(0.1)


def test_a_job_packs_onto_an_active_aggregator_when_loss_limit_allows_and_its_temporary_is_released():
    pool = Pool(3, loss_limit=0.25)
    x = packed(pool, "X", 0.4, 0.05)
    assert x.state == "packed" and pool.where("X") == {"agg-0"}
    assert pool.states()["agg-0"] == "active" and pool.state.aggs["agg-0"].cluster == x.cluster
    # Y (0.03 s) runs 13 times in X's 0.4 s cycle: it loses 2.5% < 25%, and 13 * 0.004 fits
    y = pool.register("Y")
    assert y.aggregators == ["agg-1"]
    pool.profile(y, 0.03, cost(0.004))
    pool.tick()
    assert y.state == "packed" and pool.migrations.active(job="Y")
    assert [(agg, f["job"]) for agg, f in pool.outbox.to(wire.MIGRATE_PREPARE)] == [("agg-0", "Y")]
    pool.settle()
    assert pool.where("Y") == {"agg-0"} and y.cluster == x.cluster
    assert pool.states() == {"agg-0": "active", "agg-1": "idle", "agg-2": "idle"}
    assert ("agg-1", {"jobs": {}}) in pool.outbox.to(wire.CYCLE)       # the temporary is told it is empty
    cycles = [f["jobs"] for agg, f in pool.outbox.to(wire.CYCLE) if agg == "agg-0"]
    assert set(cycles[-1]) == {"X", "Y"}


def test_a_job_that_would_lose_loss_limit_keeps_its_own_aggregator_in_the_cluster():
    pool = Pool(3, loss_limit=0.25)
    x = packed(pool, "X", 0.4, 0.05)
    # Z (0.22 s) would run once per 0.4 s cycle next to X: 45% slower, over the limit
    z = packed(pool, "Z", 0.22, 0.05)
    assert z.state == "packed" and pool.where("Z") == {"agg-1"} and z.cluster == x.cluster
    assert pool.states() == {"agg-0": "active", "agg-1": "active", "agg-2": "idle"}
    assert not pool.outbox.to(wire.MIGRATE_PREPARE)                   # nothing had to move


def test_a_job_needing_more_aggregators_than_it_asked_for_stays_dedicated_on_its_temporaries():
    pool = Pool(2)
    job = packed(pool, "big", 0.1, 0.15)          # 1.5 aggregators of CPU, one asked for
    assert job.state == "dedicated" and pool.where("big") == {"agg-0"}
    assert pool.state.aggs["agg-0"].exclusive == "big" and pool.states()["agg-1"] == "idle"


# --- revert below LossLimit ----------------------------------------------------------------------
def slowed_pool(window: int = 15, **config) -> tuple[Pool, JobInfo]:
    pool = Pool(2, window=window, **config)
    job = packed(pool, "J", 0.1, 0.01)
    assert job.state == "packed" and pool.where("J") == {"agg-0"}
    return pool, job


def test_revert_when_a_packed_job_runs_below_one_minus_loss_limit_for_a_window():
    pool, job = slowed_pool()
    pool.report(job, 0.113, records=2)            # 0.1 / 0.113 = 0.885 < 0.9, but 10 < 15 iterations
    assert job.state == "packed" and job.low_iters == 10
    pool.report(job, 0.113)
    assert job.state == "dedicated" and job.reverts == 1
    pool.settle()
    assert pool.where("J") == {"agg-1"} and job.aggregators == ["agg-1"]
    assert pool.state.aggs["agg-1"].exclusive == "J" and pool.states() == {"agg-0": "idle", "agg-1": "active"}


def test_no_revert_while_the_packed_job_stays_above_one_minus_loss_limit():
    pool, job = slowed_pool()
    pool.report(job, 0.11, records=10)            # 0.1 / 0.11 = 0.909 >= 0.9
    assert job.state == "packed" and job.reverts == 0 and job.low_iters == 0
    assert not pool.migrations.batches


def test_the_mean_over_the_last_window_iterations_decides_not_one_slow_period():
    pool, job = slowed_pool()
    pool.report(job, 0.1, records=2)
    pool.report(job, 0.125)                      # 15 iterations, mean 0.1083: 0.923 >= 0.9
    assert job.state == "packed" and job.low_iters == 0
    pool.report(job, 0.125)                      # the oldest record leaves the window: mean 0.1167
    assert job.state == "dedicated" and job.reverts == 1


def test_a_faster_period_lowers_the_standalone_duration():
    pool, job = slowed_pool()
    pool.report(job, 0.05)
    assert job.standalone == pytest.approx(0.7 * 0.1 + 0.3 * 0.05)


def test_revert_below_the_allocation_threshold_waits_for_the_next_period():
    pool, job = slowed_pool(threshold=2, period=10.0)
    pool.report(job, 0.2, records=3)
    assert job.state == "packed" and pool.elastic.pending_reverts == ["J"]
    pool.tick(advance=5.0)
    assert job.state == "packed"
    pool.heartbeat_all()
    pool.tick(advance=5.0)                       # the period boundary: the revert is granted
    assert job.state == "dedicated" and job.reverts == 1 and pool.elastic.pending_reverts == []


def test_revert_without_a_free_aggregator_keeps_the_job_packed():
    pool = Pool(1, window=15)
    job = packed(pool, "J", 0.1, 0.01)
    pool.report(job, 0.2, records=3)
    assert job.state == "packed" and job.reverts == 0 and job.low_iters == 0


def test_revert_waits_for_an_aggregator_the_provider_starts():
    class Starting(Provider):
        def can_start(self, running: int) -> int:
            return 1

        def start(self, n: int) -> list[str]:
            return [f"new-{i}" for i in range(n)]

    pool = Pool(1, provider=Starting(), window=15)
    job = packed(pool, "J", 0.1, 0.01)
    pool.report(job, 0.2, records=3)
    assert job.revert_waiting == (1, [], {"new-0"}) and job.state == "packed"
    pool.add_aggregator("new-0")
    assert job.state == "dedicated" and pool.state.aggs["new-0"].exclusive == "J"
    pool.settle()
    assert pool.where("J") == {"new-0"}


# --- recycling on job exit -----------------------------------------------------------------------
def three_jobs() -> Pool:
    """LossLimit 0.25: X (0.4 s) and Y (0.03 s, 13 runs per cycle) share agg-0; Z (0.22 s) would
    lose 45% there (once per 0.4 s cycle), so it keeps agg-1."""
    pool = Pool(4, loss_limit=0.25)
    packed(pool, "X", 0.4, 0.05)
    packed(pool, "Y", 0.03, 0.004)
    packed(pool, "Z", 0.22, 0.05)
    assert pool.where("X") == pool.where("Y") == {"agg-0"} and pool.where("Z") == {"agg-1"}
    return pool


def test_the_recycling_decision_drains_the_least_loaded_aggregator_whose_keys_fit_elsewhere():
    pool = three_jobs()
    cluster = pool.state.clusters[pool.state.jobs["X"].cluster]
    assert pool.elastic.recycling_plan(cluster) == ([], {})          # X keeps Z apart
    pool.state.jobs.pop("X")
    # without X, agg-0's cycle is Y's 0.03 s (13% busy) < agg-1 (23%): Y fits next to Z (7 runs
    # per 0.22 s cycle, 4.5% loss)
    assert pool.elastic.recycling_plan(cluster) == (["agg-0"], {"Y": {"w": "agg-1", "b": "agg-1"}})


def test_recycling_after_a_job_exit_frees_the_least_loaded_aggregator():
    pool = three_jobs()
    prepared = len(pool.outbox.to(wire.MIGRATE_PREPARE))
    assert pool.elastic.release_job("X")
    assert {agg for agg, f in pool.outbox.to(wire.RELEASE_JOB) if f["job"] == "X"} == {"agg-0"}
    assert pool.states()["agg-0"] == "draining"
    assert [(agg, f["job"]) for agg, f in pool.outbox.to(wire.MIGRATE_PREPARE)[prepared:]] == [("agg-1", "Y")]
    pool.settle()
    assert pool.where("Y") == pool.where("Z") == {"agg-1"}
    assert [a for a, s in pool.states().items() if s != "idle"] == ["agg-1"]
    assert pool.migrations.completed > 0 and pool.migrations.failed == 0


def test_nothing_is_recycled_when_the_remaining_jobs_do_not_fit_together():
    pool = three_jobs()
    pool.elastic.release_job("Z")                 # agg-1 is empty: released at once; X and Y stay
    assert pool.states() == {"agg-0": "active", "agg-1": "idle", "agg-2": "idle", "agg-3": "idle"}
    assert not pool.migrations.batches and pool.where("X") == pool.where("Y") == {"agg-0"}


def test_an_aggregator_the_provider_started_is_stopped_when_released_beyond_spare():
    pool = Pool(2, provider=OwningProvider(owned={"agg-1"}), loss_limit=0.25)
    packed(pool, "X", 0.4, 0.05)
    packed(pool, "Y", 0.03, 0.004)                # Y's temporary agg-1 empties and is released
    assert pool.elastic.provider.stopped == ["agg-1"] and "agg-1" not in pool.state.aggs


def test_an_aggregator_a_job_was_given_is_not_released_before_the_job_declared():
    # Y registers while X holds the only aggregator and none can start: Y shares it. X ends
    # before Y declared its keys: the aggregator is Y's now and must stay
    pool = Pool(1, provider=OwningProvider(owned={"agg-0"}))
    pool.register("X", requested=0)
    y = JobInfo("Y", "secret", 2, 0, "sum", False, None, {}, 4 << 20, 64 << 10, [], requested=0,
                last_heard=pool.clock(), last_progress=pool.clock())
    pool.elastic.reserve(y)
    pool.state.jobs["Y"] = y
    assert y.aggregators == ["agg-0"] and y.best_effort
    pool.elastic.release_job("X")
    assert pool.elastic.provider.stopped == [] and "agg-0" in pool.state.aggs
    pool.tick(advance=1.0)                       # nor by the periodic pass
    assert pool.elastic.provider.stopped == [] and "agg-0" in pool.state.aggs


# --- periods and timeouts ------------------------------------------------------------------------
def test_the_period_pass_runs_on_the_clock_and_gives_back_empty_aggregators():
    pool = Pool(2, period=10.0)
    job = packed(pool, "J", 0.1, 0.01)
    cluster = pool.state.clusters[job.cluster]
    # an operator moved J away (no release asked for): agg-0 stays active and empty
    pool.elastic.migrate(job, {"w": "agg-1", "b": "agg-1"})
    pool.state.aggs["agg-1"].state = "active"
    pool.settle()
    assert pool.states() == {"agg-0": "active", "agg-1": "active"} and "agg-0" in cluster.aggs
    pool.tick(advance=9.0)
    assert pool.states()["agg-0"] == "active"
    pool.heartbeat_all()
    pool.tick(advance=1.0)
    assert pool.states()["agg-0"] == "idle" and "agg-0" not in cluster.aggs
    assert pool.outbox.to(wire.CYCLE)[-1] == ("agg-0", {"jobs": {}})


def test_the_period_pass_dissolves_clusters_without_aggregators_or_jobs():
    pool = Pool(1, period=10.0)
    packed(pool, "J", 0.1, 0.01)
    pool.elastic.release_job("J")
    assert len(pool.state.clusters) == 1 and pool.states() == {"agg-0": "idle"}
    pool.tick(advance=10.0)
    assert pool.state.clusters == {}


def test_a_job_no_worker_was_heard_from_is_released_after_the_timeout():
    pool = Pool(2, job_timeout=30.0)
    job = pool.register("J")
    quiet = pool.register("never-joined")
    quiet.ranks = set()
    pool.tick(advance=20.0)
    pool.report(job, 0.1)                          # heard at t + 20
    pool.tick(advance=30.0)
    assert pool.elastic.expired_jobs(pool.clock()) == []
    pool.tick(advance=0.5)
    assert "J" not in pool.state.jobs and "never-joined" in pool.state.jobs
    assert ("agg-0", {"job": "J"}) in pool.outbox.to(wire.RELEASE_JOB)
    assert pool.states()["agg-0"] == "idle"


def test_static_pools_do_not_pack_but_still_time_jobs_out():
    pool = Pool(1, enabled=False, job_timeout=5.0)
    job = pool.register("J")
    pool.profile(job, 0.1, cost(0.01))
    pool.tick()
    assert job.state == "dedicated" and not pool.outbox.to(wire.MIGRATE_PREPARE)
    pool.tick(advance=6.0)
    assert "J" not in pool.state.jobs


def test_only_progress_keeps_a_job_a_squatter_that_only_talks_is_released():
    """A job id is its first registrant's: one who only repeats registrations and profile
    records of no new iterations (a squatter holding the pool) loses its aggregators after the
    idle timeout; a job whose profile records progress, or whose keys its aggregators report
    pushed and pulled, keeps them."""
    pool = Pool(3, job_timeout=30.0, job_idle_timeout=60.0)
    squat, real, quiet_ps = pool.register("squat"), pool.register("real"), pool.register("pushes")
    squat.iterations = 0
    for _ in range(20):                                 # one message every 5 s, for 100 s
        pool.tick(advance=5.0)
        pool.heartbeat_all()
        for rank in (0, 1):                             # heartbeats: the same iteration, or none
            pool.elastic.on_profile(squat, message(wire.PROFILE, job="squat", secret="secret", rank=rank,
                                                   iteration=0, count=0, duration=None))
        pool.elastic.on_profile(squat, message(wire.PROFILE, job="squat", secret="secret", rank=0,
                                               iteration=0, count=5, duration=0.1))   # no new iteration
        if "real" in pool.state.jobs:
            pool.report(real, 0.1)                      # iterations move on
        if "pushes" in pool.state.jobs:                 # its aggregators saw pushes and pulls
            pool.elastic.on_aggregator_profile({"pushes": {k: [0.01, 3] for k in quiet_ps.keys}})
    assert "squat" not in pool.state.jobs
    assert any(f == {"job": "squat"} for _, f in pool.outbox.to(wire.RELEASE_JOB))
    assert "real" in pool.state.jobs and "pushes" in pool.state.jobs



def test_a_job_pausing_longer_than_the_job_timeout_but_talking_keeps_its_aggregators():
    """An evaluation or checkpoint phase: no pushes for 10 minutes, while the workers send their
    records (no new iterations). Kept up to the idle timeout; a job whose workers went silent is
    released after the job timeout."""
    pool = Pool(2, job_timeout=30.0, job_idle_timeout=1800.0)
    paused, silent = pool.register("paused"), pool.register("silent")
    pool.report(paused, 0.1)
    pool.report(silent, 0.1)
    for _ in range(120):                                 # 10 minutes, a record every 5 s
        pool.tick(advance=5.0)
        pool.heartbeat_all()
        if "paused" in pool.state.jobs:
            pool.elastic.on_profile(paused, message(wire.PROFILE, job="paused", secret="secret", rank=0,
                                                    iteration=paused.iterations, count=0, duration=None))
    assert "paused" in pool.state.jobs and "silent" not in pool.state.jobs
