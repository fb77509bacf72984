"""Floods from peers that never prove the cluster key, against a live ``infiniswap daemon``
(infiniswap/limits.py, csrc/infiniswap/isw_dataserver.c):

* control channel: over a thousand ZeroMQ identities (each its own DEALER, all held open)
  QUERY_MEMs and never read a reply, after a few of them asked for STATUS (big replies)
  three times faster than their burst; the daemon's resident memory grows by less than
  what its limits allow for so many connections (queues of ``sndhwm`` / ``rcvhwm``
  messages, ``max_peers`` records), it drops records, over-rate messages and the replies it
  cannot queue, and a device arriving in the flood still maps a slab and reads back what it
  wrote;
* data server: with its open-file limit lowered and a small connection cap, a few hundred
  idle TCP connections: the server holds no more than its cap, closes the unproven ones at
  the handshake deadline, does not spin (its CPU time stays low), and a device pages
  through it correctly throughout;
* data server out of descriptors, its cap out of reach: connections that proved the key
  take every descriptor (the last one included: an accept failing with EMFILE while nobody
  waits closes nothing) and a flood queues behind them; the server pauses accepting
  (``accept_pauses``, at most one per worker per ``ISW_ACCEPT_PAUSE_MS``) without spinning
  and keeps answering its connections, says so once in its log, closes its oldest unproven
  connection to make room once there are some, and serves a device once the flood is gone.
"""
from __future__ import annotations

import contextlib
import functools
import resource
import socket
import struct
import subprocess
import sys
import time

import psutil
import pytest
import zmq

from infiniswap import Device
from infiniswap import protocol as p
from infiniswap.channel import ask
from infiniswap.core import lib
from infiniswap.limits import ControlLimits
from infiniswap.local import DaemonProcess
from infiniswap.meminfo import MemInfo, parse_meminfo
from infiniswap_testlib import ControlPeer, proven_data_connection
from waiting import until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
PAGE = 4096


