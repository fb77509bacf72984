"""``dlrt.cpus``: the CPUs a process can use -- its affinity, capped by a cgroup v1 or v2 CPU
quota -- read from stand-in /proc/self/cgroup and cgroup trees."""
from __future__ import annotations

import os

import pytest

from dlrt import cpus


def cgroup_v2(tmp_path, cpu_max: str | None, path: str = "/job.slice"):
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{path}\n")
    root = tmp_path / "fs"
    (root / path.lstrip("/")).mkdir(parents=True)
    if cpu_max is not None:
        (root / path.lstrip("/") / "cpu.max").write_text(cpu_max + "\n")
    return root, proc


def cgroup_v1(tmp_path, quota: int, period: int = 100000):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    base = tmp_path / "fs" / "cpu,cpuacct" / "docker" / "abc"
    base.mkdir(parents=True)
    (base / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (base / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path / "fs", proc


@pytest.mark.parametrize("cpu_max, want", [("150000 100000", 1.5), ("max 100000", None), ("400000 100000", 4.0)])
def test_cgroup_v2_quota(tmp_path, cpu_max, want):
    assert cpus.quota_cpus(*cgroup_v2(tmp_path, cpu_max)) == want


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    assert cpus.quota_cpus(*cgroup_v1(tmp_path, 250000)) == 2.5
    (tmp_path / "unlimited").mkdir()
    assert cpus.quota_cpus(*cgroup_v1(tmp_path / "unlimited", -1)) is None


def test_no_cgroup_information_means_no_quota(tmp_path):
    assert cpus.quota_cpus(tmp_path / "none", tmp_path / "missing") is None
    assert cpus.quota_cpus(*cgroup_v2(tmp_path, None)) is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(cpus, "quota_cpus", lambda: 2.5)
    assert cpus.usable_cpus() == 3
    monkeypatch.setattr(cpus, "quota_cpus", lambda: 0.2)
    assert cpus.usable_cpus() == 1
    monkeypatch.setattr(cpus, "quota_cpus", lambda: None)
    assert cpus.usable_cpus() == 6
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})      # taskset -c 3
    assert cpus.usable_cpus() == 1
