"""What a tenant's jobs, and keys moved by live migration, may make a shared aggregator hold
(docs/autops.md, "Limits on what a peer can make an aggregator hold"), against real processes.

* CURVE on, two tenants (``dlrt keys tenant``) and the cluster's member key: pMaster learns
  each job's tenant from the key its registration came with and names it in ASSIGN, so tenant
  alice's second job, which takes her past ``--max-tenant-bytes``, is refused at its
  declaration (before any push, nothing allocated for it) and told so again at its next
  request, naming the option; her first job, tenant bob's and the member's train on with
  exact values, and ``autops status`` shows each job's tenant; bob registering a rank of
  alice's job with its secret is refused (a job cannot change owner); once her first job
  ended she has room again; all commitments go back to zero when the jobs end.
* Keys moved to an aggregator whose ``--max-job-bytes`` is too small for them: the move is
  refused before anything is allocated there (pMaster fails the batch with that error, the
  old owner keeps the keys and the job trains on with exact values); keys that fit move in
  and are committed there, within the limit; commitments go back to zero when the job ends.
"""
from __future__ import annotations

import numpy as np
import pytest

from autops.admin import AdminClient
from autops.worker.agent import Agent, AuthRefused, AutoPSError
from autops.local import LocalPool
from autops_testlib import secret_for
from dlrt.curve import Security
from dlrt.keys import Keys, add_tenant, init_keys
from waiting import wait_for

M = 1 << 20
NUMEL = 1_000_000             # float32: 4 MB a buffer, 8 MB committed in sum mode (two buffers)
JOB_BYTES = 2 * 4 * NUMEL


def _agg_stats(pool: LocalPool, agg: str = "agg-0") -> dict:
    return next(a for a in pool.status()["aggregators"] if a["id"] == agg)


def _reported(pool: LocalPool, agg: str, predicate, what: str) -> dict:
    """``agg``'s figures once ``predicate`` holds for them (they come with its heartbeats)."""
    return wait_for(lambda: (lambda s: s if predicate(s) else None)(_agg_stats(pool, agg)), timeout=20, what=what)


def _agent(pool: LocalPool, name: str, security: Security | None = None) -> Agent:
    """Rank 0 of a one-rank sum-mode job over tcp, registered with ``security``'s key."""
    return Agent(pool.master, name, 0, 1, average=False, num_aggregators=0, timeout=30, transport="tcp",
                 secret=secret_for(name), security=security or pool.security)


class Job:
    """A one-rank sum-mode job of one key ``w`` over tcp, pushing ``it * base`` at iteration ``it``."""

    def __init__(self, pool: LocalPool, name: str, security: Security | None = None, numel: int = NUMEL) -> None:
        self.agent = _agent(pool, name, security)
        self.base = np.arange(numel, dtype=np.float32) % 1000
        self.out = np.empty_like(self.base)
        self.it = 0
        try:
            self.agent.declare([("w", (numel,), "float32")])
        except BaseException:
            self.agent.close()
            raise

    def step(self) -> None:
        self.it += 1
        self.agent.push_pull("w", self.base * self.it, self.out, self.it).wait(30)
        np.testing.assert_array_equal(self.out, self.base * self.it)

    def close(self) -> None:
        self.agent.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return init_keys(tmp_path_factory.mktemp("cluster-keys"))


def tenant(keys, directory, name: str) -> Security:
    return Security(Keys.load(add_tenant(name, directory / name, keys)))


