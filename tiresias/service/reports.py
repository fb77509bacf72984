"""Utilization reports the master consumes: AutoPS pMaster and Infiniswap daemons.

Reports are messages, not imports: each arrives on a ZeroMQ SUB socket as one frame,
``<topic> <JSON>``, with topic ``autops.utilization`` (pMaster: per-job tensor profile, from
which the skew) or ``infiniswap.utilization`` (a daemon: its host's total and free memory,
HeadRoom, slabs lent and free, what it can still lend). ``ReportFeed`` keeps the latest
report per source with its arrival time; a report older than ``max_age`` is ignored by every
reader and flagged (``stale``) so the operator sees it. Unknown fields are ignored, a
malformed frame is counted and dropped. Over tcp the subscription runs CURVE when the
cluster's key directory has its keys (``dlrt.curve``), as the publishers do.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Iterable

import zmq

from dlrt.curve import Security, default_security

AUTOPS_TOPIC = "autops.utilization"
INFINISWAP_TOPIC = "infiniswap.utilization"


def normalize_endpoint(address: str) -> str:
    """``HOST:PORT`` or ``tcp://HOST:PORT`` (or ipc://...) -> a ZeroMQ endpoint."""
    if "://" in address:
        return address
    if ":" not in address:
        raise ValueError(f"report endpoint {address!r}: expected HOST:PORT or tcp://HOST:PORT")
    return f"tcp://{address}"


def parse_frame(frame: bytes) -> tuple[str, dict[str, Any]]:
    topic, _, body = frame.partition(b" ")
    data = json.loads(body.decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError("report is not a JSON object")
    return topic.decode("ascii", "replace"), data


class ReportFeed:
    """Subscribes to report endpoints in a thread; keeps the freshest report of each source."""

    def __init__(self, autops: Iterable[str] = (), infiniswap: Iterable[str] = (), max_age: float = 10.0,
                 clock: Callable[[], float] = time.time, on_report: Callable[[str], None] | None = None,
                 security: Security | None = None) -> None:
        self.security = security if security is not None else default_security()
        self.autops_endpoints = [normalize_endpoint(a) for a in autops]
        self.infiniswap_endpoints = [normalize_endpoint(a) for a in infiniswap]
        self.max_age = max_age
        self.clock = clock
        self.on_report = on_report
        self.malformed = 0
        self._latest: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.autops_endpoints or self.infiniswap_endpoints)

    def start(self) -> "ReportFeed":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiresias-reports", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        for ep in self.autops_endpoints:
            sock.setsockopt(zmq.SUBSCRIBE, AUTOPS_TOPIC.encode())
            self.security.client(sock, ep)
            sock.connect(ep)
        for ep in self.infiniswap_endpoints:
            sock.setsockopt(zmq.SUBSCRIBE, INFINISWAP_TOPIC.encode())
            self.security.client(sock, ep)
            sock.connect(ep)
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                self.ingest(sock.recv())
        finally:
            sock.close()

    def ingest(self, frame: bytes, received: float | None = None) -> bool:
        """Take one frame (also used by tests); False if it was malformed or unknown."""
        try:
            topic, data = parse_frame(frame)
        except (ValueError, UnicodeDecodeError):
            self.malformed += 1
            return False
        if topic == AUTOPS_TOPIC:
            source = str(data.get("master", "autops"))
        elif topic == INFINISWAP_TOPIC:
            source = str(data.get("daemon") or data.get("host") or "infiniswap")
        else:
            self.malformed += 1
            return False
        with self._lock:
            self._latest[(topic, source)] = (self.clock() if received is None else received, data)
        if self.on_report is not None:
            self.on_report(topic)
        return True

    def _fresh(self, topic: str) -> list[dict[str, Any]]:
        now = self.clock()
        with self._lock:
            return [d for (t, _), (at, d) in self._latest.items() if t == topic and now - at <= self.max_age]

    def sources(self) -> list[dict[str, Any]]:
        """Every source seen, with its age and whether it is stale (ignored)."""
        now = self.clock()
        with self._lock:
            return [{"topic": t, "source": s, "age_s": round(now - at, 3), "stale": now - at > self.max_age}
                    for (t, s), (at, _) in sorted(self._latest.items())]

    # --- what the master uses -------------------------------------------------------------------
    def job_skews(self) -> dict[str, float]:
        """AutoPS job name -> measured skew (largest tensor / model bytes), fresh reports only."""
        skews: dict[str, float] = {}
        for report in self._fresh(AUTOPS_TOPIC):
            for job in report.get("jobs") or []:
                if not isinstance(job, dict) or not job.get("tensors"):
                    continue                     # no tensor declared yet: no profile to take
                skew = job.get("skew")
                if isinstance(skew, (int, float)) and 0.0 <= skew <= 1.0 and job.get("job"):
                    skews[str(job["job"])] = float(skew)
        return skews

    def job_iteration_times(self) -> dict[str, float]:
        """AutoPS job name -> its recent measured iteration time in seconds, fresh reports only
        (an allocation policy's speed samples: steps per second = 1 / it)."""
        times: dict[str, float] = {}
        for report in self._fresh(AUTOPS_TOPIC):
            for job in report.get("jobs") or []:
                if not isinstance(job, dict) or not job.get("job"):
                    continue
                seconds = job.get("iteration_time_s")
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0.0 < seconds < 1e6:
                    times[str(job["job"])] = float(seconds)
        return times

    def memory(self) -> dict[str, dict[str, Any]]:
        """Host -> its latest fresh Infiniswap report (several daemons of a host: the last)."""
        hosts: dict[str, dict[str, Any]] = {}
        for report in self._fresh(INFINISWAP_TOPIC):
            host = report.get("host")
            if host:
                hosts[str(host)] = report
        return hosts

    def lendable_bytes(self) -> int:
        """Remote memory the cluster's daemons can lend now (fresh reports)."""
        return sum(int(r.get("lendable_bytes") or 0) for r in self.memory().values())
