"""Utilization reports of an Infiniswap daemon: the format, its ZeroMQ publisher and the
Prometheus exporter.

This module owns the report a cluster manager (the Tiresias master) consumes -- how much
memory a daemon's machine has, how much of it the daemon lends and could still lend -- and
the Prometheus metric names.  It works on plain data: the dict ``Daemon.stats()`` returns;
the daemon calls ``publish(stats)`` on each of its reporters every report interval.

Utilization report (version 1)
------------------------------
Published on a ZeroMQ PUB socket as ONE frame: the topic ``infiniswap.utilization``, one
space, then the UTF-8 JSON of the report::

    infiniswap.utilization {"type": "infiniswap.utilization", "version": 1, ...}

Subscribers filter with ``setsockopt(zmq.SUBSCRIBE, b"infiniswap.utilization")`` and parse
everything after the first space as JSON (``parse_message`` does both).  The JSON object::

    {
      "type": "infiniswap.utilization",    # constant
      "version": 1,                        # REPORT_VERSION; bumped on incompatible change
      "time": 1732000000.0,                # wall clock of the figures (seconds since epoch)
      "daemon": "tcp://127.0.0.1:7300",    # the daemon's control endpoint
      "host": "mem1",                      # host name (--report-host; default the machine's)
      "memory_total_bytes": 68719476736,   # the machine's memory
      "memory_free_bytes": 8589934592,     # free now as the daemon's monitor measures it
                                           # (total - EWMA of others' use - slabs it holds)
      "headroom_bytes": 8589934592,        # free memory the daemon keeps for local programs
      "slab_bytes": 1073741824,            # slab size
      "slabs_lent": 12,                    # slabs mapped by devices
      "slabs_free": 3,                     # preallocated slabs not lent
      "lendable_bytes": 5368709120,        # could lend now: free slabs + what it could
                                           # allocate above HeadRoom (0 below HeadRoom)
      "evictions_total": 7,                # slabs evicted so far
      "devices": 2,                        # devices holding slabs of this daemon
      "auth_refusals_total": 0             # peers refused for not proving the cluster key
                                           # (data server, control channel, CURVE)
    }

Figures the daemon does not know are ``null``; so are non-finite numbers, so the JSON stays
strict.  Consumers must ignore unknown fields.

Prometheus metrics (``PrometheusExporter``; gauges unless noted, all labelled ``host``)
-------------------------------------------------------------------------------------------
``infiniswap_memory_total_bytes``, ``infiniswap_memory_free_bytes``,
``infiniswap_headroom_bytes``, ``infiniswap_slabs_lent``, ``infiniswap_slabs_free``,
``infiniswap_lendable_bytes``, ``infiniswap_evictions_total`` (counter),
``infiniswap_devices``, ``infiniswap_auth_refusals_total`` (counter).  A figure that is
``null`` in the report is left out.

The PUB socket runs CURVE on tcp when the key directory says so (``dlrt.curve``), and warns
when it binds beyond loopback without it.
"""
from __future__ import annotations

import json
import math
import threading
from typing import Any, Iterator, Mapping

import zmq

from dlrt.curve import Security, default_security, warn_if_exposed
from dlrt.endpoints import endpoint

from infiniswap.channel import context

__all__ = ["REPORT_VERSION", "REPORT_TYPE", "TOPIC", "utilization_report", "encode_report",
           "parse_message", "metric_samples", "ReportPublisher", "PrometheusExporter"]

REPORT_VERSION = 1
REPORT_TYPE = "infiniswap.utilization"
TOPIC = REPORT_TYPE.encode()

# report field <- key of Daemon.stats()
_FROM_STATS = (
    ("memory_total_bytes", "total_memory"),
    ("memory_free_bytes", "free_bytes"),
    ("headroom_bytes", "headroom"),
    ("slab_bytes", "slab_size"),
    ("slabs_lent", "slabs_mapped"),
    ("slabs_free", "slabs_free"),
    ("lendable_bytes", "giveable_bytes"),
    ("evictions_total", "evictions"),
    ("auth_refusals_total", "auth_refusals"),
)

# metric name, report field, counter?, help
_METRICS = (
    ("infiniswap_memory_total_bytes", "memory_total_bytes", False, "The machine's memory."),
    ("infiniswap_memory_free_bytes", "memory_free_bytes", False,
     "Free memory as the daemon's monitor measures it."),
    ("infiniswap_headroom_bytes", "headroom_bytes", False,
     "Free memory the daemon keeps for local applications."),
    ("infiniswap_slabs_lent", "slabs_lent", False, "Slabs mapped by devices."),
    ("infiniswap_slabs_free", "slabs_free", False, "Preallocated slabs not lent."),
    ("infiniswap_lendable_bytes", "lendable_bytes", False,
     "Bytes the daemon could lend now (free slabs + what it could allocate above HeadRoom)."),
    ("infiniswap_evictions_total", "evictions_total", True, "Slabs evicted so far."),
    ("infiniswap_devices", "devices", False, "Devices holding slabs of this daemon."),
    ("infiniswap_auth_refusals_total", "auth_refusals_total", True,
     "Peers refused for not proving the cluster key (data server, control channel, CURVE)."),
)


# ---- the report (pure) ----

