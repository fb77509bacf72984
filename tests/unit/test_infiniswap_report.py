"""Infiniswap utilization reports without processes: the report built from a
``Daemon.stats()`` dict, null for figures that are not finite numbers, the wire frame round
trip, and the Prometheus samples of the exporter's collector (no HTTP server)."""
from __future__ import annotations

import copy
import json

import pytest

from infiniswap.report import (
    REPORT_VERSION, TOPIC, PrometheusExporter, encode_report, metric_samples, parse_message,
    utilization_report,
)

MiB = 1 << 20

STATS = {
    "time": 1732000000.5, "host": "mem1", "address": "tcp://127.0.0.1:7300",
    "instance": "abc123", "pid": 4242, "host_id": "h-1", "data_address": "127.0.0.1:7301",
    "slab_size": MiB, "headroom": 4 * MiB, "capacity": 32 * MiB, "total_memory": 64 * MiB,
    "used_by_others": 20 * MiB, "free_bytes": 12 * MiB, "giveable_bytes": 9 * MiB,
    "allocated_bytes": 32 * MiB, "locked_bytes": 0, "slabs_free": 5, "slabs_mapped": 27,
    "slabs_quarantined": 0, "devices": {"dev-a": list(range(20)), "dev-b": list(range(7))},
    "maps": 30, "evictions": 3, "evict_rounds": 1, "devices_lost": 0, "requests": 99,
    "bad_messages": 0, "evict_time_s": {}, "served": None, "eviction_in_progress": False,
    "auth_refusals": 2,
}

KEYS = {"type", "version", "time", "daemon", "host", "memory_total_bytes", "memory_free_bytes",
        "headroom_bytes", "slab_bytes", "slabs_lent", "slabs_free", "lendable_bytes",
        "evictions_total", "devices", "auth_refusals_total"}


def test_report_from_stats():
    before = copy.deepcopy(STATS)
    rep = utilization_report(STATS)
    assert STATS == before                                          # pure
    assert set(rep) == KEYS
    assert rep == {
        "type": "infiniswap.utilization", "version": REPORT_VERSION, "time": 1732000000.5,
        "daemon": "tcp://127.0.0.1:7300", "host": "mem1", "memory_total_bytes": 64 * MiB,
        "memory_free_bytes": 12 * MiB, "headroom_bytes": 4 * MiB, "slab_bytes": MiB,
        "slabs_lent": 27, "slabs_free": 5, "lendable_bytes": 9 * MiB, "evictions_total": 3,
        "devices": 2, "auth_refusals_total": 2,
    }
    assert REPORT_VERSION == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None, "12", True])
def test_figures_that_are_not_finite_numbers_are_null(bad):
    stats = dict(STATS, total_memory=bad, free_bytes=bad, time=bad, evictions=bad)
    rep = utilization_report(stats)
    assert rep["memory_total_bytes"] is None and rep["memory_free_bytes"] is None
    assert rep["time"] is None and rep["evictions_total"] is None
    assert rep["slabs_lent"] == 27                                  # the others stay
    json.dumps(rep, allow_nan=False)                                # strict JSON


def test_missing_figures_are_null_and_negative_free_memory_is_zero():
    rep = utilization_report({"address": "tcp://h:1", "free_bytes": -3 * MiB})
    assert set(rep) == KEYS
    assert rep["memory_free_bytes"] == 0
    assert rep["devices"] is None and rep["host"] is None and rep["slabs_lent"] is None


def test_frame_round_trip():
    rep = utilization_report(STATS)
    frame = encode_report(rep)
    assert frame.startswith(TOPIC + b" {") and TOPIC == b"infiniswap.utilization"
    assert parse_message(frame) == rep
    with_extra = frame[:-1] + b',"future_field":1}'                 # consumers ignore extras
    assert parse_message(with_extra)["slabs_free"] == 5


@pytest.mark.parametrize("frame", [
    b"autops.utilization {}", b"infiniswap.utilization", b'infiniswap.utilization [1]',
    b'infiniswap.utilization {"type": "other"}', b"infiniswap.utilizationX {}",
])
def test_parse_rejects_what_is_not_a_report(frame):
    with pytest.raises(ValueError):
        parse_message(frame)


def test_encode_refuses_non_finite_numbers():
    with pytest.raises(ValueError):
        encode_report({"type": "infiniswap.utilization", "time": float("nan")})


def test_metric_samples():
    samples = metric_samples(utilization_report(STATS))
    assert samples == {
        "infiniswap_memory_total_bytes": 64.0 * MiB, "infiniswap_memory_free_bytes": 12.0 * MiB,
        "infiniswap_headroom_bytes": 4.0 * MiB, "infiniswap_slabs_lent": 27.0,
        "infiniswap_slabs_free": 5.0, "infiniswap_lendable_bytes": 9.0 * MiB,
        "infiniswap_evictions_total": 3.0, "infiniswap_devices": 2.0,
        "infiniswap_auth_refusals_total": 2.0,
    }
    assert "infiniswap_memory_total_bytes" not in metric_samples(
        utilization_report(dict(STATS, total_memory=float("nan"))))


def test_exporter_collects_the_latest_report_labelled_by_host():
    from prometheus_client import generate_latest

    exporter = PrometheusExporter(port=None)
    try:
        assert exporter.url is None
        assert b"infiniswap_" not in generate_latest(exporter.registry)  # nothing yet
        exporter.publish(STATS)
        exporter.publish(dict(STATS, slabs_mapped=28, evictions=4))
        get = exporter.registry.get_sample_value
        assert get("infiniswap_slabs_lent", {"host": "mem1"}) == 28.0
        assert get("infiniswap_evictions_total", {"host": "mem1"}) == 4.0
        assert get("infiniswap_memory_free_bytes", {"host": "mem1"}) == 12.0 * MiB
        assert get("infiniswap_devices", {"host": "mem1"}) == 2.0
        text = generate_latest(exporter.registry).decode()
        assert "# TYPE infiniswap_evictions_total counter" in text
        assert "# TYPE infiniswap_lendable_bytes gauge" in text
    finally:
        exporter.close()