def test_a_tenant_past_its_quota_is_refused_at_declaration_and_others_train_on(keys, tmp_path):
    alice, bob = tenant(keys, tmp_path, "alice"), tenant(keys, tmp_path, "bob")
    args = ["--max-job-bytes", "8M", "--max-tenant-bytes", "12M"]
    with LocalPool(1, env={"DLRT_KEYS": str(keys)}, master_args=["--static"], aggregator_args=args) as pool:
        assert pool.security.curve
        jobs = [Job(pool, "alice-1", alice)]
        try:
            jobs[0].step()
            # pMaster names alice as the tenant in ASSIGN: the aggregator refuses the second job's
            # keys when it declares them, not at its first push
            second = _agent(pool, "alice-2", alice)
            try:
                for _ in range(2):                           # and its next table request is told so again
                    with pytest.raises(AutoPSError, match=r"job 'alice-2' of tenant 'alice'.*limit of 12582912 "
                                                          r"bytes per tenant \(--max-tenant-bytes\)"):
                        second.declare([("w", (NUMEL,), "float32")])
            finally:
                second.close()
            refused = _reported(pool, "agg-0", lambda s: s.get("memory_refusals"), "the refusal reported")
            assert refused["committed_bytes"] == JOB_BYTES and "alice-2" not in refused["jobs"], refused
            for job in (Job(pool, "bob-1", bob), Job(pool, "member-1")):     # another tenant; the services' key
                jobs.append(job)
                job.step()
            tenants = {j["job"]: j["tenant"] for j in pool.status()["jobs"]}
            assert {k: tenants.get(k, "?") for k in ("alice-1", "bob-1", "member-1")} == \
                {"alice-1": "alice", "bob-1": "bob", "member-1": None}, tenants
            with pytest.raises(AuthRefused, match="cannot change owner"):       # her secret, bob's key
                _agent(pool, "alice-1", bob).close()
            assert pool.status()["security"]["refusals"].get("wrong_tenant") == 1
            for job in jobs:
                job.step()
            stats = _reported(pool, "agg-0", lambda s: s.get("tenant_committed_bytes", {}).get("bob"),
                              "bob's commitment reported")
            assert stats["tenant_committed_bytes"] == {"alice": JOB_BYTES, "bob": JOB_BYTES}, stats
            assert stats["committed_bytes"] == 3 * JOB_BYTES and stats["memory_refusals"] >= 1, stats
            jobs[0].close()                                   # alice's first job ends: room for another
            _reported(pool, "agg-0", lambda s: "alice-1" not in s["jobs"], "alice's first job released")
            third = Job(pool, "alice-3", alice)
            jobs.append(third)
            third.step()
            third.step()
        finally:
            for job in jobs:
                job.close()
        _reported(pool, "agg-0", lambda s: s.get("committed_bytes") == 0 and not s.get("jobs"),
                  "no commitment left once every job ended")
        assert pool.aggregators["agg-0"].poll() is None


def test_keys_moving_to_an_aggregator_they_do_not_fit_stay_where_they_are(capfd):
    limit = 6 * M                                            # a key of 8 MB does not fit there; one of 2 MB does
    with LocalPool(1, master_args=["--static"]) as pool:
        big = Job(pool, "mig-big")                           # both on agg-0, the only aggregator yet
        small = Job(pool, "mig-small", numel=NUMEL // 4)
        try:
            pool.aggregator_args = ["--max-job-bytes", str(limit)]
            pool.add_aggregator("agg-1")
            wait_for(lambda: any(a["id"] == "agg-1" and a["alive"] for a in pool.status()["aggregators"]),
                     timeout=30, what="agg-1 registered")
            for job in (big, small):
                job.step()
            with AdminClient(pool.master, 5) as admin:
                admin.migrate("mig-big", to=["agg-1"])
                admin.migrate("mig-small", to=["agg-1"])
            wait_for(lambda: pool.status()["migrations"]["failed"], timeout=20, what="the big job's move refused")

            def trained_until_moved() -> bool:      # a move advances only as its job trains
                big.step()
                small.step()
                moves = pool.status()["migrations"]
                return not moves["batches_active"] and set(small.agent.placement()) == {"agg-1"}

            wait_for(trained_until_moved, timeout=30, what="the small job moved", step=0.0)
            assert set(big.agent.placement()) == {"agg-0"} and pool.status()["migrations"]["completed"] >= 1
            for _ in range(2):
                big.step()
                small.step()
            target = _reported(pool, "agg-1", lambda s: s.get("committed_bytes"), "agg-1's commitment reported")
            assert target["committed_bytes"] == 2 * 4 * (NUMEL // 4) <= limit, target
            assert target["memory_refusals"] == 1 and target["jobs"] == ["mig-small"], target
            # pMaster was told why (its log), naming the limit and the option
            assert "(--max-job-bytes)" in "".join(
                line for line in capfd.readouterr().err.splitlines(True) if "did not prepare" in line)
        finally:
            big.close()
            small.close()
        for agg in ("agg-0", "agg-1"):
            _reported(pool, agg, lambda s: s.get("committed_bytes") == 0 and not s.get("jobs"),
                      f"no commitment left on {agg} once the jobs ended")
