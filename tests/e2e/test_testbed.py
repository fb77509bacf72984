"""The emulated multi-host testbed (DESIGN §9): built, isolated, shaped, measured, removed.

Needs root (network namespaces, veths, tc); without it the testbed tests skip with the
reason. The pure parts (rate and delay parsing, the tc commands) run everywhere.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from dlrt.hostid import HOST_ID_ENV
from dlrt_bench.tcp_loss import host_counters
from dlrt_bench.testbed import (DEFAULT_CONGESTION, Testbed, TestbedError, available, cleanup, leftovers, parse_delay,
                               parse_rate, rps_mask, shaping_commands, subnet_of)
from testbed_fixture import emulated_hosts, prefix_for, testbed  # noqa: F401 (fixture)

PY = sys.executable
DLRT = str(pathlib.Path(sys.executable).parent / "dlrt")
PORT = 5270
RATE_PAYLOAD = 64 << 20          # 64 MiB through a 1 Gbit/s link: about 0.55 s

# a receiver: accepts one connection, drains it, prints {"bytes", "seconds"} (first byte to EOF)
RECEIVER = textwrap.dedent("""
    import json, socket, sys, time
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20); total = 0; start = None
    while (n := conn.recv_into(buf)):
        start = start or time.perf_counter()
        total += n
    print(json.dumps({"bytes": total, "seconds": time.perf_counter() - start}), flush=True)
""")
SENDER = textwrap.dedent("""
    import socket, sys
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    chunk = bytes(1 << 20)
    for _ in range(int(sys.argv[3]) >> 20):
        conn.sendall(chunk)
    conn.close()
""")
# an echo server (TCP, one line per connection) and a client that greets every address given
ECHO = textwrap.dedent("""
    import os, socket, sys
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.sendall(conn.recv(100) + b" " + os.environ["DLRT_HOST_ID"].encode())
        conn.close()
""")
GREET = textwrap.dedent("""
    import json, socket, sys
    replies = {}
    for addr in sys.argv[2:]:
        with socket.create_connection((addr, int(sys.argv[1])), timeout=5) as conn:
            conn.sendall(b"hello")
            replies[addr] = conn.recv(100).decode()
    try:   # no default route: anything outside the testbed's /24 is unreachable
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).connect(("192.0.2.1", 53))
        outside = "reachable"
    except OSError as exc:
        outside = exc.strerror
    print(json.dumps({"replies": replies, "outside": outside}))
""")
# UDP round trips: an echo server, and a client printing the round-trip times in microseconds
UDP_ECHO = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    while True:
        data, peer = s.recvfrom(64); s.sendto(data, peer)
""")
UDP_PING = textwrap.dedent("""
    import json, socket, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    rtts = []
    for i in range(20):
        start = time.perf_counter(); s.sendto(b"ping", (sys.argv[1], int(sys.argv[2]))); s.recvfrom(64)
        rtts.append((time.perf_counter() - start) * 1e6)
    print(json.dumps(rtts))
""")


# many TCP flows at once: ``serve ADDR PORT SECONDS`` drains every connection it accepts for
# SECONDS; ``send PORT SECONDS FLOWS ADDR...`` opens FLOWS connections to each address and
# sends over all of them for SECONDS
FLOWS = textwrap.dedent("""
    import socket, sys, threading, time
    def drain(conn):
        buf = bytearray(1 << 20)
        while conn.recv_into(buf):
            pass
    def send(addr, port, until):
        with socket.create_connection((addr, port), timeout=30) as conn:
            chunk = bytes(4 << 20)
            while time.monotonic() < until:
                conn.sendall(chunk)
    if sys.argv[1] == "serve":
        srv = socket.create_server((sys.argv[2], int(sys.argv[3])), backlog=64)
        srv.settimeout(float(sys.argv[4]))
        print("ready", flush=True)
        try:
            while True:
                threading.Thread(target=drain, args=(srv.accept()[0],), daemon=True).start()
        except socket.timeout:
            pass
    else:
        port, seconds, flows = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=send, args=(addr, port, until))
                   for addr in sys.argv[5:] for _ in range(flows)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
""")


def _started(proc: subprocess.Popen) -> subprocess.Popen:
    """``proc`` once it printed "ready" (its socket is bound)."""
    assert proc.stdout.readline().strip() == "ready", "server did not start"
    return proc


