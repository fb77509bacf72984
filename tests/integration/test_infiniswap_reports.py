"""Utilization reports of a real ``infiniswap daemon`` process on loopback: a SUB socket gets
``infiniswap.utilization`` frames within a bounded time, their figures agree with the
daemon's STATUS, they follow a device mapping slabs and an eviction under emulated memory
pressure, and the Prometheus port serves the same figures.  The daemon is started through
the command line (``infiniswap.local.DaemonProcess``) and always stopped by pid."""
from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import pytest
import zmq

from infiniswap import Device
from infiniswap import protocol as p
from infiniswap.channel import ask, context
from infiniswap.local import DaemonProcess
from infiniswap.report import TOPIC, parse_message
from ports import free_port

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
HOST = "emulated-host-1"


class ReportingDaemon(DaemonProcess):
    """A ``DaemonProcess`` that keeps its ready line (it announces the reports endpoint)."""

    ready_line = ""

    def _ready_line(self, wait: float) -> str:
        self.ready_line = super()._ready_line(wait)
        return self.ready_line


@pytest.fixture
def daemon():
    """A daemon on an emulated 32 MiB machine (HeadRoom 4 MiB, 1 MiB slabs) publishing every
    0.1 s on an announced port, metrics on a free port."""
    metrics_port = free_port()
    d = ReportingDaemon(slab_size=MiB, capacity=32 * MiB, headroom=4 * MiB, period=0.1,
                        extra=["--reports", "tcp://127.0.0.1:0", "--report-interval", "0.1",
                               "--report-host", HOST, "--metrics-port", str(metrics_port)])
    try:
        d.start()
        m = re.search(r" reports (\S+) metrics (\S+)", d.ready_line)
        assert m, f"reports and metrics not announced: {d.ready_line!r}"
        d.reports, d.metrics_url = m.group(1), m.group(2)
        assert d.metrics_url == f"http://127.0.0.1:{metrics_port}/metrics"
        yield d
    finally:
        d.stop()


@pytest.fixture
def subscriber(daemon):
    sock = context().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sock.connect(daemon.reports)
    try:
        yield sock
    finally:
        sock.close(0)


def report_where(sub: zmq.Socket, cond: Callable[[dict], bool], what: str,
                 timeout: float = 10.0) -> dict[str, Any]:
    """The first report for which ``cond`` holds; fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            last = parse_message(sub.recv())
            if cond(last):
                return last
    raise AssertionError(f"no report with {what} within {timeout} s; the last one: {last}")


def scrape(url: str) -> dict[str, float]:
    """``name{host="..."}`` -> value of the infiniswap samples at ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {f'{s.name}{{host="{s.labels["host"]}"}}': s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("infiniswap_")}


def test_reports_follow_the_daemon_and_metrics_serve_them(daemon, subscriber, tmp_path):
    first = report_where(subscriber, lambda r: True, "anything", timeout=5)
    assert first["type"] == "infiniswap.utilization" and first["version"] == 1
    assert first["host"] == HOST and first["daemon"] == daemon.address
    assert abs(first["time"] - time.time()) < 60

    # preallocation above HeadRoom: 32 MiB machine, 4 MiB HeadRoom -> 28 free slabs
    idle = report_where(subscriber, lambda r: r["slabs_free"] == 28, "28 preallocated slabs")
    status = ask(daemon.address, p.STATUS)["report"]
    assert idle["memory_total_bytes"] == status["total_memory"] == 32 * MiB
    assert idle["memory_total_bytes"] >= idle["memory_free_bytes"] > 0
    assert idle["memory_free_bytes"] == status["free_bytes"] == 4 * MiB
    assert idle["headroom_bytes"] == 4 * MiB and idle["slab_bytes"] == MiB
    assert idle["slabs_lent"] == status["slabs_mapped"] == 0
    assert idle["slabs_free"] == status["slabs_free"]
    assert idle["lendable_bytes"] == status["giveable_bytes"] == 28 * MiB
    assert idle["evictions_total"] == 0 and idle["devices"] == 0

    with Device(4 * MiB, backup=tmp_path / "backup", daemons=[daemon.address], slab_size=MiB,
                period=0.1, timeout=2.0, device_id="reports-dev") as dev:
        assert dev.map_now() == 4
        lent = report_where(subscriber, lambda r: r["slabs_lent"] == 4, "4 slabs lent")
        assert lent["devices"] == 1 and lent["slabs_free"] == 24
        assert lent["lendable_bytes"] == 24 * MiB
        status = ask(daemon.address, p.STATUS)["report"]
        assert status["slabs_mapped"] == 4 and status["devices"] == {"reports-dev": [0, 1, 2, 3]}

        samples = scrape(daemon.metrics_url)
        assert samples[f'infiniswap_slabs_lent{{host="{HOST}"}}'] == 4.0
        assert samples[f'infiniswap_slabs_free{{host="{HOST}"}}'] == 24.0
        assert samples[f'infiniswap_memory_total_bytes{{host="{HOST}"}}'] == 32.0 * MiB
        assert samples[f'infiniswap_devices{{host="{HOST}"}}'] == 1.0
        assert {"infiniswap_memory_free_bytes", "infiniswap_headroom_bytes",
                "infiniswap_lendable_bytes", "infiniswap_evictions_total"} <= \
            {k.split("{")[0] for k in samples}

        # local usage grows to 26 MiB: free slabs go first, then mapped ones are evicted
        daemon.set_usage(26 * MiB)
        evicted = report_where(subscriber, lambda r: r["evictions_total"] > 0, "an eviction")
        assert evicted["slabs_free"] == 0 and evicted["slabs_lent"] < 4
        assert evicted["lendable_bytes"] == 0
        # The exporter gets the same figures right after the publisher, on the control thread:
        # once that thread answered a STATUS sent now, it has served them too.
        ask(daemon.address, p.STATUS)
        samples = scrape(daemon.metrics_url)
        assert samples[f'infiniswap_evictions_total{{host="{HOST}"}}'] >= 1.0

    assert daemon.stop() == 0                              # clean shutdown closes the sockets
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(daemon.metrics_url, timeout=2)


@pytest.mark.parametrize("args, text, code", [
    (["--reports", "tcp://127.0.0.1:port"], "bad address 'tcp://127.0.0.1:port'", 2),
    (["--metrics-port", "70000"], "--metrics-port 70000 must be in 0..65535", 2),
    (["--report-interval", "0"], "'0' must be positive", 2),
])
def test_bad_report_options_one_clear_line(args, text, code):
    out = subprocess.run([sys.executable, "-m", "infiniswap.cli", "daemon", "--bind",
                          "tcp://127.0.0.1:0", "--slab-size", "1M", "--capacity", "4M",
                          "--no-lock", *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == code
    assert text in out.stderr
    assert "Traceback" not in out.stderr
