import contextlib
import copy
import io
import json
import threading
import time
import urllib.request

import pytest
import zmq

from autops.master import report
from autops.master.report import (REPORT_VERSION, PrometheusExporter, ReportPublisher, format_status, metric_samples,
                                  parse_message, skew_of, subscribe, utilization_report)

STATUS = {
    "time": 1732000000.0,
    "master": "tcp://127.0.0.1:5555",
    "provider": "local",
    "capacity": 8,
    "aggregators": [
        {"id": "agg-0", "cluster": "c0", "state": "active", "alive": True, "host": "h0", "pid": 11,
         "endpoints": {"tcp": "tcp://127.0.0.1:6000"}, "cpus": 4, "cpu_percent": 37.5, "busy_fraction": 0.42,
         "cycle_s": 0.8, "tasks": 12, "jobs": ["job-a", "job-b"], "assigned_bytes": 3 << 20},
        {"id": "agg-1", "cluster": None, "state": "idle", "alive": True, "host": "h0", "pid": 12,
         "endpoints": {}, "cpus": 4, "cpu_percent": 0.0, "busy_fraction": None, "cycle_s": None, "tasks": 0,
         "jobs": [], "assigned_bytes": 0},
        {"id": "agg-2", "cluster": "c0", "state": "temporary", "alive": True, "host": "h1",
         "pid": 13, "endpoints": {}, "cpus": 2, "cpu_percent": 12.25, "busy_fraction": 0.1, "cycle_s": None,
         "tasks": 3, "jobs": ["job-b"], "assigned_bytes": 1 << 20},
        {"id": "agg-3", "cluster": "c1", "state": "draining", "alive": False, "host": "h1",
         "pid": 14, "endpoints": {}, "cpus": 16, "cpu_percent": None, "busy_fraction": None, "cycle_s": None,
         "tasks": 0, "jobs": [], "assigned_bytes": 0},
    ],
    "clusters": [{"name": "c0", "aggregators": ["agg-0", "agg-2"], "jobs": ["job-a", "job-b"],
                  "free_cpu": 1.3}],
    "jobs": [
        {"job": "job-a", "state": "packed", "world_size": 2, "mode": "sum", "cluster": "c0",
         "requested_aggregators": 2, "aggregators": ["agg-0"], "tensors": 38, "keys": 150,
         "bytes": 574000000, "skew": 0.71, "iterations": 1200, "iteration_time_s": 0.95,
         "standalone_iteration_time_s": 0.9, "speed_vs_standalone": 0.947, "cpu_demand": 0.3,
         "reverts": 0, "keys_per_aggregator": {"agg-0": 150},
         "bytes_per_aggregator": {"agg-0": 574000000}},
        {"job": "job-b", "state": "profiling", "world_size": 4, "mode": "server", "cluster": None,
         "requested_aggregators": 4, "aggregators": ["agg-0", "agg-2"], "tensors": 5, "keys": 9,
         "bytes": 2 << 20, "skew": 0.5, "iterations": 3, "iteration_time_s": None,
         "standalone_iteration_time_s": None, "speed_vs_standalone": None, "cpu_demand": None,
         "reverts": 1, "keys_per_aggregator": {"agg-0": 4, "agg-2": 5},
         "bytes_per_aggregator": {"agg-0": 1 << 20, "agg-2": 1 << 20}},
    ],
    "migrations": {"active": 1, "completed": 37, "failed": 2},
}

EMPTY = {"time": 1.0, "master": "tcp://127.0.0.1:5555", "provider": "standby", "capacity": None,
         "aggregators": [], "clusters": [], "jobs": [],
         "migrations": {"active": 0, "completed": 0, "failed": 0}}