def _skip_unless_available() -> None:
    reason = available()
    if reason:
        pytest.skip(f"emulated hosts unavailable: {reason}")


def _ip_json(*args: str) -> list:
    return json.loads(subprocess.run(["ip", "-j", *args], check=True, capture_output=True, text=True).stdout)


# -------------------------------------------------------------- pure parts, no root needed

def test_rates_and_delays_parse_like_tc():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("10Gbit") == 10 * 10**9
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("125mbps") == 10**9            # tc's bps are bytes per second
    assert parse_delay("50us") == 50.0
    assert parse_delay("0.5ms") == 500.0
    for bad in ("", "fast", "1gb", "-1gbit", "0gbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    for bad in ("", "5", "1h", "0us"):
        with pytest.raises(ValueError):
            parse_delay(bad)
    with pytest.raises(ValueError):
        Testbed(2, prefix="Bad-Prefix")
    with pytest.raises(ValueError):
        Testbed(0)


def test_shaping_is_netem_over_tbf_with_a_bucket_for_gso_packets():
    """tbf alone for a rate; netem (root, this direction's share of the delay) with the tbf as
    its child when both; the bucket holds 5 ms of traffic, and two 64 KiB GSO packets at least."""
    assert shaping_commands(None, None, "eth0") == []
    (tbf,) = shaping_commands(10**9, None, "eth0")
    assert tbf[:7] == ["qdisc", "add", "dev", "eth0", "root", "handle", "1:"]
    assert tbf[7:] == ["tbf", "rate", "1000000000bit", "burst", "625000", "latency", "5ms"]
    assert shaping_commands(10 * 10**9, None, "x")[0][11] == "6250000"
    assert shaping_commands(100 * 10**6, None, "x")[0][11] == str(256 * 1024)
    netem, child = shaping_commands(10**9, 25.0, "eth0")
    assert netem[4:10] == ["root", "handle", "1:", "netem", "delay", "25.000us"]
    assert child[4:8] == ["parent", "1:1", "handle", "10:"] and child[8] == "tbf"
    (only_delay,) = shaping_commands(None, 25.0, "eth0")
    assert only_delay[7] == "netem"
    assert subnet_of("dlrt") != subnet_of("dlrt2")


def test_rps_mask_is_the_kernels_cpu_mask_text():
    assert [rps_mask(n) for n in (1, 2, 8, 32)] == ["1", "3", "ff", "ffffffff"]
    assert rps_mask(40) == "ff,ffffffff" and rps_mask(65) == "1,ffffffff,ffffffff"
    with pytest.raises(ValueError):
        rps_mask(0)


def test_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "need root" in available.__wrapped__()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda tool: None if tool == "tc" else "/usr/bin/" + tool)
    assert available.__wrapped__() == "`tc` not found (install iproute2)"


def test_a_failed_up_removes_what_it_built(monkeypatch):
    """Shaping the second host fails: ``up`` raises the command's error and leaves nothing."""
    _skip_unless_available()
    import dlrt_bench.testbed as testbed_module
    prefix = prefix_for(__name__, 5)
    cleanup(prefix)
    real_tc = testbed_module._tc

    def failing_tc(*args, netns=None):
        if netns == f"{prefix}-h1":
            real_tc("qdisc", "add", "dev", "eth0", "root", "bogus", netns=netns)
        return real_tc(*args, netns=netns)

    monkeypatch.setattr(testbed_module, "_tc", failing_tc)
    with pytest.raises(TestbedError, match=r"`tc -n .*-h1 qdisc add dev eth0 root bogus` failed \(exit \d+\): \S"):
        Testbed(3, prefix=prefix).up()
    assert leftovers(prefix) == []


# -------------------------------------------------------------- one testbed for the module

@pytest.fixture(scope="module")
def tb3():
    with emulated_hosts(3, link="1gbit", prefix=prefix_for(__name__, 9)) as tb:
        yield tb


