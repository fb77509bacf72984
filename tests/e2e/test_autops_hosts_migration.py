"""Live migration across emulated hosts (root): the migration property test of
tests/integration/test_migration.py with every aggregator and the job on hosts of their own,
joined by 10 Gbit/s links (``dlrt_bench.testbed``).

pMaster and agg-0 sit on h0, agg-1 on h1, agg-2 on h2; the job's two ranks run on h3 and
reach the aggregators over TCP across the shaped links, and migrating keys travel between
the aggregators' hosts. Random migration schedules must leave the result bit-identical to
the same job trained across the same hosts without migrations, in ``sum`` and ``server``
mode; the byte counters of the links show the traffic crossed the bridge.
"""
from __future__ import annotations

import json
import pathlib
import pickle
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dlrt_bench.autops_hosts import HostPool
from testbed_fixture import emulated_hosts, prefix_for

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "integration"))
from autops_testlib import TENSORS, W, check_same  # noqa: E402
from test_migration import ITERS, schedules  # noqa: E402

JOB = pathlib.Path(__file__).parent / "hosts_migration_job.py"


@pytest.fixture(scope="module")
def hosts():
    with emulated_hosts(4, "10gbit", prefix=prefix_for(__name__)) as tb:
        with HostPool(tb, tb.hosts[:3]) as pool:
            yield tb, pool


def train_on(hosts, tmp_path, mode: str, schedule: dict) -> dict:
    """The job on h3 (both ranks), migrations as ``schedule`` says; its results."""
    tb, pool = hosts
    out = tmp_path / f"{mode}-{len(list(tmp_path.iterdir()))}.pickle"
    done = tb.hosts[3].run([sys.executable, str(JOB), pool.master, mode, json.dumps(schedule), str(out)],
                           capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    with open(out, "rb") as fh:
        return pickle.load(fh)


@pytest.fixture(scope="module")
def references(hosts, tmp_path_factory):
    tb = hosts[0]
    before = tb.counters(tb.hosts[3])
    refs = {mode: train_on(hosts, tmp_path_factory.mktemp(mode), mode, {}) for mode in ("sum", "server")}
    after = tb.counters(tb.hosts[3])
    pushed = 2 * ITERS * W * sum(int(np.prod(s)) * 4 for _, s, _ in TENSORS)   # both modes' pushes
    assert after.sent - before.sent >= 0.9 * pushed, "the job's pushes did not cross h3's link"
    assert after.received - before.received >= 0.9 * pushed, "the job's pulls did not cross h3's link"
    return refs


@pytest.mark.parametrize("mode", ["sum", "server"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
def test_random_migration_schedules_across_hosts_leave_training_bit_identical(hosts, references, tmp_path,
                                                                              mode, schedule):
    got = train_on(hosts, tmp_path, mode, schedule)
    check_same(got, references[mode])


def test_every_key_moves_between_hosts(hosts, references, tmp_path):
    tb, pool = hosts
    before = [tb.counters(h) for h in tb.hosts[:3]]
    got = train_on(hosts, tmp_path, "server", {3: [([], "agg-2")], 9: [([], "agg-1")]})
    check_same(got, references["server"])
    assert set(got["placement"]) == {"agg-1"}
    after = [tb.counters(h) for h in tb.hosts[:3]]
    state = sum(int(np.prod(s)) * 4 for _, s, _ in TENSORS) * 3      # master copy + Adam's two moments
    assert after[2].received - before[2].received >= state, "the keys' state did not reach agg-2's host"
    assert after[1].received - before[1].received >= state, "the keys' state did not reach agg-1's host"
    status = pool.status()
    assert status["migrations"]["failed"] == 0 and status["migrations"]["completed"] > 0