def _finite(value: Any) -> int | float | None:
    """``value`` if it is a finite number (bools are not numbers here), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _count(items: Any) -> int | None:
    return len(items) if isinstance(items, (dict, list, tuple)) else None


def utilization_report(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The version-1 report (see the module docstring) of a ``Daemon.stats()`` dict.  Pure;
    the result is strict JSON (non-finite numbers become None)."""
    report: dict[str, Any] = {
        "type": REPORT_TYPE, "version": REPORT_VERSION, "time": _finite(stats.get("time")),
        "daemon": stats.get("address"), "host": stats.get("host"),
    }
    for field, key in _FROM_STATS:
        report[field] = _finite(stats.get(key))
    free = report["memory_free_bytes"]
    if free is not None:                    # the monitor's estimate can dip below zero
        report["memory_free_bytes"] = max(free, 0)
    report["devices"] = _count(stats.get("devices"))
    return report


def encode_report(report: Mapping[str, Any]) -> bytes:
    """The wire frame: topic, one space, strict UTF-8 JSON."""
    body = json.dumps(report, allow_nan=False, separators=(",", ":"))
    return b"%s %s" % (TOPIC, body.encode("utf-8"))


def parse_message(frame: bytes) -> dict[str, Any]:
    """The report in a frame from ``encode_report``; ValueError naming what is wrong otherwise."""
    data = bytes(frame)
    topic, space, body = data.partition(b" ")
    if topic != TOPIC or not space:
        raise ValueError(f"not an {REPORT_TYPE} message: {data[:40]!r}")
    report = json.loads(body.decode("utf-8"))
    if not isinstance(report, dict) or report.get("type") != REPORT_TYPE:
        raise ValueError(f"the body of an {REPORT_TYPE} message is not a report")
    return report


def metric_samples(report: Mapping[str, Any]) -> dict[str, float]:
    """Prometheus metric name -> value of a report; figures that are None are left out."""
    figures = {name: _finite(report.get(field)) for name, field, _, _ in _METRICS}
    return {name: float(v) for name, v in figures.items() if v is not None}


# ---- ZeroMQ ----

class ReportPublisher:
    """A bound PUB socket; ``publish(stats)`` sends one report frame per call.

    ``address``: ``tcp://HOST:PORT``, ``HOST:PORT`` or ``ipc://PATH`` (port 0: any free port;
    ``.address`` is the endpoint bound).  A malformed address is a ``ValueError``, a bind
    failure an ``OSError``, both naming the address.  ``publish`` may be called from any thread and never blocks: PUB drops frames
    a slow subscriber has not taken, and a subscriber that connects late (slow joiner) gets
    the next report, so publish periodically.
    """

    def __init__(self, address: str, security: Security | None = None) -> None:
        where = endpoint(address, bind=True)    # ValueError names a malformed address
        security = security or default_security()
        sock = context().socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)          # old reports are worthless: keep few queued
        try:
            security.server(sock, where)
            warn_if_exposed("the Infiniswap utilization reports", where, security)
            sock.bind(where)
            self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise OSError(exc.errno, f"cannot bind the utilization reports to {address}: "
                                     f"{exc.strerror}") from None
        self._sock: zmq.Socket | None = sock
        self._guard = threading.Lock()
        self.published = 0

    def publish(self, stats: Mapping[str, Any]) -> dict[str, Any]:
        """Send ``utilization_report(stats)``; return the report.  RuntimeError once closed."""
        report = utilization_report(stats)
        frame = encode_report(report)
        with self._guard:
            if self._sock is None:
                raise RuntimeError("the report publisher is closed")
            try:
                self._sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:                   # no room for it: a subscriber is behind
                return report
            self.published += 1
        return report

    def close(self) -> None:
        """Close the socket.  Idempotent."""
        with self._guard:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(0)


# ---- Prometheus ----

class _LatestReport:
    """A prometheus_client custom collector over the exporter's latest report."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._report: Mapping[str, Any] | None = None

    def set(self, report: Mapping[str, Any]) -> None:
        with self._mu:
            self._report = report

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._mu:
            report = self._report
        if report is None:                      # nothing measured yet: no samples
            return
        host = str(report.get("host") or "")
        values = metric_samples(report)
        for name, _, counter, doc in _METRICS:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                name, doc, labels=["host"])
            if name in values:
                family.add_metric([host], values[name])
            yield family


class PrometheusExporter:
    """The figures of the latest ``publish(stats)`` as Prometheus metrics.

    Serves ``http://host:port/metrics`` from a thread (``port`` 0: any free port; ``.port``
    is the one bound; ``host`` default 127.0.0.1) or, with ``port=None``, nothing: read
    ``.registry`` directly.  Its own registry, so several exporters fit in one process.
    A bind failure is an ``OSError``.  ``close()`` stops serving and frees the port.
    """

    def __init__(self, port: int | None = 0, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._latest = _LatestReport()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._latest)
        self.host = host
        self.port: int | None = None
        self._http: tuple[Any, threading.Thread] | None = None
        if port is not None:
            try:
                served = start_http_server(port, host, registry=self.registry)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: "
                                         f"{exc.strerror or exc}") from None
            if not isinstance(served, tuple):   # prometheus_client < 0.20 returns None
                raise RuntimeError("serving metrics needs prometheus_client >= 0.20")
            self._http = served
            self.port = int(served[0].server_address[1])

    @property
    def url(self) -> str | None:
        return None if self.port is None else f"http://{self.host}:{self.port}/metrics"

    def publish(self, stats: Mapping[str, Any]) -> dict[str, Any]:
        """Export ``utilization_report(stats)`` from now on; return the report."""
        report = utilization_report(stats)
        self._latest.set(report)
        return report

    def close(self) -> None:
        """Stop serving and release the port.  Idempotent."""
        http, self._http = self._http, None
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join(5.0)
