"""A restarted pMaster's pool rebuilt from its aggregators' notes (``autops.master.rebuild``), without
processes: a pool is packed by the real elasticity code, every aggregator's note goes through
JSON (as over the wire), a fresh pool adopts the keys the aggregators hold (as
``Master._adopt`` does) and restores the notes. The rebuilt records -- aggregator states,
clusters, packing, profiles -- must equal the original's, and so must the decisions taken on
them."""
from __future__ import annotations

import json

from autops.master.pool import AggInfo, JobInfo
from autops.master.rebuild import Restorer, note_for
from test_autops_elastic import CONF, TENSORS, Pool, packed


def three_jobs_and_one_profiling() -> Pool:
    """X and Y packed together on agg-0, Z kept apart on agg-1 (LossLimit 0.25, as in
    test_autops_elastic), W still profiling on its temporary agg-2, agg-3 idle."""
    pool = Pool(4, loss_limit=0.25)
    packed(pool, "X", 0.4, 0.05)
    packed(pool, "Y", 0.03, 0.004)
    packed(pool, "Z", 0.22, 0.05)
    pool.register("W", requested=1)
    assert pool.where("X") == pool.where("Y") == {"agg-0"} and pool.where("Z") == {"agg-1"}
    assert pool.where("W") == {"agg-2"} and pool.states()["agg-3"] == "idle"
    return pool


def restarted(before: Pool, notes: bool = True) -> Pool:
    """A fresh pool whose aggregators register again: each with what it holds (adopted, like
    ``Master._adopt``) and its note through JSON; then the heartbeats' profiles arrive."""
    after = Pool(0, loss_limit=0.25)
    restorer = Restorer(after.state)
    for agg_id in sorted(before.state.aggs):
        note = json.loads(json.dumps(note_for(before.state, agg_id)))
        info = AggInfo(agg_id, agg_id.encode(), {"tcp": f"tcp://{agg_id}"}, "host", 1, after.clock())
        after.state.add_aggregator(info)
        for old in before.state.jobs.values():
            held = {k: a for k, a in old.table.items() if a == agg_id}
            if not held:
                continue
            job = after.state.jobs.get(old.job)
            if job is None:
                job = JobInfo(old.job, old.secret, old.world_size, 0, "sum", True, None, {}, 4 << 20, 64 << 10, [])
                job.state = "dedicated"
                after.state.jobs[job.job] = job
            for key in held:
                job.keys[key] = old.keys[key]
                job.table[key] = agg_id
                job.adopted[old.keys[key].tensor] = CONF
            job.tensors.update({t: (s, d, CONF) for t, s, d in TENSORS})
            job.ranks, job.last_heard, job.last_progress = {0, 1}, after.clock(), after.clock()
            job.touched.add(agg_id)
            job.aggregators = sorted(set(job.table.values()))
            job.home = job.home or job.aggregators[0]
        if notes:
            restorer.restore(info, note)
        after.elastic.aggregator_registered(info)
    for old in before.state.jobs.values():       # the per-key CPU times come with heartbeats
        after.elastic.on_aggregator_profile({old.job: {k: [e * 10, 10] for k, e in old.e.items()}})
    return after


def records(pool: Pool) -> dict:
    state = pool.state
    return {
        "aggs": {a: (i.state, i.cluster, i.exclusive, i.reserved_for, i.busy) for a, i in state.aggs.items()},
        "clusters": {c.name: (sorted(c.aggs), sorted(c.jobs)) for c in state.clusters.values()},
        "jobs": {j.job: (j.state, j.cluster, j.requested, j.standalone, j.reverts, j.temps, j.home,
                         sorted(j.aggregators), dict(j.table)) for j in state.jobs.values()},
    }


def test_the_rebuilt_pool_equals_the_one_before_the_restart():
    before = three_jobs_and_one_profiling()
    after = restarted(before)
    assert records(after) == records(before)
    assert after.state.jobs["W"].state == "profiling" and after.state.aggs["agg-2"].reserved_for == "W"