# --- report -----------------------------------------------------------------------
def test_report_fields_and_totals():
    before = copy.deepcopy(STATUS)
    rep = utilization_report(STATUS)
    assert STATUS == before                                   # pure
    assert rep["type"] == "autops.utilization" and rep["version"] == REPORT_VERSION == 1
    assert rep["time"] == 1732000000.0 and rep["master"] == "tcp://127.0.0.1:5555"
    assert [a["id"] for a in rep["aggregators"]] == ["agg-0", "agg-1", "agg-2", "agg-3"]
    assert set(rep["aggregators"][0]) == {"id", "cluster", "state", "alive", "cpus", "cpu_percent",
                                          "busy_fraction", "tasks", "jobs"}
    assert rep["aggregators"][0] == {"id": "agg-0", "cluster": "c0", "state": "active",
                                     "alive": True, "cpus": 4, "cpu_percent": 37.5, "busy_fraction": 0.42,
                                     "tasks": 12, "jobs": ["job-a", "job-b"]}
    assert rep["aggregators"][1]["busy_fraction"] is None and rep["aggregators"][1]["cluster"] is None
    assert rep["aggregators"][3]["cpu_percent"] is None and rep["aggregators"][3]["alive"] is False
    job_a, job_b = rep["jobs"]
    assert set(job_a) == {"job", "iteration_time_s", "standalone_iteration_time_s",
                          "speed_vs_standalone", "tensors", "bytes", "skew", "aggregators",
                          "state", "requested_aggregators"}
    assert job_a["iteration_time_s"] == 0.95 and job_a["speed_vs_standalone"] == 0.947
    assert job_a["bytes"] == 574000000 and job_a["skew"] == 0.71 and job_a["tensors"] == 38
    assert job_b["iteration_time_s"] is None and job_b["speed_vs_standalone"] is None
    assert job_b["aggregators"] == ["agg-0", "agg-2"] and job_b["requested_aggregators"] == 4
    # allocated: alive and not idle -> agg-0, agg-2 (agg-1 idle, agg-3 dead); CPUs: h0's 4
    # (agg-0 and agg-1 share them) + h1's 2 (agg-3's 16 are not there: it is dead)
    assert rep["totals"] == {"aggregators_allocated": 2, "aggregators_requested": 6,
                             "cpu_saving": pytest.approx(1 - 2 / 6), "cpus": 6, "jobs": 2}
    text = json.dumps(rep, allow_nan=False)                   # strict JSON
    assert json.loads(text) == rep


def test_report_empty_pool_and_missing_values():
    rep = utilization_report(EMPTY)
    assert rep["aggregators"] == [] and rep["jobs"] == []
    assert rep["totals"] == {"aggregators_allocated": 0, "aggregators_requested": 0,
                             "cpu_saving": None, "cpus": None, "jobs": 0}
    # a bare dict and non-finite numbers still give strict JSON
    rep = utilization_report({"aggregators": [{"id": "a", "state": "active", "alive": True,
                                               "cpu_percent": float("nan")}]})
    assert rep["time"] is None and rep["aggregators"][0]["cpu_percent"] is None
    assert rep["aggregators"][0]["jobs"] == [] and rep["totals"]["aggregators_allocated"] == 1
    json.dumps(rep, allow_nan=False)


def test_skew_of():
    assert skew_of([]) == 0.0
    assert skew_of([0, 0]) == 0.0
    assert skew_of([100]) == 1.0
    assert skew_of([10, 30, 60]) == pytest.approx(0.6)
    assert skew_of(iter([1, 1, 1, 1])) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        skew_of([1, -1])


