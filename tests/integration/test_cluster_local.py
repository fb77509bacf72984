"""``dlrt cluster up|status|down`` without Ray: the embedded setup as a user runs it.

Real processes on loopback, each step through the command line: ``up`` starts pMaster, a
daemon and the Tiresias master wired together (the master sees the daemon's memory and runs
a job), ``status`` tells who answers, an operator's slips (a second ``up``, a service killed
with -9, a port already taken) get one line and change nothing else, and ``down`` leaves no
process behind (every process whose command line names the test's state directory).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from cluster_testlib import dlrt, ours
from ports import free_port
from waiting import until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def setup(tmp_path):
    state = str(tmp_path / "cluster")
    ports = {name: free_port() for name in ("autops", "autops_reports", "daemon", "daemon_reports", "tiresias")}
    config = tmp_path / "cluster.toml"
    config.write_text(f"""
[cluster]
state = "{state}"
start_timeout = 60
[autops]
port = {ports['autops']}
report_port = {ports['autops_reports']}
max_aggregators = 2
[infiniswap]
port = {ports['daemon']}
report_port = {ports['daemon_reports']}
headroom = "64M"
capacity = "256M"
args = ["--slab-size", "16M", "--no-lock", "--report-interval", "0.2"]
[tiresias]
port = {ports['tiresias']}
nodes = "1x2"
args = ["--interval", "0.5"]
""")
    yield str(config), state, ports
    dlrt("cluster", "down", "--config", str(config))
    for p in ours(state):                       # a failed test's leftovers, by what they name
        p.kill()


def services(out: str) -> dict[str, dict]:
    return {row["name"]: row for row in json.loads(out)["services"]}


def test_up_status_job_slips_and_down(setup, tmp_path):
    config, state, ports = setup
    began = time.monotonic()
    up = dlrt("cluster", "up", "--config", config, "--json", "-")
    assert up.returncode == 0, up.stderr
    rows = services(up.stdout)
    assert set(rows) == {"autops-master", "infiniswap-daemon", "tiresias-master"}
    assert all(r["answers"] for r in rows.values()), rows
    print(f"dlrt cluster up: {time.monotonic() - began:.1f} s")
    assert rows["tiresias-master"]["endpoint"] == f"http://127.0.0.1:{ports['tiresias']}"

    # wired: the Tiresias master shows the daemon's lendable memory on its node, and runs a job
    tiresias = [sys.executable, "-m", "tiresias.cli"]
    until("the master's node shows the daemon's memory", lambda: "256 MiB" in subprocess.run(
        tiresias + ["nodes", "--state", f"{state}/tiresias"], capture_output=True, text=True).stdout)
    marker = tmp_path / "ran"
    sub = subprocess.run(tiresias + ["submit", "--state", f"{state}/tiresias", "--gpus", "1", "--launcher", "plain",
                                     "--", sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ok')"],
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    until("the job ran", marker.exists, timeout=60)

    again = dlrt("cluster", "up", "--config", config)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [again.stderr.strip()] and "already up" in again.stderr
    assert services(dlrt("cluster", "status", "--config", config, "--json", "-").stdout).keys() == rows.keys()

    os.kill(int(rows["infiniswap-daemon"]["where"].removeprefix("pid ")), signal.SIGKILL)
    status = until("status sees the daemon gone", lambda: (lambda s: s if s.returncode == 1 else None)(
        dlrt("cluster", "status", "--config", config, "--json", "-")))
    after = services(status.stdout)
    assert not after["infiniswap-daemon"]["running"] and after["autops-master"]["answers"]

    down = dlrt("cluster", "down", "--config", config)
    assert down.returncode == 0 and "stopped tiresias-master, autops-master" in down.stdout, down.stdout
    until("nothing of the setup runs", lambda: not ours(state), timeout=20)
    assert not os.path.exists(f"{state}/cluster.json")
    nothing = dlrt("cluster", "status", "--config", config)
    assert nothing.returncode == 1 and nothing.stdout.strip() == "nothing is up"


def test_a_taken_port_is_one_line_and_nothing_stays_up(setup):
    config, state, ports = setup
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports["tiresias"]))
        taken.listen()
        up = dlrt("cluster", "up", "--config", config)
    assert up.returncode == 1
    error = up.stderr.strip().splitlines()[-1]
    assert error.startswith("dlrt cluster up: error: tiresias-master exited with code") and "log:" in error, up.stderr
    assert "autops-master: stopped" in up.stderr and "infiniswap-daemon: stopped" in up.stderr
    until("nothing of the setup runs", lambda: not ours(state), timeout=20)
    assert not os.path.exists(f"{state}/cluster.json")


def test_a_bad_config_changes_nothing(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[cluster]\nstate = "{tmp_path}/st"\n[autops]\nprot = 5\n')
    up = dlrt("cluster", "up", "--config", str(bad))
    assert up.returncode == 2
    assert up.stderr.strip() == f"dlrt cluster up: error: {bad}: unknown key 'prot' in [autops] (known: port, " \
                                "report_port, max_aggregators, ray_resource, orphan_timeout, args)"
    assert not os.path.exists(tmp_path / "st")
