"""Every page written reads back (thesis §2.4.3-§2.4.5), with real daemon processes on
loopback that evict slabs and die (SIGKILL) at random points.

A model-based, property-based test: hypothesis draws a sequence of operations -- writes and
reads of random page-aligned ranges (often across slab boundaries), forced mapping, device-
side evictions, memory pressure on a daemon (which then batch-evicts: CHECK_ACTIVITY /
EVICT / DONE), daemon kills, pauses that let the control loops act, and the read-after-write
race of §2.4.5 -- and checks every read against a plain bytearray.  The daemons are
``infiniswap daemon`` subprocesses, each stopped by pid afterwards.
"""
from __future__ import annotations

import random
import signal
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from infiniswap import Device
from infiniswap.core import SlabState
from infiniswap.local import LocalDaemons
from infiniswap_testlib import PageChurn, wait_until

MiB = 1 << 20
PAGE = 4096
SLAB = MiB
PPS = SLAB // PAGE                 # pages per slab
SLABS = 6
PAGES = SLABS * PPS
N_DAEMONS = 3
CAPACITY = 16 * MiB                # each daemon's emulated machine
HEADROOM = 2 * MiB


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    daemons = LocalDaemons(N_DAEMONS, slab_size=SLAB, capacity=CAPACITY, headroom=HEADROOM,
                           period=0.05, timeout=2.0)
    daemons.start()
    try:
        yield daemons
    finally:
        daemons.stop()


def revive(cluster: LocalDaemons) -> None:
    for d in cluster.daemons:
        d.set_usage(0)
        if not d.running:
            d.start()




# ---- operations ----

page_offset = st.one_of(
    st.integers(0, PAGES - 1),
    # near a slab boundary, so many ranges span two slabs (§2.4.3)
    st.builds(lambda s, d: s * PPS + d, st.integers(1, SLABS - 1), st.integers(-4, 3)),
)
ranges = st.tuples(page_offset, st.integers(1, 40)).map(
    lambda t: (t[0], min(t[1], PAGES - t[0])))

writes = st.tuples(st.just("write"), ranges, st.integers(0, 2**32))
reads = st.tuples(st.just("read"), ranges)
ops = st.one_of(
    writes, writes, writes,
    reads, reads,
    st.tuples(st.just("reread")),                 # the range written last
    st.tuples(st.just("fill"), st.integers(0, SLABS - 1), st.integers(0, 2**32)),
    st.tuples(st.just("readall")),
    st.tuples(st.just("map")),
    st.tuples(st.just("evict"), st.integers(0, SLABS - 1)),
    st.tuples(st.just("pressure"), st.integers(0, N_DAEMONS - 1)),
    st.tuples(st.just("squeeze"), st.integers(0, N_DAEMONS - 1)),
    st.tuples(st.just("relief"), st.integers(0, N_DAEMONS - 1)),
    st.tuples(st.just("kill"), st.integers(0, N_DAEMONS - 1)),
    st.tuples(st.just("race"), st.integers(0, SLABS - 1), st.integers(0, 2**32)),
    st.tuples(st.just("pause")),
)


def check_read(dev: Device, model: bytearray, first: int, n: int) -> None:
    off, length = first * PAGE, n * PAGE
    got = dev.read(off, length)
    if got != model[off:off + length]:
        bad = next(i for i in range(n) if got[i * PAGE:(i + 1) * PAGE] !=
                   model[off + i * PAGE:off + (i + 1) * PAGE])
        raise AssertionError(f"page {first + bad} (slab {(first + bad) // PPS}) reads back "
                             f"wrong; device state: {dev.stats()['slabs']}")


def daemon_of(dev: Device, cluster: LocalDaemons, slab: int):
    where = dev.stats()["slabs"][slab]["daemon"]
    return next((d for d in cluster.daemons if d.address == where), None)


@example(transport="shm", premap=True, program=[
    ("fill", 0, 1), ("fill", 1, 2), ("fill", 2, 3), ("squeeze", 0), ("squeeze", 1), ("squeeze", 2),
    ("relief", 0), ("relief", 1), ("relief", 2), ("pause",), ("fill", 0, 4), ("pressure", 0),
    ("write", (250, 12), 5), ("kill", 1), ("read", (250, 12)), ("race", 3, 6), ("readall",)])