# --- text view --------------------------------------------------------------------
def test_format_status_contains_ids_and_figures():
    text = format_status(STATUS)
    for needle in ["tcp://127.0.0.1:5555", "agg-0", "agg-1", "agg-2", "agg-3", "job-a", "job-b",
                   "37.5", "42%", "3.0", "packed", "profiling", "0.950", "0.900", "94.7%",
                   "1/2", "2/4", "0.71", "150 keys", "547.4 MiB", "37 completed", "2 failed",
                   "1 active", "66.7%", "draining", "server"]:
        assert needle in text, needle
    agg1 = next(line for line in text.splitlines() if "agg-1" in line and "idle" in line)
    assert " - " in agg1 or agg1.rstrip().endswith("-")      # None busy / no jobs shows as "-"
    assert max(len(line) for line in text.splitlines()) <= 100
    # the pool's real CPUs: each host counted once, dead aggregators not at all
    assert "Aggregators: 4 (2 allocated), 6 CPUs on 2 hosts" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.strip().startswith("ID"))
    agg0 = next(line for line in lines if line.strip().startswith("agg-0"))
    assert header.split()[4:6] == ["CPUS", "CPU%"] and agg0.split()[4:6] == ["4", "37.5"]


def test_pool_cpus_counts_each_host_once_and_only_reported_figures():
    assert report.pool_cpus([]) == (None, 0)
    aggs = [{"id": "a", "host": "h", "alive": True, "cpus": 8}, {"id": "b", "host": "h", "alive": True, "cpus": 8},
            {"id": "c", "host": "g", "alive": True, "cpus": 3}, {"id": "d", "host": "f", "alive": False, "cpus": 64},
            {"id": "e", "host": "e", "alive": True}]                      # no figure (yet): not counted
    assert report.pool_cpus(aggs) == (11, 2)
    # an older aggregator without the figure shows "-", and the heading no total
    text = format_status({**EMPTY, "aggregators": [{"id": "old", "state": "idle", "alive": True}]})
    assert "Aggregators: 1 (0 allocated)\n" in text


def test_status_help_explains_every_column():
    from autops.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(["status", "--help"])
    assert done.value.code == 0
    text = out.getvalue()
    for column in ["ID", "CLUSTER", "STATE", "ALIVE", "CPUS", "CPU%", "BUSY", "TASKS", "MiB", "JOBS"]:
        assert f"\n  {column} " in text, column
    assert "100 = one\n           whole core" in text and "each host once" in text


def test_format_status_empty_and_long_job_lists():
    text = format_status(EMPTY)
    assert "no aggregators" in text and "no jobs" in text and "unbounded" in text
    status = copy.deepcopy(STATUS)
    status["aggregators"][0]["jobs"] = [f"a-rather-long-job-name-{i}" for i in range(30)]
    text = format_status(status)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "+" in next(line for line in text.splitlines() if line.strip().startswith("agg-0"))


# --- ZeroMQ -----------------------------------------------------------------------
def test_pub_sub_round_trip():
    ctx = zmq.Context()
    pub = ReportPublisher("tcp://127.0.0.1:0", context=ctx)
    try:
        assert pub.address.startswith("tcp://127.0.0.1:") and not pub.address.endswith(":0")
        got: dict = {}

        def receive():
            try:
                got["report"] = subscribe(pub.address, timeout=3.0, context=ctx)
            except Exception as exc:                           # surfaced below
                got["error"] = exc

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        deadline = time.monotonic() + 3.0
        sent = None
        while t.is_alive() and time.monotonic() < deadline:   # slow joiner: keep publishing
            sent = pub.publish(STATUS)
            time.sleep(0.01)
        t.join(timeout=1.0)
        assert "error" not in got, got.get("error")
        assert got["report"] == sent == utilization_report(STATUS)
    finally:
        pub.close()
        ctx.term()


def test_wire_frame_is_topic_space_json_and_filterable():
    ctx = zmq.Context()
    pub = ReportPublisher("tcp://127.0.0.1:*", context=ctx)
    sub = ctx.socket(zmq.SUB)
    other = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"autops.utilization")
        other.setsockopt(zmq.SUBSCRIBE, b"something.else")
        sub.connect(pub.address)
        other.connect(pub.address)
        deadline = time.monotonic() + 3.0
        frame = None
        while frame is None and time.monotonic() < deadline:
            pub.publish(EMPTY)
            if sub.poll(20):
                frame = sub.recv()
        assert frame is not None
        assert frame.startswith(b"autops.utilization {")
        assert json.loads(frame.split(b" ", 1)[1]) == utilization_report(EMPTY)
        assert parse_message(frame) == utilization_report(EMPTY)
        assert not other.poll(50)                               # filtered out by topic
        with pytest.raises(ValueError):
            parse_message(b"other.topic {}")
    finally:
        sub.close(linger=0)
        other.close(linger=0)
        pub.close()
        ctx.term()


