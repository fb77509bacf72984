"""``infiniswap run --memory LIMIT -- CMD``: CMD runs in a new memory-limited cgroup, the
limit holds (over it with no swap: OOM-killed, nonzero exit), CMD's status is the exit
status, a summary line goes to stderr, and the cgroup is removed afterwards.

Root with a memory cgroup controller only; skips with the reason otherwise.  No swap may
be active (an over-limit workload would page instead of being killed): skips then too.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "infiniswap.cli", "run"]
# touches N MiB and keeps it (numpy fills the pages, so they are charged)
ALLOC = "import numpy as np, sys; a = np.ones(int(sys.argv[1]) << 17); print(int(a.sum()))"


def _missing() -> str | None:
    from infiniswap import cgroup
    why = cgroup.available()
    if why:
        return why
    with open("/proc/swaps", encoding="utf-8") as fh:
        if len(fh.readlines()) > 1:
            return "swap is active on this machine: an over-limit run would page, not fail"
    return None


@pytest.fixture(autouse=True)
def _require():
    reason = _missing()
    if reason:
        print(f"\nSKIPPED infiniswap run tests: {reason}")
        pytest.skip(reason)


def _our_cgroups() -> list[str]:
    from infiniswap import cgroup
    _, root = cgroup.find_hierarchy()
    parent = os.path.join(root, cgroup.PARENT)
    if not os.path.isdir(parent):
        return []
    return [n for n in os.listdir(parent) if os.path.isdir(os.path.join(parent, n))]


def _run(limit: str, mib: int) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["--memory", limit, "--", sys.executable, "-c", ALLOC, str(mib)],
                          capture_output=True, text=True, timeout=90)


def test_under_the_limit_exits_zero_and_reports():
    before = _our_cgroups()
    out = _run("128M", 32)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(32 << 17)
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("infiniswap run: exit 0") and "peak memory" in line, line
    assert "swap-ins" in line and "swap-outs" in line
    assert _our_cgroups() == before == []


def test_over_the_limit_without_swap_is_oom_killed():
    out = _run("48M", 128)
    assert out.returncode != 0, out
    assert out.returncode == 128 + 9, out.stderr        # SIGKILL by the OOM killer
    assert "exit SIGKILL" in out.stderr
    assert _our_cgroups() == []


def test_command_status_is_passed_through():
    out = subprocess.run(CLI + ["--memory", "64M", "--", sys.executable, "-c",
                                "import sys; sys.exit(7)"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 7 and "exit 7" in out.stderr


def test_usage_errors():
    out = subprocess.run(CLI + ["--memory", "64M"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give the command" in out.stderr
    out = subprocess.run(CLI + ["--memory", "lots", "--", "true"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