def test_decisions_on_the_rebuilt_pool_are_the_ones_the_old_pmaster_would_take():
    before = three_jobs_and_one_profiling()
    after = restarted(before)
    for pool in (before, after):
        cluster = pool.state.clusters[pool.state.jobs["X"].cluster]
        assert pool.elastic.recycling_plan(cluster) == ([], {})          # X keeps Z apart
    for pool in (before, after):                  # X ends: agg-0 is drained, Y joins Z on agg-1
        assert pool.elastic.release_job("X")
        pool.settle()
    assert records(after) == records(before)
    assert after.where("Y") == after.where("Z") == {"agg-1"} and after.states()["agg-0"] == "idle"
    # a new cluster opened by the restarted pMaster does not take a restored one's name
    assert after.state.open_cluster().name not in {c for c in records(before)["clusters"]}


def test_without_notes_the_jobs_stay_where_they_are_as_before():
    # an aggregator that never got a note (or an older one): its jobs are adopted "dedicated",
    # the aggregators idle, no clusters -- what a restarted pMaster did before notes existed
    after = restarted(three_jobs_and_one_profiling(), notes=False)
    assert {j.state for j in after.state.jobs.values()} == {"dedicated"} and not after.state.clusters


def test_malformed_notes_are_ignored_and_a_job_registered_anew_is_not_overwritten():
    pool = Pool(2)
    fresh = pool.register("N", requested=1)                      # this pMaster's own job
    restorer = Restorer(pool.state)
    info = pool.state.aggs["agg-1"]
    for note in (None, 7, "x", {"state": "exploded", "cluster": 3, "busy": float("nan"), "jobs": [1]},
                 {"jobs": {"N": {"state": "packed", "cluster": "c9", "standalone": -1}}, "exclusive": ["x"]}):
        restorer.restore(info, note)
    assert info.state == "idle" and info.cluster is None and info.exclusive is None and info.busy is None
    assert fresh.state == "profiling" and fresh.cluster is None and not pool.state.clusters


def _adopted_job(pool: Pool, job_id: str, world: int = 2) -> JobInfo:
    """A job as ``Master._adopt`` rebuilds it: keys held, no rank registered again yet."""
    job = JobInfo(job_id, "s", world, 0, "sum", True, None, {}, 4 << 20, 64 << 10, [])
    job.state, job.adopted, job.last_heard = "dedicated", {"w": CONF}, pool.clock()
    job.last_progress = pool.clock()
    pool.state.jobs[job_id] = job
    return job


def test_each_job_is_restored_from_the_newest_note_in_whichever_order_they_come():
    """An aggregator slow to hear from pMaster holds a note from before the job was packed."""
    for order in ((0, 1), (1, 0)):
        pool = Pool(0)
        restorer = Restorer(pool.state)
        job = _adopted_job(pool, "J")
        old = {"state": "temporary", "jobs": {"J": {"state": "profiling", "requested": 1}}, "at": 100.0}
        new = {"state": "active", "cluster": "c0",
               "jobs": {"J": {"state": "packed", "cluster": "c0", "standalone": 0.2, "requested": 1}}, "at": 101.0}
        notes = (old, new)
        for i in order:
            info = AggInfo(f"agg-{i}", b"x", {"tcp": "tcp://x"}, "host", 1, pool.clock())
            pool.state.add_aggregator(info)
            restorer.restore(info, notes[i])
        assert (job.state, job.cluster, job.standalone) == ("packed", "c0", 0.2), order
        assert pool.state.clusters["c0"].jobs == {"J"}


def test_an_adopted_job_whose_ranks_have_not_registered_again_is_profiled_and_expires():
    """Its workers train on without registering again: rank 0's profile records count (no
    error), they keep it alive, and without them it is released after the job timeout."""
    pool = Pool(0)
    job = _adopted_job(pool, "J")
    for rank in (1, 0):
        pool.elastic.on_profile(job, {"job": "J", "rank": rank, "iteration": 50, "count": 10, "duration": 0.1})
    assert job.iterations == 50 and job.measured == 0.1
    assert pool.elastic.expired_jobs(pool.clock() + CONF_TIMEOUT - 1) == []
    assert pool.elastic.expired_jobs(pool.clock() + CONF_TIMEOUT + 1) == ["J"]


CONF_TIMEOUT = Pool(0).elastic.cfg.job_timeout
