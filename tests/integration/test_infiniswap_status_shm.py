"""``infiniswap status`` counts shared-memory traffic in what a daemon served.

A device on the daemon's host reads and writes its slabs with memcpy: the daemon's CPU (and
its TCP data server) never sees those bytes, so the device reports them (``shm_read`` /
``shm_written`` on its PINGs and UNMAPs). The daemon adds them to ``served``, which the
status table shows; its TCP counts stay apart. A TCP device of the same daemon is counted
once, by the data server."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infiniswap import Device
from infiniswap.local import LocalDaemons
from infiniswap_testlib import wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
CLI = [sys.executable, "-m", "infiniswap.cli"]


def served(address: str) -> dict:
    out = subprocess.run([*CLI, "status", "--daemons", address, "--json", "-"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["daemons"][address]["served"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_status_counts_what_a_device_moved_over_each_path_once(tmp_path, transport):
    with LocalDaemons(1, slab_size=MiB, capacity=8 * MiB, headroom=0, period=0.1) as daemons:
        address = daemons.addresses[0]
        dev = Device(4 * MiB, tmp_path / "backup", daemons.addresses, slab_size=MiB, period=0.1,
                     timeout=2.0, transport=transport)
        try:
            assert dev.map_now() == 4
            assert dev.stats()["daemons"][address]["transport"] == transport
            data = os.urandom(4 * MiB)
            dev.write(0, data)
            assert dev.read(0, 4 * MiB) == data
            assert dev.read(0, 2 * MiB) == data[:2 * MiB]
            io = dev.stats()["io"]
            assert (io["bytes_written_remote"], io["bytes_read_remote"]) == (4 * MiB, 6 * MiB)
            # a PING (every 0.1 s) carries the device's counts
            wait_until(lambda: served(address)["bytes_read"] >= 6 * MiB, 20, "the daemon's served bytes")
        finally:
            dev.close()
        report = served(address)                   # the device's last UNMAP carried its final counts
        assert (report["bytes_read"], report["bytes_written"]) == (6 * MiB, 4 * MiB)
        path = "shm" if transport == "shm" else "tcp"
        other = "tcp" if transport == "shm" else "shm"
        assert (report[f"{path}_bytes_read"], report[f"{path}_bytes_written"]) == (6 * MiB, 4 * MiB)
        assert (report[f"{other}_bytes_read"], report[f"{other}_bytes_written"]) == (0, 0)
        table = subprocess.run([*CLI, "status", "--daemons", address], capture_output=True, text=True,
                               timeout=30)
        assert "10.0 MiB" in table.stdout, table.stdout        # the served column