def _raise_nofile(want: int) -> int:
    """Raise this process's soft open-file limit towards ``want`` (children inherit it);
    the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def _nofile_limit(n: int):
    """A ``popen`` for DaemonProcess whose child runs with RLIMIT_NOFILE ``n``."""
    def limit() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, min(n, hard) if hard != -1 else n))
    return functools.partial(subprocess.Popen, preexec_fn=limit)


def _status(addr: str) -> dict:
    reply = ask(addr, p.STATUS, timeout=10)
    assert reply.op == p.REPORT
    return reply["report"]


def _pages(tag: int, n: int) -> bytes:
    return bytes([tag % 251 + 1]) * (n * PAGE)


def test_control_flood_from_thousands_of_identities_stays_bounded(tmp_path):
    soft = _raise_nofile(8192)
    identities = max(200, min(1500, (soft - 300) // 2))     # each holds a socket here
    limits = ControlLimits(max_peers=identities // 2)
    per_peer = 2 * limits.sndhwm
    daemon = DaemonProcess(slab_size=MiB, capacity=8 * MiB, period=0.1, timeout=2.0,
                           extra=["--control-max-peers", str(limits.max_peers)])
    daemon.start()
    ctx = zmq.Context()
    ctx.max_sockets = identities + 100
    socks = []
    try:
        proc = psutil.Process(daemon.pid)
        until("the daemon to settle", lambda: _status(daemon.address)["slabs_free"] > 0, 10)
        before = proc.memory_info().rss
        query = p.encode(p.QUERY_MEM, id=1)
        reply_size = len(p.reply_to(p.decode(query), p.FREE_MEM, free_bytes=1 << 40, slab_size=MiB,
                                    slabs_free=1 << 20, slabs_mapped=0, host_id="x" * 64,
                                    instance="x" * 12, challenge="00" * 16))
        status = p.encode(p.STATUS, id=2)
        status_reply = 2 * len(ask(daemon.address, p.STATUS, timeout=10).encode())

        def attacker() -> zmq.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 1)         # never read: replies back up to the daemon
            s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(daemon.address)
            socks.append(s)
            return s
        t0 = time.monotonic()
        # a few identities ask for big replies (STATUS) faster than their rate
        loud = [attacker() for _ in range(8)]
        for s in loud:
            for _ in range(3 * int(limits.burst)):
                s.send(status, zmq.NOBLOCK)
        until("the daemon to take in the STATUS flood",
              lambda: _status(daemon.address)["control"]["rate_limited"] >=
              len(loud) * limits.burst, 30)
        # many identities ask for small ones
        quiet = [attacker() for _ in range(identities)]
        for s in quiet:
            for _ in range(per_peer):
                s.send(query, zmq.NOBLOCK)
        # a device arrives in the middle of the flood: it still maps and pages
        with Device(2 * MiB, backup=tmp_path / "victim", daemons=[daemon.address],
                    slab_size=MiB, hot_slab=1e12, period=0.2, timeout=5.0) as dev:
            until("the device to map a slab during the flood", lambda: dev.map_now([0]) == 1, 30)
            dev.write(0, _pages(7, 16))
            assert dev.read(0, 16 * PAGE) == _pages(7, 16)
            assert dev.stats()["slabs_mapped"] == 1
        until("the daemon to take in the whole flood",
              lambda: _status(daemon.address)["requests"] >=
              identities * per_peer + len(loud) * limits.burst, 30)
        report = _status(daemon.address)
        ctl = report["control"]
        grown = proc.memory_info().rss - before
        bound = (identities * limits.connection_bytes(request=len(query), reply=reply_size) +
                 len(loud) * limits.connection_bytes(request=len(status), reply=status_reply) +
                 limits.records_bytes() + 16 * MiB)         # 16 MiB: allocator, Python
        print(f"{identities} identities x {per_peer} messages in {time.monotonic() - t0:.1f} s: "
              f"daemon grew {grown / MiB:.1f} MiB (bound {bound / MiB:.1f} MiB), {ctl}")
        assert grown < bound, f"the daemon grew {grown} bytes, more than its limits allow ({bound})"
        assert ctl["peers"] <= limits.max_peers and ctl["peers_dropped"] > 0
        assert ctl["rate_limited"] >= len(loud) * limits.burst
        assert report["maps"] == 1 and proc.is_running()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        daemon.stop()


def test_data_server_flood_is_capped_expired_and_does_not_starve_a_device(tmp_path):
    cap, deadline, flood = 24, 1.0, 300
    daemon = DaemonProcess(slab_size=MiB, capacity=8 * MiB, period=0.1, timeout=2.0,
                           popen=_nofile_limit(128),   # the flood outnumbers its descriptors: the cap holds
                           extra=["--data-max-connections", str(cap),
                                  "--data-handshake-timeout", str(deadline)])
    daemon.start()
    conns: list[socket.socket] = []
    try:
        proc = psutil.Process(daemon.pid)
        assert proc.rlimit(psutil.RLIMIT_NOFILE)[0] == 128
        host, port = daemon.data_address.rsplit(":", 1)
        with Device(4 * MiB, backup=tmp_path / "victim", daemons=[daemon.address],
                    slab_size=MiB, transport="tcp", hot_slab=1e12, period=0.2) as dev:
            assert dev.map_now() == 4
            for slab in range(4):
                dev.write(slab * MiB, _pages(slab, 8))
            cpu0 = sum(proc.cpu_times()[:2])
            for _ in range(flood):                  # idle: never answer the HELLO
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(("127.0.0.1", int(port)))
                except BlockingIOError:
                    pass
                conns.append(s)
            t0 = time.monotonic()
            for round_ in range(5):                 # the device pages through the flood
                for slab in range(4):
                    data = _pages(10 * round_ + slab, 8)
                    dev.write(slab * MiB + PAGE, data)
                    assert dev.read(slab * MiB + PAGE, 8 * PAGE) == data
                served = _status(daemon.address)["served"]
                assert served["active_connections"] <= cap
            io = dev.stats()["io"]
            assert io["remote_errors"] == 0 and dev.stats()["slabs_mapped"] == 4

            def expired() -> bool:
                auth = _status(daemon.address)["auth"]
                return auth["data_timeouts"] > 0 and \
                    _status(daemon.address)["served"]["active_connections"] <= 4 + 2
            until("the idle connections to be closed at the handshake deadline", expired,
                  deadline * 10)
            busy = sum(proc.cpu_times()[:2]) - cpu0
            elapsed = time.monotonic() - t0
            report = _status(daemon.address)
            served = report["served"]
            print(f"{flood} idle connections: daemon CPU {busy:.2f} s in {elapsed:.1f} s, "
                  f"{served}, auth {report['auth']}")
            assert served["capacity_closes"] > 0 and served["max_connections"] == cap
            assert busy < 0.5 * elapsed + 1.0, "the data server spins"
            for slab in range(4):                   # the device's pages, intact
                assert dev.read(slab * MiB, PAGE) == _pages(slab, 1)
            assert proc.is_running()
    finally:
        for s in conns:
            s.close()
        daemon.stop()


REQ = struct.Struct("<IHHQIQQ")     # isw_proto.h: magic, version, op, offset, length, id, gen
REP = struct.Struct("<IiQ")         # magic, status, id


def _read_reply(s: socket.socket, req_id: int) -> int:
    """Send a READ past the end of the store on proven connection ``s``: its reply's status."""
    s.sendall(REQ.pack(lib.ISW_PROTO_MAGIC, lib.ISW_PROTO_VERSION, lib.ISW_OP_READ, 1 << 40,
                       PAGE, req_id, 1))
    magic, status, got = REP.unpack(s.recv(REP.size, socket.MSG_WAITALL))
    assert (magic, got) == (lib.ISW_PROTO_REPLY_MAGIC, req_id)
    return status


