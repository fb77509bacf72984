"""Utilization reporting for pMaster: the report format, its ZeroMQ publisher, the
Prometheus exporter and the ``autops status`` text view.

Everything here works on plain data: the dict that ``Master.status()`` returns. This
module owns the *utilization report* format a cluster manager consumes, the way it is
put on the wire, the Prometheus metric names and the human status text. It never
reaches into the master's objects.

Utilization report (version 1)
------------------------------
Published on a ZeroMQ PUB socket as ONE frame: the topic ``autops.utilization``, one
space, then the UTF-8 JSON of the report::

    autops.utilization {"type": "autops.utilization", "version": 1, ...}

Subscribers filter with ``setsockopt(zmq.SUBSCRIBE, b"autops.utilization")`` and
parse everything after the first space as JSON (``parse_message`` does both). The
JSON object::

    {
      "type": "autops.utilization",      # constant
      "version": 1,                      # REPORT_VERSION; bumped on incompatible change
      "time": 1732000000.0,              # wall clock of the status (seconds since epoch)
      "master": "tcp://127.0.0.1:5555",  # the master's endpoint
      "aggregators": [{
        "id": "agg-0",
        "cluster": "c0" | null,
        "state": "active" | "idle" | "temporary" | "draining",
        "alive": true,
        "cpus": 8 | null,                # CPUs its process can use (affinity, cgroup quota)
        "cpu_percent": 37.5,             # measured process CPU %, 100 = one core
        "busy_fraction": 0.42 | null,    # estimated share of its execution cycle in use
        "tasks": 12,                     # keys it serves
        "jobs": ["job-a", "job-b"]
      }],
      "jobs": [{
        "job": "job-a",
        "state": "profiling" | "packed" | "dedicated",
        "iteration_time_s": 0.95 | null,             # recent measured iteration time d_j
        "standalone_iteration_time_s": 0.9 | null,   # profiled standalone time D_j
        "speed_vs_standalone": 0.947 | null,         # D_j / d_j (1.0 = no slowdown)
        "tensors": 38,
        "bytes": 574000000,                          # model bytes
        "skew": 0.71,                                # largest tensor bytes / model bytes
        "aggregators": ["agg-0"],                    # aggregators serving its keys
        "requested_aggregators": 2                   # what the job asked for
      }],
      "totals": {
        "aggregators_allocated": 1,      # alive aggregators whose state is not "idle"
        "aggregators_requested": 2,      # sum of the jobs' requested_aggregators
        "cpu_saving": 0.5 | null,        # 1 - allocated / requested; null if nothing requested
        "cpus": 8 | null,                # the pool's CPUs: per host of alive aggregators, the
                                         # most any of them can use, summed over the hosts
        "jobs": 1                        # number of jobs
      }
    }

Missing optional figures are ``null``; non-finite numbers are reported as ``null`` so
the JSON stays strict. Consumers must ignore unknown fields.

Prometheus metrics (``PrometheusExporter``; gauges unless noted)
----------------------------------------------------------------
``autops_aggregators{state}``, ``autops_aggregator_cpu_percent{aggregator,cluster}``,
``autops_aggregator_busy_fraction{aggregator}``, ``autops_aggregator_tasks{aggregator}``,
``autops_job_iteration_seconds{job}``, ``autops_job_standalone_iteration_seconds{job}``,
``autops_job_speed_vs_standalone{job}``, ``autops_job_tensors{job}``,
``autops_job_bytes{job}``, ``autops_job_skew{job}``, ``autops_job_aggregators{job}``,
``autops_aggregators_requested``, ``autops_aggregators_allocated``,
``autops_migrations_completed_total`` (counter), ``autops_migrations_active``,
``autops_auth_refusals_total{reason}`` (counter: requests and connections refused for a
wrong or missing job secret, cluster key, operator token, seal or CURVE key; from
``status["security"]["refusals"]``).
Samples whose value is unknown (None) are left out.
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import zmq

from dlrt.curve import Security, default_security, warn_if_exposed

REPORT_VERSION = 1
REPORT_TYPE = "autops.utilization"
TOPIC = b"autops.utilization"

AGGREGATOR_STATES = ("active", "idle", "temporary", "draining")

_MIB = float(1 << 20)


# --- report -----------------------------------------------------------------------
def _num(value: Any) -> float | int | None:
    """A JSON-safe number: None for None, non-numbers and non-finite floats."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _int(value: Any, default: int = 0) -> int:
    v = _num(value)
    return default if v is None else int(v)