def test_create_names_addresses_and_identities(tb3):
    prefix = tb3.prefix
    assert [h.netns for h in tb3.hosts] == [f"{prefix}-h{i}" for i in range(3)]
    assert len({h.addr for h in tb3.hosts}) == 3
    assert len({h.host_id for h in tb3.hosts}) == 3
    netns = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    for host in tb3.hosts:
        assert host.netns in netns
        link = _ip_json("link", "show", "dev", host.ifname)[0]
        assert link["master"] == tb3.bridge and link["operstate"] == "UP"
        assert len(host.ifname) <= 15 and len(tb3.bridge) <= 15
    assert Testbed.attach(prefix).link == "1gbit"
    assert Testbed.attach(prefix).congestion == DEFAULT_CONGESTION == "cubic"


# opens a connection to argv[1]:argv[2] and prints its congestion control as ``ss`` shows it
CONNECT_AND_SHOW_CC = textwrap.dedent("""
    import socket, subprocess, sys
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    port = conn.getsockname()[1]
    out = subprocess.run(["ss", "-tni", "state", "established", f"sport = :{port}"],
                         capture_output=True, text=True, check=True).stdout
    print(next(w for w in out.split() if w in sys.argv[3:]))
""")


def test_every_host_runs_the_chosen_tcp_congestion_control(tb3):
    """The kernel's default (cubic) on the connections between hosts, whatever this machine's
    root namespace runs and allows namespaces to pick."""
    offered = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
    server = tb3.hosts[1].popen([PY, "-c", ECHO, tb3.hosts[1].addr, str(PORT + 7)], stdout=subprocess.PIPE)
    try:
        assert server.stdout.readline().strip() == b"ready"
        for host in (tb3.hosts[0], tb3.hosts[2]):
            got = host.run([PY, "-c", CONNECT_AND_SHOW_CC, tb3.hosts[1].addr, str(PORT + 7), *offered],
                           capture_output=True, text=True, check=True, timeout=30).stdout.strip()
            assert got == "cubic", host.name
    finally:
        server.kill()
        server.wait(10)
    with pytest.raises(TestbedError, match="not available"):
        Testbed(2, prefix=prefix_for(__name__, 4), congestion="nosuchcc").up()
    with pytest.raises(ValueError):
        Testbed(2, congestion="cubic; reboot")


def test_addresses_only_on_the_bridge_and_no_default_route(tb3):
    """Inside: lo and eth0 only, eth0 with the host's address alone, one on-link route. Outside:
    the bridge and its ports carry no address, and no route leads into the testbed."""
    for host in tb3.hosts:
        links = json.loads(host.run(["ip", "-j", "addr", "show"], capture_output=True, text=True,
                                    check=True).stdout)
        assert sorted(link["ifname"] for link in links) == ["eth0", "lo"]
        eth0 = next(link for link in links if link["ifname"] == "eth0")
        assert [(a["family"], a["local"], a["prefixlen"]) for a in eth0["addr_info"]] == \
            [("inet", host.addr, 24)]
        assert "UP" in next(link for link in links if link["ifname"] == "lo")["flags"]
        routes = json.loads(host.run(["ip", "-j", "route", "show"], capture_output=True, text=True,
                                     check=True).stdout)
        assert [r["dst"] for r in routes] == [tb3.subnet]
        assert json.loads(host.run(["ip", "-j", "-6", "route", "show", "default"], capture_output=True,
                                   text=True, check=True).stdout or "[]") == []
    for ifname in [tb3.bridge] + [h.ifname for h in tb3.hosts]:
        assert _ip_json("addr", "show", "dev", ifname)[0]["addr_info"] == []
    route = subprocess.run(["ip", "route", "get", tb3.hosts[0].addr], capture_output=True, text=True)
    assert tb3.bridge not in route.stdout


def test_hosts_reach_each_other_and_nothing_else_with_their_own_host_ids(tb3):
    servers = [_started(h.popen([PY, "-c", ECHO, h.addr, str(PORT)], stdout=subprocess.PIPE, text=True))
               for h in tb3.hosts]
    try:
        for host in tb3.hosts:
            others = [h.addr for h in tb3.hosts if h is not host]
            out = host.run([PY, "-c", GREET, str(PORT), *others], capture_output=True, text=True,
                           timeout=60, check=True).stdout
            result = json.loads(out)
            assert result["replies"] == {h.addr: f"hello {h.host_id}" for h in tb3.hosts if h is not host}
            assert result["outside"] == "Network is unreachable"
        env_seen = {h.run(["sh", "-c", f"echo ${HOST_ID_ENV}"], capture_output=True, text=True).stdout.strip()
                    for h in tb3.hosts}
        assert env_seen == {h.host_id for h in tb3.hosts}
        assert tb3.hosts[0].env({"X": "1"})["X"] == "1"
        liar = {HOST_ID_ENV: "liar", "PATH": os.defpath + ":/usr/sbin:/sbin"}
        given = tb3.hosts[1].run(["sh", "-c", f"echo ${HOST_ID_ENV}"], env=liar, capture_output=True,
                                 text=True).stdout.strip()
        assert given == tb3.hosts[1].host_id       # a given env cannot lend another host's identity
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