def test_data_server_backs_off_when_out_of_descriptors(tmp_path):
    nofile, deadline, flood = 64, 1.0, 200
    cap = 4 * nofile                        # out of reach: the descriptors run out first
    pause_s = lib.ISW_ACCEPT_PAUSE_MS / 1000
    daemon = DaemonProcess(slab_size=MiB, capacity=8 * MiB, period=0.1, timeout=2.0,
                           emulate_usage=False,     # it reads /proc/meminfo: held open
                           popen=_nofile_limit(nofile),
                           extra=["--data-max-connections", str(cap),
                                  "--data-handshake-timeout", str(deadline)])
    daemon.start()
    ctl = None
    proven: list[socket.socket] = []
    queued: list[socket.socket] = []
    try:
        proc = psutil.Process(daemon.pid)
        ctl = ControlPeer(daemon.address)       # connected now: STATUS needs no new descriptor
        assert ctl.status()["served"]["max_connections"] == cap

        # 1. connections that prove the key take every descriptor; the one that takes the
        #    last keeps it (Linux fails the next accept with EMFILE though nobody waits)
        with pytest.raises(TimeoutError):
            for _ in range(nofile):
                proven.append(proven_data_connection(daemon.data_address, timeout=1.0))
        assert len(proven) > nofile // 2 and proc.num_fds() >= nofile - 1
        report = ctl.status()
        served = report["served"]
        assert served["active_connections"] == len(proven) == report["auth"]["data_proven"]
        assert served["capacity_closes"] == 0 and report["auth"]["data_refusals"] == 0
        assert served["accept_pauses"] > 0

        # 2. a flood queues behind them: the server backs off, does not spin, and keeps
        #    serving its connections
        host, port = daemon.data_address.rsplit(":", 1)
        addr = (host, int(port))
        for _ in range(flood):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(addr)
            except BlockingIOError:
                pass
            queued.append(s)
        pauses0, cpu0, t0 = served["accept_pauses"], sum(proc.cpu_times()[:2]), time.monotonic()
        while time.monotonic() - t0 < 3.0:          # the window the CPU time is measured over
            for i, s in enumerate(proven[:4]):      # answered: an error, no such region
                assert _read_reply(s, i + 1) < 0
            assert ctl.status()["served"]["active_connections"] == len(proven)
            time.sleep(0.25)
        busy = sum(proc.cpu_times()[:2]) - cpu0
        elapsed = time.monotonic() - t0
        served = ctl.status()["served"]
        pauses = served["accept_pauses"] - pauses0
        print(f"out of descriptors ({len(proven)} proven, {flood} queued): daemon CPU "
              f"{busy:.2f} s in {elapsed:.1f} s, {pauses} pauses, {served}")
        assert busy < 0.25 * elapsed, "the data server spins while out of descriptors"
        # it keeps trying (a pause ends), at most once per worker per pause
        assert 2 <= pauses <= 2 * (elapsed / pause_s + 1)
        assert served["capacity_closes"] == 0 and proc.is_running()

        # 3. the proven connections go: the queued ones take the descriptors, and each one
        #    still waiting closes the oldest that has not proved the key (the cap is far)
        for s in proven:
            s.close()
        until("the server to close unproven connections for want of descriptors",
              lambda: ctl.status()["served"]["capacity_closes"] > 0, 10)
        served = ctl.status()["served"]
        assert served["active_connections"] < nofile < served["max_connections"]

        # 4. the flood goes: a device connects and pages through the data server
        for s in queued:
            s.close()
        until("the flood's connections to be closed",
              lambda: ctl.status()["served"]["active_connections"] == 0, deadline * 10)
        with Device(4 * MiB, backup=tmp_path / "victim", daemons=[daemon.address],
                    slab_size=MiB, transport="tcp", hot_slab=1e12, period=0.2) as dev:
            assert dev.map_now() == 4
            for slab in range(4):
                dev.write(slab * MiB, _pages(slab, 8))
            for slab in range(4):
                assert dev.read(slab * MiB, 8 * PAGE) == _pages(slab, 8)
            assert dev.stats()["io"]["remote_errors"] == 0
        served = ctl.status()["served"]
        assert served["tcp_bytes_read"] >= 4 * 8 * PAGE and proc.is_running()

        # 5. the log says so once (once a minute at most), not once per pause; the memory
        #    monitor read the machine's memory use all along
        with open(daemon.log_path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        pause_lines = [line for line in lines if "paused accepting" in line]
        print("\n".join(line for line in lines if "infiniswap.daemon" in line))
        assert len(pause_lines) == 1 and "Too many open files" in pause_lines[0], pause_lines
        assert not [line for line in lines if "cannot read memory usage" in line]
        assert not [line for line in lines if "Traceback" in line]
    finally:
        for s in proven + queued:
            s.close()
        if ctl is not None:
            ctl.close()
        daemon.stop()


def test_meminfo_is_read_without_a_new_descriptor():
    """The daemon's memory reading (infiniswap/meminfo.py): the pure parse, and a MemInfo
    opened before the process ran out of descriptors still reads (psutil could not)."""
    text = b"MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:  600 kB\n"
    assert parse_meminfo(text) == (1000 * 1024, 600 * 1024)
    for bad in (b"MemTotal:  1000 kB\n", b"MemTotal: x kB\nMemAvailable: 1 kB\n",
                b"MemTotal: 1 MB\nMemAvailable: 1 kB\n"):
        with pytest.raises(ValueError):
            parse_meminfo(bad)
    child = ("import os, resource, psutil\n"
             "from infiniswap.meminfo import MemInfo\n"
             "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
             "m = MemInfo()\n"
             "held = []\n"
             "try:\n"
             "    while True: held.append(os.open('/dev/null', os.O_RDONLY))\n"
             "except OSError as e: assert e.errno == 24\n"
             "try:\n"
             "    psutil.virtual_memory(); raise SystemExit('psutil read it')\n"
             "except OSError: pass\n"
             "print(m.used())\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    vm = psutil.virtual_memory()
    assert 0 < int(out.stdout) <= vm.total
    with contextlib.closing(MemInfo()) as m:       # what psutil says, give or take
        assert abs(m.used() - (vm.total - vm.available)) < vm.total // 10
