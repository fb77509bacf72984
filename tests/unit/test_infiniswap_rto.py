"""The retransmission-timeout floor of Infiniswap's TCP connections (device to data server):
its setting (``$INFINISWAP_TCP_RTO_MIN_US``, the ``rto_min_us`` arguments), what both ends
take of it, and the kernel's timer on the live connections following it (``ss``)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from dlrt import tcpopts
from infiniswap import core
from infiniswap.core import PAGE_SIZE, CoreDevice, DataServer

from slab_fixtures import lease, store  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(30)

SLAB = 1 << 20


@pytest.fixture
def slab_size() -> int:
    return SLAB


def timers_ms(port: int) -> list[float]:
    """The kernel's current retransmission timer (ms) of every established connection to or
    from ``port`` on this host, as ``ss`` shows it."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} or dport = :{port} )"],
                         capture_output=True, text=True, check=True, timeout=10).stdout
    return [float(m) for m in re.findall(r"\brto:([0-9.]+)", out)]


def test_the_setting_comes_from_the_environment_and_matches_the_c_cores_bound(monkeypatch):
    assert int(core.lib.ISW_RTO_MIN_MAX_US) == tcpopts.KERNEL_RTO_MIN_US
    monkeypatch.delenv(core.RTO_MIN_ENV, raising=False)
    assert core.rto_min_us_from_env() == tcpopts.RTO_MIN_US
    monkeypatch.setenv(core.RTO_MIN_ENV, "0")
    assert core.rto_min_us_from_env() == 0
    monkeypatch.setenv(core.RTO_MIN_ENV, "250000")
    with pytest.raises(ValueError, match=core.RTO_MIN_ENV):
        core.rto_min_us_from_env()


def test_a_bad_floor_is_refused_by_both_ends(store, tmp_path, monkeypatch):
    for bad in (-1, tcpopts.KERNEL_RTO_MIN_US + 1):
        with pytest.raises(ValueError, match="rto_min_us"):
            DataServer(store, "127.0.0.1", 0, rto_min_us=bad)
    monkeypatch.setenv(core.RTO_MIN_ENV, "soon")
    with pytest.raises(ValueError, match=core.RTO_MIN_ENV):
        DataServer(store, "127.0.0.1", 0)
    monkeypatch.delenv(core.RTO_MIN_ENV)
    server = DataServer(store, "127.0.0.1", 0)
    try:
        with CoreDevice(2 * SLAB, SLAB, tmp_path / "backup.img") as dev:
            with pytest.raises(ValueError, match="rto_min_us"):
                dev.add_remote_tcp("127.0.0.1", server.port(), connections=1, rto_min_us=-5)
            monkeypatch.setenv(core.RTO_MIN_ENV, "soon")
            with pytest.raises(ValueError, match=core.RTO_MIN_ENV):
                dev.add_remote_tcp("127.0.0.1", server.port(), connections=1)
            assert server.stats().connections == 0
    finally:
        server.stop()


@pytest.mark.parametrize("asked", [10_000, 0])
def test_both_ends_take_the_floor_and_the_kernels_timer_follows_it(store, tmp_path, monkeypatch, asked):
    reason = tcpopts.unsupported()
    if reason:
        pytest.skip(reason)
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed: cannot read the connections' timers")
    monkeypatch.setenv(core.RTO_MIN_ENV, str(asked))          # the server's, from the environment
    server = DataServer(store, "127.0.0.1", 0)
    try:
        with CoreDevice(2 * SLAB, SLAB, tmp_path / "backup.img") as dev:
            monkeypatch.delenv(core.RTO_MIN_ENV)
            rid = dev.add_remote_tcp("127.0.0.1", server.port(), connections=2, rto_min_us=asked)
            region, gen = lease(store)
            dev.map_slab(0, rid, region, gen)
            data = bytes(range(256)) * (16 * PAGE_SIZE // 256)
            for _ in range(20):                   # round trips for the timers to settle on
                dev.write(0, data)
                assert dev.read(0, len(data)) == data
            took_device, took_server = dev.remote_rto_min_us(rid), server.stats().rto_min_us
            timers = timers_ms(server.port())
    finally:
        server.stop()
    assert len(timers) == 4, timers              # two connections, both ends
    if asked:
        # 10 ms, or the least above it the kernel's clock ticks allow
        assert asked <= took_device == took_server < 2 * asked
        assert all(t < 50 for t in timers), timers
    else:
        assert took_device == took_server == 0
        assert all(t >= tcpopts.KERNEL_RTO_MIN_US / 1000 for t in timers), timers


def test_a_shared_memory_remote_reports_no_floor(store, tmp_path):
    with CoreDevice(2 * SLAB, SLAB, tmp_path / "backup.img") as dev:
        rid = dev.add_remote_shm(store.path(), store.capacity)
        assert dev.remote_rto_min_us(rid) == 0