def _strs(values: Iterable[Any] | None) -> list[str]:
    return [str(v) for v in (values or ())]


def _allocated(aggregators: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for a in aggregators if a.get("alive") and a.get("state") != "idle")


def _requested(jobs: Sequence[Mapping[str, Any]]) -> int:
    return sum(_int(j.get("requested_aggregators")) for j in jobs)


def pool_cpus(aggregators: Sequence[Mapping[str, Any]]) -> tuple[int | None, int]:
    """The pool's CPUs and hosts: per host of the alive aggregators, the most CPUs any of
    them can use (aggregators of one host share its CPUs), summed over the hosts; None when
    no alive aggregator reported its CPUs."""
    per_host: dict[str, int] = {}
    for a in aggregators:
        cpus = _num(a.get("cpus"))
        if a.get("alive") and cpus is not None and cpus > 0:
            host = str(a.get("host") or a.get("id"))
            per_host[host] = max(per_host.get(host, 0), int(cpus))
    return (sum(per_host.values()) if per_host else None), len(per_host)


STATUS_LEGEND = """\
columns of the aggregators table:
  ID       the aggregator's name
  CLUSTER  the cluster it is packed in (-: none)
  STATE    idle | temporary (profiling a new job) | active | draining | lost
  ALIVE    whether its heartbeats arrive within pMaster's --heartbeat-timeout
  CPUS     CPUs its process can use: the host's, less what its CPU affinity or
           cgroup quota withholds. Aggregators of one host share them, so the
           total in the heading ("N CPUs on H hosts") counts each host once
  CPU%     CPU its process used over its last heartbeat interval; 100 = one
           whole core, so at most 100 x CPUS
  BUSY     estimated share of its execution cycle its packed jobs take
  TASKS    keys it serves
  MiB      bytes of those keys
  JOBS     the jobs they belong to
"capacity" in the first line is how many aggregators the pool can hold (the
local provider's --max-aggregators plus those registered on their own).
columns of the jobs table: W workers; MODE sum or server; ITER s and ALONE s
the iteration time now and profiled alone; SPEED their ratio; AGGS aggregators
used / asked for; SKEW the largest tensor's share of the model's bytes."""


def cpu_saving(allocated: int, requested: int) -> float | None:
    """``1 - allocated / requested``; None when nothing was requested."""
    if requested <= 0:
        return None
    return 1.0 - allocated / requested


def utilization_report(status: Mapping[str, Any]) -> dict:
    """Build the version-1 utilization report (see the module docstring) from a
    ``Master.status()`` dict. Pure; the result is JSON-serialisable with strict JSON."""
    aggs = list(status.get("aggregators") or ())
    jobs = list(status.get("jobs") or ())
    allocated = _allocated(aggs)
    requested = _requested(jobs)
    return {
        "type": REPORT_TYPE,
        "version": REPORT_VERSION,
        "time": _num(status.get("time")),
        "master": status.get("master"),
        "aggregators": [{
            "id": str(a.get("id")),
            "cluster": a.get("cluster"),
            "state": a.get("state"),
            "alive": bool(a.get("alive")),
            "cpus": _num(a.get("cpus")),
            "cpu_percent": _num(a.get("cpu_percent")),
            "busy_fraction": _num(a.get("busy_fraction")),
            "tasks": _int(a.get("tasks")),
            "jobs": _strs(a.get("jobs")),
        } for a in aggs],
        "jobs": [{
            "job": str(j.get("job")),
            "state": j.get("state"),
            "iteration_time_s": _num(j.get("iteration_time_s")),
            "standalone_iteration_time_s": _num(j.get("standalone_iteration_time_s")),
            "speed_vs_standalone": _num(j.get("speed_vs_standalone")),
            "tensors": _int(j.get("tensors")),
            "bytes": _int(j.get("bytes")),
            "skew": _num(j.get("skew")),
            "aggregators": _strs(j.get("aggregators")),
            "requested_aggregators": _int(j.get("requested_aggregators")),
        } for j in jobs],
        "totals": {
            "aggregators_allocated": allocated,
            "aggregators_requested": requested,
            "cpu_saving": cpu_saving(allocated, requested),
            "cpus": pool_cpus(aggs)[0],
            "jobs": len(jobs),
        },
    }