def test_subscribe_times_out():
    ctx = zmq.Context()
    pub = ReportPublisher("tcp://127.0.0.1:0", context=ctx)
    try:
        with pytest.raises(TimeoutError):
            subscribe(pub.address, timeout=0.1, context=ctx)
    finally:
        pub.close()
        ctx.term()


# --- Prometheus -------------------------------------------------------------------
def test_metric_samples_skip_none():
    samples = metric_samples(STATUS)
    assert (("job-b",), 0.5) in samples["autops_job_skew"]
    assert all(labels != ("job-b",) for labels, _ in samples["autops_job_iteration_seconds"])
    assert all(labels[0] != "agg-3" for labels, _ in samples["autops_aggregator_cpu_percent"])
    assert dict(samples["autops_aggregators"]) == {("active",): 1, ("idle",): 1,
                                                   ("temporary",): 1, ("draining",): 1}


@pytest.fixture
def exporter():
    exp = PrometheusExporter()
    try:
        yield exp
    finally:
        exp.stop()


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as resp:
        body = resp.read().decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_prometheus_exporter_serves_metrics(exporter):
    exporter.update(STATUS)
    port = exporter.start(0)
    assert port == exporter.port and port > 0
    m = _scrape(port)
    assert m['autops_aggregators{state="active"}'] == 1
    assert m['autops_aggregators{state="idle"}'] == 1
    assert m['autops_aggregator_cpu_percent{aggregator="agg-0",cluster="c0"}'] == 37.5
    assert m['autops_aggregator_cpu_percent{aggregator="agg-1",cluster=""}'] == 0.0
    assert m['autops_aggregator_busy_fraction{aggregator="agg-0"}'] == 0.42
    assert 'autops_aggregator_busy_fraction{aggregator="agg-1"}' not in m      # None skipped
    assert m['autops_aggregator_tasks{aggregator="agg-0"}'] == 12
    assert m['autops_job_iteration_seconds{job="job-a"}'] == 0.95
    assert 'autops_job_iteration_seconds{job="job-b"}' not in m
    assert m['autops_job_standalone_iteration_seconds{job="job-a"}'] == 0.9
    assert m['autops_job_speed_vs_standalone{job="job-a"}'] == 0.947
    assert m['autops_job_tensors{job="job-a"}'] == 38
    assert m['autops_job_bytes{job="job-a"}'] == 574000000
    assert m['autops_job_skew{job="job-a"}'] == 0.71
    assert m['autops_job_aggregators{job="job-b"}'] == 2
    assert m["autops_aggregators_requested"] == 6
    assert m["autops_aggregators_allocated"] == 2
    assert m["autops_migrations_completed_total"] == 37
    assert m["autops_migrations_active"] == 1

    # update replaces the figures; later edits to the dict do not leak into a scrape
    status = copy.deepcopy(STATUS)
    status["migrations"]["completed"] = 40
    exporter.update(status)
    status["migrations"]["completed"] = 999
    assert _scrape(port)["autops_migrations_completed_total"] == 40

    exporter.stop()
    assert exporter._server is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)


def test_prometheus_exporter_before_update_and_own_registry(exporter):
    from prometheus_client import REGISTRY

    port = exporter.start(0, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as resp:
        body = resp.read().decode()
    assert "autops_" not in body                                 # nothing until update()
    assert REGISTRY.get_sample_value("autops_aggregators_allocated") is None
    with pytest.raises(RuntimeError):
        exporter.start(0)
    assert report.PrometheusExporter().registry is not exporter.registry