def test_a_1gbit_link_measures_within_15_percent_and_the_bytes_cross_the_bridge(tb3):
    """64 MiB over TCP from host 0 to host 1 through 1 Gbit/s tbf links: the receiver's rate is
    within 15% of 1 Gbit/s, host 0's link counted the bytes going out and host 1's coming in,
    host 2's link (a bystander on the same bridge) next to nothing."""
    for host in tb3.hosts[:2]:
        for dev_args in (["tc", "-j", "qdisc", "show", "dev", host.ifname],
                         ["ip", "netns", "exec", host.netns, "tc", "-j", "qdisc", "show", "dev", "eth0"]):
            (qdisc,) = json.loads(subprocess.run(dev_args, check=True, capture_output=True, text=True).stdout)
            assert qdisc["kind"] == "tbf" and qdisc["options"]["rate"] == 10**9 // 8
    src, dst, bystander = tb3.hosts
    before = {h.name: tb3.counters(h) for h in tb3.hosts}
    receiver = _started(dst.popen([PY, "-c", RECEIVER, dst.addr, str(PORT + 1)], stdout=subprocess.PIPE,
                                  text=True))
    src.run([PY, "-c", SENDER, dst.addr, str(PORT + 1), str(RATE_PAYLOAD)], timeout=60, check=True)
    result = json.loads(receiver.communicate(timeout=60)[0])
    after = {h.name: tb3.counters(h) for h in tb3.hosts}
    assert result["bytes"] == RATE_PAYLOAD
    rate = result["bytes"] * 8 / result["seconds"]
    assert 0.85e9 <= rate <= 1.15e9, f"{rate / 1e9:.3f} Gbit/s through a 1gbit link"
    assert after[src.name].sent - before[src.name].sent >= RATE_PAYLOAD
    assert after[dst.name].received - before[dst.name].received >= RATE_PAYLOAD
    moved = sum(after[bystander.name]) - sum(before[bystander.name])
    assert moved < RATE_PAYLOAD // 1000


def test_both_ends_of_every_link_steer_received_packets_over_all_cpus(tb3):
    everyone = int(rps_mask(os.cpu_count() or 1).replace(",", ""), 16)
    for host in tb3.hosts:
        inside = host.run(["sh", "-c", "cat /sys/class/net/eth0/queues/rx-*/rps_cpus"], capture_output=True,
                          text=True, check=True).stdout.split()
        outside = [q.read_text() for q in pathlib.Path(f"/sys/class/net/{host.ifname}/queues").glob("rx-*/rps_cpus")]
        assert inside and outside
        assert {int(m.replace(",", ""), 16) for m in inside + outside} == {everyone}, host.name
    assert tb3.rps and Testbed.attach(tb3.prefix).rps