def encode_report(report: Mapping[str, Any]) -> bytes:
    """The wire frame: topic, one space, strict UTF-8 JSON."""
    return TOPIC + b" " + json.dumps(report, allow_nan=False, separators=(",", ":")).encode()


def parse_message(frame: bytes) -> dict:
    """Inverse of ``encode_report``; ValueError on a frame that is not a report."""
    topic, sep, body = bytes(frame).partition(b" ")
    if topic != TOPIC or not sep:
        raise ValueError(f"not an {REPORT_TYPE} message: {bytes(frame)[:40]!r}")
    report = json.loads(body)
    if not isinstance(report, dict) or report.get("type") != REPORT_TYPE:
        raise ValueError("message body is not a utilization report")
    return report


def skew_of(tensor_bytes: Iterable[int]) -> float:
    """Largest tensor's share of the model's bytes (thesis Table 3.3); 0.0 when empty
    or all tensors are empty. ValueError on a negative size."""
    sizes = list(tensor_bytes)
    if any(s < 0 for s in sizes):
        raise ValueError("tensor sizes must be non-negative")
    total = sum(sizes)
    if total <= 0:
        return 0.0
    return max(sizes) / total


# --- ZeroMQ -----------------------------------------------------------------------
class ReportPublisher:
    """Binds a PUB socket and publishes one report frame per ``publish`` call.

    ``address`` may use port 0 or ``*`` (``tcp://127.0.0.1:0``); ``.address`` is the
    endpoint actually bound (ZMQ_LAST_ENDPOINT). Safe to call from several threads
    (a lock serialises the socket). PUB drops messages for subscribers that have not
    connected yet (slow joiner), so publish periodically.
    """

    def __init__(self, address: str = "tcp://127.0.0.1:5557",
                 context: zmq.Context | None = None, security: Security | None = None) -> None:
        security = security if security is not None else default_security()
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            security.server(self._sock, address)
            self._sock.bind(address)
        except Exception:
            self._sock.close()
            raise
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        warn_if_exposed("pMaster's utilization reports", self.address, security)
        self.published = 0

    def publish(self, status: Mapping[str, Any]) -> dict:
        """Send ``utilization_report(status)``; return the report sent."""
        report = utilization_report(status)
        frame = encode_report(report)
        with self._lock:
            if self._sock is None:
                raise RuntimeError("publisher is closed")
            self._sock.send(frame)
            self.published += 1
        return report

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None

    def __enter__(self) -> "ReportPublisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ReportSubscriber:
    """SUB socket connected to a ``ReportPublisher``, subscribed to the report topic."""

    def __init__(self, address: str, context: zmq.Context | None = None, security: Security | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        (security if security is not None else default_security()).client(self._sock, address)
        self._sock.connect(address)

    def recv(self, timeout: float | None = None) -> dict | None:
        """Next report, or None when ``timeout`` seconds pass without one
        (``timeout=None`` waits forever). Malformed frames are skipped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                return None
            try:
                return parse_message(self._sock.recv())
            except ValueError:
                if deadline is not None and time.monotonic() >= deadline:
                    return None

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "ReportSubscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def subscribe(address: str, timeout: float = 5.0, context: zmq.Context | None = None) -> dict:
    """Connect to ``address``, receive one utilization report and return it.
    TimeoutError if none arrives within ``timeout`` seconds."""
    with ReportSubscriber(address, context) as sub:
        report = sub.recv(timeout)
    if report is None:
        raise TimeoutError(f"no utilization report from {address} within {timeout:g}s")
    return report


# --- Prometheus -------------------------------------------------------------------
# (name, kind, help, label names)
_METRICS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("autops_aggregators", "gauge", "Aggregators in the pool by state.", ("state",)),
    ("autops_aggregator_cpu_percent", "gauge",
     "Measured aggregator process CPU percent (100 = one core).", ("aggregator", "cluster")),
    ("autops_aggregator_busy_fraction", "gauge",
     "Estimated share of the aggregator's execution cycle in use.", ("aggregator",)),
    ("autops_aggregator_tasks", "gauge", "Keys served by the aggregator.", ("aggregator",)),
    ("autops_job_iteration_seconds", "gauge", "Recent measured iteration time.", ("job",)),
    ("autops_job_standalone_iteration_seconds", "gauge",
     "Profiled standalone iteration time.", ("job",)),
    ("autops_job_speed_vs_standalone", "gauge",
     "Standalone iteration time / measured iteration time.", ("job",)),
    ("autops_job_tensors", "gauge", "Tensors declared by the job.", ("job",)),
    ("autops_job_bytes", "gauge", "Model bytes of the job.", ("job",)),
    ("autops_job_skew", "gauge", "Largest tensor bytes / model bytes.", ("job",)),
    ("autops_job_aggregators", "gauge", "Aggregators serving the job's keys.", ("job",)),
    ("autops_aggregators_requested", "gauge", "Sum of the jobs' requested aggregators.", ()),
    ("autops_aggregators_allocated", "gauge", "Alive aggregators that are not idle.", ()),
    ("autops_migrations_completed_total", "counter", "Completed key migrations.", ()),
    ("autops_migrations_active", "gauge", "Key migrations in progress.", ()),
    ("autops_auth_refusals_total", "counter",
     "Requests and connections refused (wrong secret, cluster key, operator token, CURVE).", ("reason",)),
)

Sample = tuple[tuple[str, ...], float]


def metric_samples(status: Mapping[str, Any]) -> dict[str, list[Sample]]:
    """Metric name -> [(label values, value)] for a status dict; None values skipped."""
    out: dict[str, list[Sample]] = {name: [] for name, *_ in _METRICS}

    def put(name: str, labels: tuple[str, ...], value: Any) -> None:
        v = _num(value)
        if v is not None:
            out[name].append((labels, float(v)))

    aggs = list(status.get("aggregators") or ())
    jobs = list(status.get("jobs") or ())
    by_state = {s: 0 for s in AGGREGATOR_STATES}
    for a in aggs:
        state = str(a.get("state"))
        by_state[state] = by_state.get(state, 0) + 1
        agg = str(a.get("id"))
        cluster = a.get("cluster")
        put("autops_aggregator_cpu_percent", (agg, "" if cluster is None else str(cluster)),
            a.get("cpu_percent"))
        put("autops_aggregator_busy_fraction", (agg,), a.get("busy_fraction"))
        put("autops_aggregator_tasks", (agg,), a.get("tasks"))
    for state, n in by_state.items():
        put("autops_aggregators", (state,), n)
    for j in jobs:
        job = (str(j.get("job")),)
        put("autops_job_iteration_seconds", job, j.get("iteration_time_s"))
        put("autops_job_standalone_iteration_seconds", job, j.get("standalone_iteration_time_s"))
        put("autops_job_speed_vs_standalone", job, j.get("speed_vs_standalone"))
        put("autops_job_tensors", job, j.get("tensors"))
        put("autops_job_bytes", job, j.get("bytes"))
        put("autops_job_skew", job, j.get("skew"))
        if j.get("aggregators") is not None:
            put("autops_job_aggregators", job, len(j["aggregators"]))
    put("autops_aggregators_requested", (), _requested(jobs))
    put("autops_aggregators_allocated", (), _allocated(aggs))
    migrations = status.get("migrations") or {}
    put("autops_migrations_completed_total", (), migrations.get("completed"))
    put("autops_migrations_active", (), migrations.get("active"))
    for reason, n in sorted(((status.get("security") or {}).get("refusals") or {}).items()):
        put("autops_auth_refusals_total", (str(reason),), n)
    return out


class _StatusCollector:
    """prometheus_client custom collector over the exporter's latest samples."""

    def __init__(self, exporter: "PrometheusExporter") -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        samples = self._exporter._snapshot()
        if samples is None:
            return
        for name, kind, doc, labels in _METRICS:
            if kind == "counter":
                fam = CounterMetricFamily(name, doc, labels=labels)
            else:
                fam = GaugeMetricFamily(name, doc, labels=labels)
            for values, value in samples.get(name, ()):
                fam.add_metric(list(values), value)
            yield fam


class PrometheusExporter:
    """Serves the metrics of the latest ``update(status)`` on ``/metrics``.

    Uses its own ``CollectorRegistry`` (not the process-global one), so several
    exporters can live in one process. ``update`` may be called from any thread.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._samples: dict[str, list[Sample]] | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.registry.register(_StatusCollector(self))

    def update(self, status: Mapping[str, Any]) -> None:
        """Replace the exported figures with those of ``status`` (converted at once, so
        later changes to the dict do not leak into a scrape)."""
        samples = metric_samples(status)
        with self._lock:
            self._samples = samples

    def _snapshot(self) -> dict[str, list[Sample]] | None:
        with self._lock:
            return self._samples

    def start(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the HTTP server in a daemon thread; return the bound port (port 0
        picks a free one)."""
        from prometheus_client import start_http_server

        if self._server is not None:
            raise RuntimeError(f"exporter already serving on port {self.port}")
        # prometheus_client >= 0.20 returns (server, thread); older ones return None.
        result = start_http_server(port, addr, registry=self.registry)
        if not isinstance(result, tuple):
            raise RuntimeError("prometheus_client too old: start_http_server returned no server")
        self._server, self._thread = result
        self.port = int(self._server.server_address[1])
        return self.port

    def stop(self) -> None:
        """Shut the HTTP server down and release its port; no-op when not started."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> "PrometheusExporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# --- text view --------------------------------------------------------------------
WIDTH = 100


def _f(value: Any, fmt: str = "{:.1f}", suffix: str = "") -> str:
    v = _num(value)
    return "-" if v is None else fmt.format(v) + suffix


def _mib(nbytes: Any) -> str:
    v = _num(nbytes)
    if v is None:
        return "-"
    return "<0.1" if 0 < v / _MIB < 0.05 else f"{v / _MIB:.1f}"


def _s(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _fit_list(items: Sequence[str], width: int) -> str:
    """Comma-joined items, cut to ``width`` with a ``+N`` tail for the ones left out."""
    if not items:
        return "-"
    text = ",".join(items)
    if len(text) <= width:
        return text
    for k in range(len(items) - 1, 0, -1):
        text = ",".join(items[:k]) + f" +{len(items) - k}"
        if len(text) <= width:
            return text
    return f"{len(items)} jobs"


def _wrap(prefix: str, parts: Sequence[str], width: int = WIDTH) -> list[str]:
    """``prefix`` followed by ``parts`` separated by '; ', wrapped at ``width``."""
    lines, line = [], prefix
    indent = " " * len(prefix)
    for i, part in enumerate(parts):
        piece = part + (";" if i < len(parts) - 1 else "")
        candidate = piece if line in (prefix, indent) else " " + piece
        if len(line) + len(candidate) > width and line not in (prefix, indent):
            lines.append(line)
            line = indent + piece
        else:
            line += candidate
    lines.append(line)
    return lines


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            if i == len(cells) - 1:
                out.append(c)
            else:
                out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return [line(header)] + [line(r) for r in rows]


def format_status(status: Mapping[str, Any]) -> str:
    """Human-readable pool view for ``autops status`` (fits 100 columns for usual
    ids): aggregators, clusters, jobs with their placement, migrations, saving."""
    aggs = list(status.get("aggregators") or ())
    jobs = list(status.get("jobs") or ())
    clusters = list(status.get("clusters") or ())
    report = utilization_report(status)
    totals = report["totals"]
    out: list[str] = []

    when = _num(status.get("time"))
    stamp = "-" if when is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    capacity = status.get("capacity")
    out.append(f"AutoPS master {_s(status.get('master'))}  provider {_s(status.get('provider'))}"
               f"  capacity {'unbounded' if capacity is None else capacity}  at {stamp}")
    out.append("")

    cpus, hosts = pool_cpus(aggs)
    where = "" if cpus is None else f", {cpus} CPU{'s' if cpus != 1 else ''} on {hosts} host{'s' if hosts != 1 else ''}"
    out.append(f"Aggregators: {len(aggs)} ({totals['aggregators_allocated']} allocated){where}")
    if aggs:
        header = ["ID", "CLUSTER", "STATE", "ALIVE", "CPUS", "CPU%", "BUSY", "TASKS", "MiB", "JOBS"]
        rows = []
        for a in aggs:
            rows.append([
                _s(a.get("id")), _s(a.get("cluster")), _s(a.get("state")),
                "yes" if a.get("alive") else "no",
                _f(a.get("cpus"), "{:.0f}"),
                _f(a.get("cpu_percent")),
                _f(None if _num(a.get("busy_fraction")) is None else a["busy_fraction"] * 100,
                   "{:.0f}", "%"),
                _f(a.get("tasks"), "{:.0f}"),
                _mib(a.get("assigned_bytes")),
                "",
            ])
        # Give the JOBS column what is left of the 100 columns (at least 12).
        fixed = _table(header[:-1] + [""], [r[:-1] + [""] for r in rows], {4, 5, 6, 7, 8})[0]
        room = max(12, WIDTH - len(fixed) - 2)
        for r, a in zip(rows, aggs):
            r[-1] = _fit_list(_strs(a.get("jobs")), room)
        out.extend("  " + ln for ln in _table(header, rows, {4, 5, 6, 7, 8}))
    else:
        out.append("  (no aggregators)")

    if clusters:
        out.append("")
        out.append(f"Clusters: {len(clusters)}")
        for c in clusters:
            free = _f(c.get("free_cpu"), "{:.2f}")
            parts = [f"aggregators {_fit_list(_strs(c.get('aggregators')), 60)}",
                     f"jobs {_fit_list(_strs(c.get('jobs')), 60)}", f"free cpu {free}"]
            out.extend(_wrap(f"  {_s(c.get('name'))}: ", parts))

    out.append("")
    out.append(f"Jobs: {len(jobs)}")
    if jobs:
        header = ["JOB", "STATE", "W", "MODE", "ITER s", "ALONE s", "SPEED", "AGGS used/req",
                  "SKEW"]
        rows = []
        for j in jobs:
            speed = _num(j.get("speed_vs_standalone"))
            used = len(j.get("aggregators") or ())
            rows.append([
                _s(j.get("job")), _s(j.get("state")), _f(j.get("world_size"), "{:.0f}"),
                _s(j.get("mode")), _f(j.get("iteration_time_s"), "{:.3f}"),
                _f(j.get("standalone_iteration_time_s"), "{:.3f}"),
                _f(None if speed is None else speed * 100, "{:.1f}", "%"),
                f"{used}/{_f(j.get('requested_aggregators'), '{:.0f}')}",
                _f(j.get("skew"), "{:.2f}"),
            ])
        table = _table(header, rows, {2, 4, 5, 6})
        out.append("  " + table[0])
        for line, j in zip(table[1:], jobs):
            out.append("  " + line)
            details = [f"cluster {_s(j.get('cluster'))}",
                       f"{_f(j.get('tensors'), '{:.0f}')} tensors",
                       f"{_f(j.get('keys'), '{:.0f}')} keys",
                       f"{_mib(j.get('bytes'))} MiB",
                       f"iterations {_f(j.get('iterations'), '{:.0f}')}",
                       f"cpu demand {_f(j.get('cpu_demand'), '{:.2f}')}",
                       f"reverts {_f(j.get('reverts'), '{:.0f}')}"]
            out.extend(_wrap("      ", details))
            keys = j.get("keys_per_aggregator") or {}
            nbytes = j.get("bytes_per_aggregator") or {}
            names = list(keys) + [n for n in nbytes if n not in keys]
            if names:
                parts = [f"{n} {_f(keys.get(n), '{:.0f}')} keys "
                         f"{_mib(nbytes.get(n))} MiB"
                         for n in names]
                out.extend(_wrap("      on: ", parts))
            else:
                out.append("      on: -")
    else:
        out.append("  (no jobs)")

    migrations = status.get("migrations") or {}
    out.append("")
    out.append(f"Migrations: {_f(migrations.get('active'), '{:.0f}')} active, "
               f"{_f(migrations.get('completed'), '{:.0f}')} completed, "
               f"{_f(migrations.get('failed'), '{:.0f}')} failed")
    saving = totals["cpu_saving"]
    out.append(f"Saving: {totals['aggregators_allocated']} aggregators allocated for "
               f"{totals['aggregators_requested']} requested -> "
               f"{'-' if saving is None else f'{saving * 100:.1f}%'} CPU saving")
    return "\n".join(out) + "\n"


__all__ = [
    "REPORT_VERSION", "REPORT_TYPE", "TOPIC", "utilization_report", "cpu_saving", "pool_cpus", "STATUS_LEGEND",
    "encode_report", "parse_message", "skew_of", "ReportPublisher", "ReportSubscriber",
    "subscribe", "metric_samples", "PrometheusExporter", "format_status",
]
