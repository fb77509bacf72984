"""The records of the aggregators a local provider starts (``autops.master.poolfiles``) and what a
restarted pMaster's provider does with them (``LocalProvider``): with stand-in processes (a
sleeping Python whose command line names "aggregator"), no pMaster. A record names a process
only while that very process runs; the provider adopts its predecessor's aggregators, keeps
their names unique, counts, stops and forgets them."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from autops.master import poolfiles
from autops.master.providers import LocalProvider

MASTER = "tcp://127.0.0.1:5999"


@pytest.fixture
def spawn():
    """Start stand-in aggregators (killed and reaped afterwards)."""
    procs = []

    def start(*words: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *words])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_record_names_its_process_only_while_that_process_runs(tmp_path, spawn):
    agg = spawn("aggregator")
    other = spawn("not-one")
    rec = poolfiles.record(tmp_path, "local-0", agg.pid, MASTER)
    poolfiles.record(tmp_path, "local-1", other.pid, MASTER)        # not an aggregator's command line
    path = tmp_path / poolfiles.DIRNAME / "local-0.json"
    assert json.loads(path.read_text()) == {"name": "local-0", "pid": agg.pid, "started": rec.started,
                                            "master": MASTER}
    assert path.stat().st_mode & 0o077 == 0
    found = poolfiles.running(tmp_path)
    assert list(found) == ["local-0"] and found["local-0"][1].pid == agg.pid
    assert not (tmp_path / poolfiles.DIRNAME / "local-1.json").exists()     # removed as it was read
    # the same pid with another start time is another process (pids are reused)
    poolfiles.record(tmp_path, "local-2", agg.pid, MASTER)
    stale = json.loads((tmp_path / poolfiles.DIRNAME / "local-2.json").read_text())
    (tmp_path / poolfiles.DIRNAME / "local-2.json").write_text(json.dumps({**stale, "started": 1.0}))
    (tmp_path / poolfiles.DIRNAME / "junk.json").write_text("{")
    assert list(poolfiles.running(tmp_path)) == ["local-0"]
    agg.kill()
    agg.wait()
    assert poolfiles.running(tmp_path) == {} and not list((tmp_path / poolfiles.DIRNAME).glob("*.json"))


def test_stop_recorded_stops_every_recorded_aggregator_and_nothing_else(tmp_path, spawn):
    aggs = [spawn("aggregator") for _ in range(2)]
    bystander = spawn("aggregator")                                   # not recorded: not touched
    for i, agg in enumerate(aggs):
        poolfiles.record(tmp_path, f"local-{i}", agg.pid, MASTER)
    assert sorted(poolfiles.stop_recorded(tmp_path, timeout=5)) == sorted(a.pid for a in aggs)
    assert not any(psutil.pid_exists(a.pid) for a in aggs)          # stopped (and, our children, reaped)
    assert bystander.poll() is None and poolfiles.running(tmp_path) == {}
    assert poolfiles.stop_recorded(tmp_path / "none") == []


def test_a_restarted_pmasters_provider_adopts_counts_stops_and_forgets_its_predecessors(tmp_path, spawn):
    mine, elsewhere = spawn("aggregator"), spawn("aggregator")
    poolfiles.record(tmp_path, "local-3", mine.pid, MASTER)
    poolfiles.record(tmp_path, "local-5", elsewhere.pid, "tcp://127.0.0.1:6000")   # another pMaster's
    provider = LocalProvider(MASTER, max_aggregators=2, state_dir=tmp_path)
    try:
        assert provider.owns("local-3") and not provider.owns("local-5")
        assert provider.can_start(0) == 1 and provider.capacity(registered=2) == 2 + 1
        assert next(provider._ids) == 6                              # new names never collide
        assert provider.stop("local-3") and not provider.owns("local-3")
        assert mine.wait(5) == -15                                   # SIGTERM
        provider.reap()
        assert provider.can_start(0) == 2 and list(poolfiles.running(tmp_path)) == ["local-5"]
    finally:
        provider.close()
    assert elsewhere.poll() is None                                  # not its own: left alone


def test_an_adopted_aggregator_that_exits_is_forgotten_and_close_stops_the_rest(tmp_path, spawn):
    gone, kept = spawn("aggregator"), spawn("aggregator")
    poolfiles.record(tmp_path, "local-0", gone.pid, MASTER)
    poolfiles.record(tmp_path, "local-1", kept.pid, MASTER)
    provider = LocalProvider(MASTER, max_aggregators=4, state_dir=tmp_path)
    gone.kill()
    gone.wait()
    provider.reap()
    assert not provider.owns("local-0") and provider.owns("local-1") and provider.can_start(0) == 3
    provider.close()
    assert not psutil.pid_exists(kept.pid) and poolfiles.running(tmp_path) == {}
