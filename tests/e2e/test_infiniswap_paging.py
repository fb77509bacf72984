"""Remote-memory paging end to end on the real kernel path: daemons (processes on loopback)
-> device (backup file on disk) -> FUSE file -> loop device (direct I/O) -> swap.

* integrity: fio random read/write with crc32c verification on /dev/loopN while one daemon
  is pushed into eviction (emulated local memory use) and another is SIGKILLed; then a
  full write and a verify-only pass: zero verify errors;
* swap: stress-ng with a verifying VM method (or the self-checking numpy workload when
  stress-ng cannot verify) in a cgroup limited to half its working set, paging to our
  device only: exit 0, no verify failures, slabs mapped and bytes written to remote memory;
* clean-up: after every test no FUSE mount, loop device, swap area or cgroup of ours is left.

Every workload runs under a watchdog (:class:`dlrt_bench.infiniswap_stack.Watchdog`): no paging
progress (FUSE requests, pswpin/pswpout) for 30 s -> SIGKILL by pid and the test fails,
so a deadlock fails CI instead of hanging it.  Root only; skips with the reason when FUSE,
loop devices, cgroups, fio or stress-ng are missing, or another swap area is active.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest

from dlrt_bench import infiniswap_stack as demo

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
SLAB = 16 * MiB
STALL = 30.0


def _missing() -> str | None:
    why = demo.missing()
    if why:
        return why
    for tool in ("fio", "stress-ng"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


@pytest.fixture(autouse=True)
def _require_and_check_clean():
    reason = _missing()
    if reason:
        print(f"\nSKIPPED infiniswap paging e2e tests: {reason}")
        pytest.skip(reason)
    before = _ours()
    yield
    assert _ours() == before, "left behind after the test"


def _ours() -> dict[str, list[str]]:
    """Our kernel objects: FUSE mounts, loop devices on /var/tmp files, swap areas, cgroups."""
    with open("/proc/mounts", encoding="utf-8") as fh:
        fuse = [line.split()[1] for line in fh if line.split()[2].startswith("fuse")
                and "infiniswap" in line]
    loops = []
    for name in os.listdir("/sys/block"):
        try:
            with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8") as fh:
                if "infiniswap" in fh.read():
                    loops.append(name)
        except OSError:
            continue
    from infiniswap import cgroup
    _, root = cgroup.find_hierarchy()
    parent = os.path.join(root, cgroup.PARENT)
    groups = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    groups = [g for g in groups if os.path.isdir(os.path.join(parent, g))]
    return {"fuse": fuse, "loops": sorted(loops), "swaps": demo.active_swaps(), "cgroups": groups}


def _fio(args: list[str], stack: demo.Stack, timeout: float = 90) -> dict:
    cmd = ["fio", "--name=integrity", f"--filename={stack.loop_device}", "--direct=1",
           "--bs=4k", "--ioengine=libaio", "--iodepth=16", "--verify=crc32c",
           "--verify_fatal=1", "--verify_state_save=0", f"--size={stack.size}", "--output-format=json"] + args
    rc, out, err, fired = demo.run_watched(cmd, stack.progress, STALL, timeout)
    assert not fired, fired
    assert rc == 0, f"fio failed ({rc}): {err[-2000:]}\n{out[-2000:]}"
    job = json.loads(out[out.index("{"):])["jobs"][0]
    assert job["error"] == 0, job
    assert job["read"]["io_bytes"] > 0
    return job


def test_fio_verify_while_a_daemon_evicts_and_another_dies():
    size = 128 * MiB                                 # 8 slabs of 16 MiB over 3 daemons
    with demo.Stack(size, SLAB, 3, daemon_capacity=64 * MiB, hot_slab=1.0) as st:
        assert st.device.map_now() == st.device.num_slabs
        placed = st.stats()["mapped"]
        assert len(placed) >= 2, f"slabs all on one daemon: {placed}"
        evicting, dying = st.daemons[0], st.daemons[1]

        def faults() -> None:
            time.sleep(1.5)
            evicting.set_usage(64 * MiB)             # no free memory left: evict everything
            time.sleep(1.5)
            dying.kill(signal.SIGKILL)

        t = threading.Thread(target=faults, daemon=True)
        t.start()
        job = _fio(["--rw=randrw", "--time_based=0", "--loops=2"], st)
        t.join()
        s = st.stats()
        assert not dying.running
        assert s["evictions"] + s["daemon_failures"] > 0, s
        assert s["io"]["bytes_written_remote"] > 0
        # write everything again (sequentially), then verify it in a separate pass
        _fio(["--rw=write", "--do_verify=1"], st)
        job = _fio(["--rw=write", "--verify_only=1"], st)
        assert job["read"]["io_bytes"] == size


def _stress_ng_verify_ok() -> bool:
    out = subprocess.run(["stress-ng", "--vm", "1", "--vm-bytes", "8M", "--vm-method",
                          "modulo-x", "--verify", "--timeout", "1s"], capture_output=True,
                         text=True, timeout=30)
    return out.returncode == 0


def test_swap_into_remote_memory():
    others = demo.active_swaps()
    if others:
        pytest.skip(f"other swap areas are active ({', '.join(others)}): the test needs ours "
                    f"to be the only one")
    work = 192 * MiB
    with demo.Stack(384 * MiB, SLAB, 3, daemon_capacity=256 * MiB, swap=True) as st:
        assert demo.active_swaps() == [st.loop_device]
        if _stress_ng_verify_ok():
            cmd = ["stress-ng", "--vm", "1", "--vm-bytes", str(work), "--vm-method",
                   "modulo-x", "--vm-keep", "--verify", "--timeout", "20s", "--metrics-brief"]
        else:                                          # the workload verifies every word
            cmd = demo.workload_cmd(work // MiB, rounds=2)
        r = demo.run_limited_watched(cmd, work // 2, st.progress, STALL, timeout=120)
        s = st.stats()
        assert not r["watchdog"], r["watchdog"]
        assert not r["timed_out"]
        text = r["stdout"] + r["stderr"]
        assert r["rc"] == 0, text[-3000:]
        assert not re.search(r"verif\w* (fail|error)|fail(ed)? verif|mismatch", text, re.I), \
            text[-3000:]
        assert s["slabs_mapped"] > 0, s
        assert s["io"]["bytes_written_remote"] > 0, s["io"]
        assert r["stats"].get("peak_bytes", 0) <= work // 2 + MiB
    assert demo.active_swaps() == []


def test_watchdog_kills_a_stalled_workload():
    """The safety net itself: a 'workload' whose progress counter never moves is killed."""
    t0 = time.monotonic()
    rc, _, _, fired = demo.run_watched(["sleep", "60"], lambda: 0, stall=2.0, timeout=30)
    assert fired and rc == -signal.SIGKILL and time.monotonic() - t0 < 10
