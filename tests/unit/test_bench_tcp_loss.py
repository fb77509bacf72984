"""The TCP loss sampler of the benchmarks (dlrt_bench/tcp_loss.py): parsing the kernel's
counter tables, differences between samples, and sampling a live process."""
import os
import socket
import time

from dlrt_bench.tcp_loss import TcpLossSampler, _tables, host_counters, softnet_drops, window_delta

SNMP_TEXT = """Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm RetransSegs OutSegs InSegs
Tcp: 1 17 9000 8000
Udp: InDatagrams
Udp: 5
"""


def test_tables_keep_the_wanted_fields_of_the_wanted_tables():
    assert _tables(SNMP_TEXT, {"Tcp": ("RetransSegs", "OutSegs", "Missing")}) == {"RetransSegs": 17, "OutSegs": 9000}
    assert _tables(SNMP_TEXT, {"Udp": ("InDatagrams",)}) == {"InDatagrams": 5}
    assert _tables(SNMP_TEXT, {"Icmp": ("InMsgs",)}) == {}


def test_softnet_drops_sum_the_second_column_over_cpus(tmp_path):
    path = tmp_path / "softnet_stat"
    path.write_text("0d5c855c 0000000a 0000005c\n0d55bc8a 00000005 00000057\n")
    assert softnet_drops(str(path)) == 15


def test_window_delta_totals_hosts_and_names_those_that_retransmitted():
    a = {"h1": {"RetransSegs": 5, "OutSegs": 100, "TCPTimeouts": 1}, "h2": {"RetransSegs": 0, "OutSegs": 50},
         "": {"softnet_drops": 3}}
    b = {"h1": {"RetransSegs": 9, "OutSegs": 300, "TCPTimeouts": 2}, "h2": {"RetransSegs": 0, "OutSegs": 80},
         "h3": {"RetransSegs": 7, "OutSegs": 7}, "": {"softnet_drops": 4}}
    d = window_delta(a, b)
    assert (d["RetransSegs"], d["OutSegs"], d["TCPTimeouts"], d["softnet_drops"]) == (4, 230, 1, 1)
    assert d["by_host"] == {"h1": {"RetransSegs": 4, "TCPTimeouts": 1}}    # h3 has no earlier sample


def test_the_sampler_sees_this_namespace_send_segments():
    sampler = TcpLossSampler({"here": os.getpid()}, interval=0.01).start()
    time.sleep(0.05)
    t0 = time.monotonic()
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            with peer:
                for _ in range(20):
                    client.sendall(b"x" * 1000)
                    peer.recv(1000)
    sampler._sample()          # one sample after the traffic for certain, whenever the thread runs
    t1 = time.monotonic()
    sampler.stop()
    assert sampler.window(t0, t1)["OutSegs"] >= 20
    assert set(host_counters(os.getpid())) >= {"RetransSegs", "OutSegs", "TCPTimeouts"}
