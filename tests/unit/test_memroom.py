"""What an aggregator can give a job (``autops.aggregator.memroom``): the least of the host's MemAvailable
and the cgroups' limit less usage, with injected figures and cgroup trees (v1 and v2)."""
from __future__ import annotations

from autops.aggregator import memroom

G, M = 1 << 30, 1 << 20


def test_room_is_the_least_of_host_and_cgroup_less_headroom_and_outstanding_commitments():
    assert memroom.room(8 * G) == 8 * G
    assert memroom.room(8 * G, cgroup_free=1 * G) == 1 * G          # the cgroup, not the host, bounds it
    assert memroom.room(512 * M, cgroup_free=4 * G) == 512 * M
    assert memroom.room(8 * G, 1 * G, ready=256 * M, headroom=64 * M) == 1 * G + 192 * M
    # declared, not yet written: not in the host's figures, so taken off here ...
    assert memroom.room(8 * G, 2 * G, committed=1536 * M) == 512 * M
    # ... except what the process has written of it since (already counted as used)
    assert memroom.room(8 * G, 2 * G, committed=1536 * M, touched=1 * G) == 1536 * M
    assert memroom.room(8 * G, 2 * G, committed=1 * G, touched=3 * G) == 2 * G
    assert memroom.room(1 * G, committed=4 * G) == 0                  # never below 0


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "a" / "memory.max", f"{4 * G}\n")
    _write(root / "a" / "memory.current", f"{3 * G}\n")                  # 1 GiB free in the parent
    _write(root / "a" / "b" / "memory.max", f"{2 * G}\n")
    _write(root / "a" / "b" / "memory.current", f"{100 * M}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert memroom.cgroup_room(str(proc), str(root)) == 1 * G
    _write(root / "a" / "memory.max", "max\n")
    assert memroom.cgroup_room(str(proc), str(root)) == 2 * G - 100 * M
    _write(root / "a" / "b" / "memory.max", "max\n")
    assert memroom.cgroup_room(str(proc), str(root)) is None               # no limit anywhere


def test_cgroup_v2_in_a_namespace_reads_the_mount_root(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "memory\n")
    _write(root / "memory.max", f"{1 * G}\n")
    _write(root / "memory.current", f"{900 * M}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    assert memroom.cgroup_room(str(proc), str(root)) == 124 * M
    proc.write_text("0::/not/visible/here\n")
    assert memroom.cgroup_room(str(proc), str(root)) == 124 * M


def test_cgroup_v1_memory_controller(tmp_path):
    root = tmp_path / "cg"
    mem = root / "memory" / "job"
    _write(mem / "memory.limit_in_bytes", f"{1 * G}\n")
    _write(mem / "memory.usage_in_bytes", f"{256 * M}\n")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")   # v1's "no limit"
    _write(root / "memory" / "memory.usage_in_bytes", f"{5 * G}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/job\n7:memory:/job\n1:name=systemd:/job\n")
    assert memroom.cgroup_room(str(proc), str(root)) == 768 * M
    proc.write_text("12:cpu,cpuacct:/job\n")                             # no memory controller
    assert memroom.cgroup_room(str(proc), str(root)) is None
    assert memroom.cgroup_room(str(tmp_path / "absent"), str(root)) is None


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    2097152 kB\n")
    assert memroom.mem_available(str(meminfo)) == 2 * G
    assert memroom.mem_available(str(tmp_path / "absent")) > 0            # psutil's figure
    assert memroom.available() > 0
