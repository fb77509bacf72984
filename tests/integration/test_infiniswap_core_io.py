"""The Infiniswap C core across processes: a daemon process owns the slab store and data server; a
device in this process maps its memory through /proc/<pid>/fd (same-host shared memory) and over
TCP.  The daemon then dies (SIGKILL), hangs (SIGSTOP) or evicts, and every page still reads back."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from infiniswap.core import PAGE_SIZE, CoreDevice, SlabState

pytestmark = pytest.mark.timeout(20)

MiB = 1 << 20
SLAB = MiB
PPS = SLAB // PAGE_SIZE

DAEMON = r"""
import json, sys
from infiniswap.core import SlabStore, DataServer
store = SlabStore(16 << 20, 1 << 20, lock=False)
srv = DataServer(store, "127.0.0.1", 0)
regions = [store.alloc_slab() for _ in range(4)]
print(json.dumps({"path": store.path(), "capacity": store.capacity, "port": srv.port(),
                  "regions": regions, "gens": [store.generation(r) for r in regions]}),
      flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "free":
        store.free_slab(int(cmd[1]))
        print(json.dumps({"allocated": store.allocated_bytes(),
                          "resident": store.resident_bytes()}), flush=True)
    elif cmd[0] == "quit":
        break
srv.stop()
store.close()
"""


class Daemon:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", DAEMON], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self.proc.stdout.readline())

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait_stopped(self, timeout: float = 5.0) -> None:
        """SIGSTOP is asynchronous: wait until every thread of the daemon is stopped."""
        deadline = time.monotonic() + timeout
        task_dir = f"/proc/{self.proc.pid}/task"
        while time.monotonic() < deadline:
            states = []
            for tid in os.listdir(task_dir):
                with open(f"{task_dir}/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            if all(s in ("T", "t") for s in states):
                return
            time.sleep(0.01)
        raise AssertionError(f"daemon {self.proc.pid} did not stop")

    def close(self) -> None:
        self.kill(signal.SIGKILL)
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.fixture
def daemon():
    d = Daemon()
    try:
        yield d
    finally:
        d.close()


def page(tag: int, version: int = 0) -> bytes:
    return (tag.to_bytes(8, "little") + version.to_bytes(8, "little")) * (PAGE_SIZE // 16)


def pages(first: int, n: int, version: int = 0) -> bytes:
    return b"".join(page(first + i, version) for i in range(n))


@pytest.fixture
def device(tmp_path):
    d = CoreDevice(6 * SLAB, SLAB, tmp_path / "backup.img", writer_threads=2)
    try:
        yield d
    finally:
        d.close()


def test_daemon_killed_reads_still_return_last_writes(daemon, device):
    info = daemon.info
    shm = device.add_remote_shm(info["path"], info["capacity"])
    tcp = device.add_remote_tcp("127.0.0.1", info["port"], connections=2, timeout=2.0)
    r, g = info["regions"], info["gens"]
    device.map_slab(1, shm, r[0], g[0])
    device.map_slab(2, tcp, r[1], g[1])
    device.map_slab(3, tcp, r[2], g[2])
    data = pages(PPS, 3 * PPS, 1)
    device.write(SLAB, data)                        # slabs 1, 2, 3 (shm, tcp, tcp)
    assert device.read(SLAB, len(data)) == data
    # The last version of slab 3's pages is still queued for disk when the daemon dies.
    device.flush()
    device.set_debug_writer_delay(1_000_000)
    newer = pages(3 * PPS, 16, 2)
    device.write(3 * SLAB, newer)
    assert device.slab_info(3).pending_disk_writes == 1
    daemon.kill()
    daemon.proc.wait(10)
    assert device.read(3 * SLAB, len(newer)) == newer       # waits for the queued write
    assert device.read(SLAB, 2 * SLAB) == data[: 2 * SLAB]  # shm: the mapping outlives the daemon
    assert device.remote_dead(tcp) and not device.remote_dead(shm)
    assert sorted(device.failed_slabs()) == [2, 3]
    assert device.unmap_remote(tcp) == 2
    device.set_debug_writer_delay(0)
    assert device.read(SLAB, len(data)) == data[: 2 * SLAB] + newer + data[2 * SLAB + len(newer):]
    s = device.stats()
    assert s.remote_errors >= 1 and s.pending_disk_writes == 0


def test_hung_daemon_times_out_instead_of_hanging(daemon, device):
    info = daemon.info
    tcp = device.add_remote_tcp("127.0.0.1", info["port"], connections=1, timeout=0.5)
    device.map_slab(0, tcp, info["regions"][0], info["gens"][0])
    device.write(0, pages(0, 4, 1))
    daemon.kill(signal.SIGSTOP)
    try:
        daemon.wait_stopped()
        t0 = time.monotonic()
        device.write(0, pages(0, 4, 2))             # times out, then goes to disk
        assert device.read(0, 4 * PAGE_SIZE) == pages(0, 4, 2)
        assert time.monotonic() - t0 < 5
        assert device.remote_dead(tcp) and "timed out" in device.remote_error(tcp)
        assert device.failed_slabs() == [0]
    finally:
        daemon.kill(signal.SIGCONT)


def test_eviction_then_daemon_releases_memory(daemon, device):
    info = daemon.info
    shm = device.add_remote_shm(info["path"], info["capacity"])
    r, g = info["regions"], info["gens"]
    device.map_slab(0, shm, r[0], g[0])
    device.map_slab(1, shm, r[1], g[1])
    data = pages(0, 2 * PPS, 3)
    device.write(0, data)
    assert device.slab_info(0).bits_set == PPS
    # EVICT from the daemon → device drains and unmaps (DONE) → daemon punches the slab out.
    assert device.begin_evict(0) is True
    assert device.slab_info(0).state is SlabState.UNMAPPED
    before = daemon.ask("free %d" % r[3])           # an unmapped, never-used slab first
    after = daemon.ask("free %d" % r[0])
    assert after["allocated"] == before["allocated"] - SLAB
    assert after["resident"] <= before["resident"] - SLAB
    assert device.read(0, len(data)) == data        # slab 0 from disk, slab 1 from remote
    s = device.stats()
    assert s.bytes_read_remote == SLAB and s.bytes_read_disk == SLAB
