"""Infiniswap across emulated hosts: the device on one host, two daemons on two others, over
TCP through links shaped to 10 Gbit/s (``dlrt_bench.testbed``).

* the daemons bind to and advertise their hosts' bridge addresses, and the device's ``auto``
  transport picks TCP for them (each emulated host has its own ``DLRT_HOST_ID``; shared
  memory would bypass the links);
* fio with crc32c verification writes and reads the device (FUSE file -> loop device) while
  one daemon is SIGKILLed, then writes all of it again and verifies it: zero errors, every
  byte read back;
* the hosts' link byte counters show the pages crossed the bridge: the device host sent and
  received at least the bytes the device moved to and from remote memory, and they reached
  the daemons' hosts;
* ``bench/infiniswap_tail_loss.py`` blacks out a link under a remote read and a remote write:
  both come through, the kernel's arm waits out its 200 ms floor, and the other arm's
  connections took the lowered floor on both ends.

Root only (network namespaces, FUSE, loop devices); skips with the reason otherwise.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

import pytest

from dlrt_bench import infiniswap_stack as demo
from dlrt_bench.infiniswap_hosts import DeviceProcess, HostCluster, verify_with_a_daemon_killed
from dlrt import tcpopts
from dlrt_bench.testbed import available, cleanup, leftovers
from testbed_fixture import prefix_for, testbed  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
SIZE = 192 * MiB                 # 12 slabs of 16 MiB
SLAB = 16 * MiB


@pytest.fixture
def workdir():
    why = demo.missing() or (None if shutil.which("fio") else "`fio` is not installed")
    if why:
        print(f"\nSKIPPED Infiniswap across hosts: {why}")
        pytest.skip(why)
    path = tempfile.mkdtemp(prefix="infiniswap-hosts-", dir=demo.DISK_DIR)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_fio_verify_across_hosts_with_a_daemon_killed(testbed, workdir):  # noqa: F811
    tb = testbed(hosts=3, link="10gbit")
    with HostCluster(tb, slab_size=SLAB, capacity=SIZE, headroom=0, period=0.2,
                     timeout=2.0) as cluster:
        for d, host in zip(cluster.daemons, cluster.daemon_hosts):
            assert d.address.startswith(f"tcp://{host.addr}:")
            assert d.data_address.startswith(f"{host.addr}:")     # what MR_INFO advertises
        with DeviceProcess(cluster, SIZE, SLAB, workdir, hot_slab=1.0) as device:
            st = device.stats()
            assert st["slabs_mapped"] == SIZE // SLAB
            placed = {a: len(s) for a, s in st["mapped"].items()}
            assert len(placed) == 2, f"slabs all on one daemon: {placed}"
            assert {d["transport"] for d in st["daemons"].values()} == {"tcp"}

            result = verify_with_a_daemon_killed(cluster, device, SIZE)

            passes = result["passes"]
            for name, p in passes.items():
                assert p["ok"], f"{name}: {p}"
            assert result["killed"] == cluster.daemons[0].address
            assert not cluster.daemons[0].running and cluster.daemons[1].running
            assert passes["verify_only"]["read_bytes"] == SIZE
            assert result["ok"]
            dev = result["device"]
            assert dev["daemon_failures"] >= 1 and dev["transports"] == ["tcp"]
            io = dev["io"]
            assert io["bytes_written_remote"] > SIZE and io["bytes_read_remote"] > SIZE // 2

            # the pages crossed the shaped links: out of the device host and into the daemon
            # hosts for writes, the other way for reads (Ethernet frames count a bit more)
            links = result["link_bytes"]
            dev_link = links[cluster.device_host.name]
            assert dev_link["sent"] >= io["bytes_written_remote"]
            assert dev_link["received"] >= io["bytes_read_remote"]
            daemon_links = [links[h.name] for h in cluster.daemon_hosts]
            assert sum(x["received"] for x in daemon_links) >= io["bytes_written_remote"]
            assert sum(x["sent"] for x in daemon_links) >= io["bytes_read_remote"]


def test_the_tail_loss_benchmark_blacks_out_reads_and_writes_and_each_arm_keeps_its_floor(tmp_path):
    reason = available()
    if reason:
        pytest.skip(f"emulated hosts unavailable: {reason}")
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
    from infiniswap_tail_loss import main as tail_loss_main
    out, prefix = tmp_path / "tail.json", prefix_for(__name__, 1)
    cleanup(prefix)
    assert tail_loss_main(["--trials", "1", "--prefix", prefix, "--json", str(out)]) == 0
    assert not leftovers(prefix)
    rows = {(r["arm"], r["direction"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {(a, d) for a in ("kernel", "links") for d in ("read", "write")}
    for (arm, _), row in rows.items():
        # the I/O could not end before the link came back
        assert row["blackout_io_ms"] >= row["at_ms"] + row["blackout_ms"]
        taken = (row["rto_min_us_taken_device"], row["rto_min_us_taken_server"])
        if arm == "kernel":
            assert taken == (0, 0)
            # every segment in flight was lost: only the timer, at 200 ms at the least, resumed
            assert row["blackout_io_ms"] >= tcpopts.KERNEL_RTO_MIN_US / 1000
        elif taken != (0, 0):                          # (0, 0): a kernel before 6.15
            assert all(tcpopts.RTO_MIN_US <= t < 2 * tcpopts.RTO_MIN_US for t in taken), taken