def test_links_keep_each_flows_packets_in_order_under_load(testbed):
    """Four hosts at 10 Gbit/s, each sending over four connections to every other host for 3 s,
    so both CPUs handle packets of every link: the senders' TCP sees its packets reordered
    (``TCPSACKReorder``) next to never. Without receive steering on the veths it saw that
    hundreds of times in such a run (649 in one), and nearly every retransmission was answered by a D-SACK
    (the segment had arrived after all)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: nothing to reorder packets between")
    tb = testbed(hosts=4, link="10gbit")
    port, seconds = PORT + 3, 3.0
    servers = [_started(h.popen([PY, "-c", FLOWS, "serve", h.addr, str(port), str(seconds + 5)],
                                stdout=subprocess.PIPE, text=True)) for h in tb.hosts]
    try:      # each host's counters, read through the server running in it
        before = {s.pid: host_counters(s.pid) for s in servers}
        senders = [h.popen([PY, "-c", FLOWS, "send", str(port), str(seconds), "4",
                            *[o.addr for o in tb.hosts if o is not h]]) for h in tb.hosts]
        assert [p.wait(60) for p in senders] == [0] * len(senders)
        grew = {name: sum(host_counters(pid)[name] - counters[name] for pid, counters in before.items())
                for name in ("TCPSACKReorder", "OutSegs", "RetransSegs")}
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
    assert grew["OutSegs"] > 100_000, grew                     # the flows did run
    assert grew["TCPSACKReorder"] <= 5, grew


def test_processes_are_tracked_and_stopped_by_down():
    """down() ends what popen started (with its process group: the shell's child too), and
    also what runs in the namespaces without having been started through the testbed."""
    _skip_unless_available()
    prefix = prefix_for(__name__, 8)
    cleanup(prefix)
    tb = Testbed(2, link=None, prefix=prefix).up()
    try:
        shell = tb.hosts[0].popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        child = int(shell.stdout.readline())
        stray = subprocess.Popen(["ip", "netns", "exec", tb.hosts[1].netns, "sleep", "300"])
        assert child in tb.pids(0)
        deadline = time.monotonic() + 10          # `ip netns exec` enters the namespace, then execs
        while set(tb.pids(1)) != {stray.pid} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(tb.pids(1)) == {stray.pid}
        removed = tb.down()
        assert f"netns {prefix}-h0" in removed and f"link {prefix}-br" in removed
        assert shell.poll() is not None and stray.wait(5) == -signal.SIGKILL
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert leftovers(prefix) == []
        with pytest.raises(TestbedError, match="no testbed"):
            Testbed.attach(prefix)
    finally:
        tb.down()


def test_link_delay_shows_in_round_trips(testbed):
    """netem halves the delay per host link and direction: host to host takes ``delay`` one way,
    so a round trip takes about twice the delay (skips where the kernel has no netem)."""
    tb = testbed(hosts=2, link=None, delay="2ms")
    a, b = tb.hosts
    server = _started(b.popen([PY, "-c", UDP_ECHO, b.addr, str(PORT + 2)], stdout=subprocess.PIPE, text=True))
    rtts = json.loads(a.run([PY, "-c", UDP_PING, b.addr, str(PORT + 2)], capture_output=True, text=True,
                            timeout=60, check=True).stdout)
    server.kill()
    assert min(rtts) >= 4000 * 0.95, rtts
    assert sorted(rtts)[len(rtts) // 2] < 4000 + 4000, rtts


def test_cleanup_removes_what_a_sigkilled_owner_left():
    """A process builds a testbed, starts a process in a host and is SIGKILLed: the namespaces,
    links and the process stay; ``cleanup(prefix)`` removes them all."""
    _skip_unless_available()
    prefix = prefix_for(__name__, 7)
    cleanup(prefix)
    owner = subprocess.Popen([PY, "-c", textwrap.dedent(f"""
        import subprocess, time
        from dlrt_bench.testbed import Testbed
        tb = Testbed(2, link="1gbit", prefix={prefix!r}).up()
        tb.hosts[1].popen(["sleep", "300"])
        print("ready", flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        _started(owner)
        owner.kill()
        owner.wait()
        left = leftovers(prefix)
        assert sorted(left) == sorted([f"netns {prefix}-h0", f"netns {prefix}-h1", f"link {prefix}-br",
                                       f"link {prefix}-v0", f"link {prefix}-v1"])
        (sleeper,) = Testbed.attach(prefix).pids(1)
        assert psutil.Process(sleeper).cmdline()[:1] == ["sleep"]
        assert sorted(cleanup(prefix)) == sorted(left)
        assert leftovers(prefix) == []
        assert not psutil.pid_exists(sleeper) or psutil.Process(sleeper).status() == psutil.STATUS_ZOMBIE
        netns = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
        assert f"{prefix}-" not in netns and f"{prefix}-" not in links
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        cleanup(prefix)


def _dlrt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DLRT, "testbed", *args], capture_output=True, text=True, timeout=60)