@example(transport="tcp", premap=True, program=[
    ("fill", 0, 1), ("fill", 3, 2), ("squeeze", 0), ("squeeze", 1), ("squeeze", 2), ("relief", 0),
    ("relief", 1), ("relief", 2), ("map",), ("write", (0, 40), 3), ("kill", 0), ("pause",),
    ("readall",), ("race", 1, 7), ("readall",)])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(transport=st.sampled_from(["shm", "tcp"]),
       premap=st.booleans(),
       program=st.lists(ops, min_size=15, max_size=60))
@pytest.mark.timeout(150)
def test_every_page_reads_back_through_evictions_and_daemon_kills(cluster, tmp_path, transport,
                                                                  premap, program):
    revive(cluster)
    backup = tmp_path / f"backup-{time.monotonic_ns()}"
    model = bytearray(PAGES * PAGE)
    dev = Device(PAGES * PAGE, backup=backup, daemons=cluster.addresses, slab_size=SLAB,
                 period=0.05, timeout=0.5, transport=transport, hot_slab=20.0,
                 rng=random.Random(0))
    kills = 0
    last = (0, 1)
    try:
        if premap:
            dev.map_now()
        for op in program:
            kind = op[0]
            if kind == "write":
                (first, n), seed = op[1], op[2]
                data = random.Random(seed).randbytes(n * PAGE)
                dev.write(first * PAGE, data)
                model[first * PAGE:(first + n) * PAGE] = data
                last = (first, n)
            elif kind == "read":
                check_read(dev, model, *op[1])
            elif kind == "reread":
                check_read(dev, model, *last)
            elif kind == "fill":            # a whole slab
                data = random.Random(op[2]).randbytes(SLAB)
                dev.write(op[1] * SLAB, data)
                model[op[1] * SLAB:(op[1] + 1) * SLAB] = data
            elif kind == "readall":
                check_read(dev, model, 0, PAGES)
            elif kind == "map":
                dev.map_now()
            elif kind == "evict":
                dev.evict_now([op[1]])
            elif kind == "pressure":        # the daemon's machine needs its memory back
                cluster[op[1]].set_usage(CAPACITY - HEADROOM)    # every slab must go
            elif kind == "squeeze":         # pressure, and wait for its evictions
                victim = cluster[op[1]]
                victim.set_usage(CAPACITY - HEADROOM)
                if victim.running:
                    wait_until(lambda: victim.address not in dev.stats()["mapped"], 5,
                               "the daemon under pressure to evict this device's slabs")
                check_read(dev, model, 0, PAGES)
            elif kind == "relief":
                cluster[op[1]].set_usage(0)
            elif kind == "kill" and kills < 2 and cluster[op[1]].running:
                cluster[op[1]].kill(signal.SIGKILL)
                kills += 1
            elif kind == "race" and kills < 2:
                # §2.4.5: the remote write completes, the daemon dies before the disk write.
                slab, seed = op[1], op[2]
                dev.map_now([slab])
                victim = daemon_of(dev, cluster, slab)
                data = random.Random(seed).randbytes(PAGE)
                off = slab * SLAB + (seed % PPS) * PAGE
                dev.core.set_debug_writer_delay(200_000)
                try:
                    dev.write(off, data)
                    model[off:off + PAGE] = data
                    if victim is not None and victim.running:
                        victim.kill(signal.SIGKILL)
                        kills += 1
                    check_read(dev, model, off // PAGE, 1)
                finally:
                    dev.core.set_debug_writer_delay(0)
            elif kind == "pause":
                time.sleep(0.15)
        check_read(dev, model, 0, PAGES)
        dev.flush()
    finally:
        dev.close()
    with open(backup, "rb") as fh:            # and the backup file alone holds everything
        assert fh.read() == model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_read_after_write_when_the_daemon_dies_before_the_disk_write(tmp_path, transport):
    """The race of §2.4.5, step by step: the page is in remote memory, its disk write is
    still queued, the daemon dies; once the device has unmapped the slab (bits cleared, reads
    go to disk) the read must wait for the queued disk write, not return stale disk data."""
    delay_s = 4.0
    with LocalDaemons(1, slab_size=SLAB, capacity=CAPACITY, headroom=0, period=0.05) as one:
        dev = Device(2 * SLAB, backup=tmp_path / "backup", daemons=one.addresses,
                     slab_size=SLAB, period=0.05, timeout=0.5, transport=transport,
                     hot_slab=1e12)          # no automatic remapping after the failure
        try:
            old = random.Random(1).randbytes(2 * PAGE)
            dev.write(0, old)                         # on disk (slab unmapped)
            assert dev.map_now([0]) == 1
            new = random.Random(2).randbytes(2 * PAGE)
            dev.core.set_debug_writer_delay(int(delay_s * 1e6))
            t_write = time.monotonic()
            dev.write(0, new)                         # remote now, disk in `delay_s`
            info = dev.core.slab_info(0)
            assert info.bits_set == 2 and info.pending_disk_writes >= 1
            one[0].kill(signal.SIGKILL)
            wait_until(lambda: dev.core.slab_info(0).state == SlabState.UNMAPPED, delay_s,
                       "the device to unmap the dead daemon's slab")
            info = dev.core.slab_info(0)
            assert info.bits_set == 0
            raced = info.pending_disk_writes >= 1 and time.monotonic() - t_write < delay_s
            assert dev.read(0, 2 * PAGE) == new
            assert raced, "the disk write finished before the read: the race was not exercised"
            assert dev.stats()["daemon_failures"] == 1
        finally:
            dev.core.set_debug_writer_delay(0)
            dev.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_daemon_restarted_after_a_crash_is_used_again(tmp_path, transport):
    """A daemon is SIGKILLed while the device writes and reads.  Until it is back every page
    comes from the backup file, and is right.  It is restarted at the same address with fresh
    memory: the device's control loop notices that it answers again, forgets the old
    incarnation, maps its hot slabs there again, and reads from it -- and every page read
    before, during and after is right."""
    with LocalDaemons(1, slab_size=SLAB, capacity=CAPACITY, headroom=0, period=0.05) as one:
        daemon = one[0]
        dev = Device(4 * SLAB, backup=tmp_path / "backup", daemons=one.addresses,
                     slab_size=SLAB, period=0.05, timeout=0.5, transport=transport)
        churn = PageChurn(dev, 4 * PPS)
        try:
            assert dev.map_now() == 4
            churn.start()

            def remote_reads() -> int:
                return dev.stats()["io"]["bytes_read_remote"]

            wait_until(lambda: remote_reads() > 0, 10, "remote reads before the crash")
            first = dev.stats()["daemons"][daemon.address]["instance"]
            daemon.kill(signal.SIGKILL)
            wait_until(lambda: dev.stats()["daemon_failures"] == 1 and not dev.stats()["mapped"],
                       10, "the device to take the dead daemon's slabs back to its backup file")
            st = dev.stats()
            assert not st["daemons"][daemon.address]["reachable"]
            outage_remote, outage_disk, outage_reads = (st["io"]["bytes_read_remote"],
                                                        st["io"]["bytes_read_disk"], churn.reads)
            wait_until(lambda: churn.reads > outage_reads + 200 or churn.errors, 20,
                       "reads while the daemon is down")
            st = dev.stats()
            assert st["io"]["bytes_read_disk"] > outage_disk and not st["mapped"]
            assert st["io"]["bytes_read_remote"] == outage_remote     # all from the backup file

            daemon.restart()
            wait_until(lambda: dev.stats()["mapped"].get(daemon.address), 15,
                       "the device to map its hot slabs on the restarted daemon")
            st = dev.stats()
            again = st["daemons"][daemon.address]
            assert again["reachable"] and again["instance"] not in (None, first)
            assert again["transport"] == transport and st["daemon_failures"] == 1
            back = remote_reads()
            wait_until(lambda: remote_reads() > back or churn.errors, 10,
                       "remote reads from the restarted daemon")
            done = churn.reads
            wait_until(lambda: churn.reads > done + 200 or churn.errors, 20, "reads after")
        finally:
            churn.stop()
        assert not churn.errors, churn.errors
        try:
            assert dev.read(0, dev.size) == churn.model
            dev.flush()
        finally:
            dev.close()
        with open(tmp_path / "backup", "rb") as fh:
            assert fh.read() == churn.model