def test_cli_round_trip():
    """``dlrt testbed up`` leaves the hosts up, ``status`` and ``exec`` find them, ``down``
    removes them; a second ``up`` and a ``status`` of nothing fail with one line."""
    _skip_unless_available()
    prefix = prefix_for(__name__, 6)
    cleanup(prefix)
    try:
        up = _dlrt("up", "--hosts", "2", "--link", "1gbit", "--prefix", prefix, "--congestion", "reno",
                   "--rps", "off", "--json", "-")
        assert up.returncode == 0, up.stderr
        assert json.loads(up.stdout)["congestion"] == "reno"
        hosts = json.loads(up.stdout)["hosts"]
        assert [h["name"] for h in hosts] == [f"{prefix}-h0", f"{prefix}-h1"]
        again = _dlrt("up", "--hosts", "2", "--prefix", prefix)
        assert again.returncode == 1 and again.stderr.count("\n") == 1 and "exists already" in again.stderr
        shown = _dlrt("exec", "h1", "--prefix", prefix, "--", "sh", "-c",
                      f"echo ${HOST_ID_ENV}; ip -4 -o addr show dev eth0; exit 3")
        assert shown.returncode == 3
        assert shown.stdout.splitlines()[0] == hosts[1]["host_id"]
        assert f" {hosts[1]['addr']}/24 " in shown.stdout
        missing = _dlrt("exec", "--prefix", prefix, "0", "true", "x")
        assert missing.returncode == 2 and "after '--'" in missing.stderr
        status = _dlrt("status", "--prefix", prefix, "--json", "-")
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["link"] == "1gbit" and [h["addr"] for h in data["hosts"]] == [h["addr"] for h in hosts]
        assert data["congestion"] == "reno" and data["rps"] is False    # read back from the bridge's alias
        unsteered = _dlrt("exec", "h0", "--prefix", prefix, "--", "sh", "-c",
                          "cat /sys/class/net/eth0/queues/rx-*/rps_cpus")
        assert {int(m.replace(",", ""), 16) for m in unsteered.stdout.split()} == {0}
        assert all(h["pids"] == [] and h["sent_bytes"] >= 0 for h in data["hosts"])
        dark = _dlrt("blackout", "h1", "--ms", "20", "--prefix", prefix, "--json", "-")
        assert dark.returncode == 0, dark.stderr
        assert json.loads(dark.stdout) == {"prefix": prefix, "host": f"{prefix}-h1", "ms": 20.0}
        restored = _qdisc(f"{prefix}-v1")                 # it returns once the shaping is back
        assert restored["kind"] == "tbf" and restored["options"]["rate"] == 10**9 // 8
        down = _dlrt("down", "--prefix", prefix, "--json", "-")
        assert down.returncode == 0 and f"netns {prefix}-h1" in json.loads(down.stdout)["removed"]
        assert leftovers(prefix) == []
        gone = _dlrt("status", "--prefix", prefix)
        assert gone.returncode == 1 and gone.stderr.startswith("dlrt testbed status: error: no testbed")
    finally:
        cleanup(prefix)


UDP_BURST = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(50):
    s.sendto(b"x" * 1000, (sys.argv[1], int(sys.argv[2])))
"""


def _qdisc(ifname: str) -> dict:
    (qdisc,) = json.loads(subprocess.run(["tc", "-s", "-j", "qdisc", "show", "dev", ifname], check=True,
                                         capture_output=True, text=True).stdout)
    return qdisc


def test_a_blackout_drops_everything_to_a_host_and_then_restores_its_shaping(tb3):
    src, dst, _ = tb3.hosts
    timer = tb3.blackout(dst, 30.0)
    try:
        dark = _qdisc(dst.ifname)
        assert (dark["kind"], dark["options"]["limit"]) == ("pfifo", 0)
        src.run([PY, "-c", UDP_BURST, dst.addr, str(PORT + 2)], timeout=30, check=True)
        assert _qdisc(dst.ifname)["drops"] >= 50      # every datagram to the host was dropped
        assert _qdisc(src.ifname)["kind"] == "tbf"    # the other hosts' links are untouched
    finally:
        timer.cancel()
        timer.function()                              # restore now rather than in 30 s
    back = _qdisc(dst.ifname)
    assert back["kind"] == "tbf" and back["options"]["rate"] == 10**9 // 8
