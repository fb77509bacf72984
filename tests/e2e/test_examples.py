"""End to end through the command line: `autops local -- torchrun ... train_digits.py`, and the
demos `make demo` runs from examples/."""
from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def run(cmd, timeout=300, **kw):
    return subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), **kw)


def _cma_unavailable() -> str | None:
    from autops.transport.cma import available
    return available()


def readme_local_commands() -> list[str]:
    """The README quick start's `autops local ... train_digits.py` command lines, as written."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line.split("  #")[0].strip() for line in lines
            if line.startswith("autops local ") and "examples/train_digits.py" in line]


def _as_run(command: str) -> list[str]:
    """The README line with this venv's console scripts."""
    words = shlex.split(command)
    return [str(BIN / w) if w in ("autops", "torchrun") else w for w in words]


def test_the_readme_names_its_quick_start_commands():
    assert len(readme_local_commands()) >= 3


@pytest.mark.parametrize("command", readme_local_commands(),
                         ids=lambda c: c.split("train_digits.py", 1)[1].strip().replace(" ", "_") or "plain")
def test_readme_quick_start_reaches_95_percent(tmp_path, command):
    """Each quick-start line runs as written (the results file added): the plain one, server-side
    Adam, and clipping the averaged gradients (a clip before synchronize() trained at 0.11)."""
    out = tmp_path / "result.json"
    proc = run([*_as_run(command), "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    # profiled on the 2 aggregators it asked for, then packed: pMaster started them on demand
    assert result["aggregators"] and all(a.startswith("local-") for a in result["aggregators"])
    assert result["test_accuracy"] >= 0.95, result


@pytest.mark.skipif(_cma_unavailable() is not None, reason=f"cma unavailable: {_cma_unavailable()}")
def test_torchrun_example_over_cma_reaches_95_percent(tmp_path):
    """With ``--transport cma`` the local provider starts its aggregators listening on cma and
    the workers reach them there."""
    out = tmp_path / "result.json"
    proc = run([str(BIN / "autops"), "--log-level", "WARNING", "local", "--aggregators", "2",
                "--transport", "cma", "--",
                str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "examples/train_digits.py",
                "--mode", "sum", "--optimizer", "adam", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["transport"] == "cma"
    assert result["aggregators"] and all(a.startswith("local-") for a in result["aggregators"])
    assert result["test_accuracy"] >= 0.95, result


def test_example_trains_alone_without_a_pool(tmp_path):
    out = tmp_path / "alone.json"
    env = {k: v for k, v in os.environ.items() if k != "AUTOPS_MASTER"}
    proc = subprocess.run([sys.executable, "examples/train_digits.py", "--epochs", "6", "--json", str(out)],
                          cwd=ROOT, timeout=300, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["test_accuracy"] >= 0.95


def test_local_returns_the_command_status_and_tears_the_pool_down():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = run([str(BIN / "autops"), "local", "--log-level", "WARNING", "--aggregators", "1", "--",
                sys.executable, "-c", "import os,sys; print(os.environ['AUTOPS_MASTER']); sys.exit(3)"])
    assert proc.returncode == 3
    assert proc.stdout.strip().startswith("tcp://127.0.0.1:")
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before                       # no master or aggregator left behind


def test_status_command_prints_the_pool(pool2):
    proc = run([str(BIN / "autops"), "status", "--master", pool2.master])
    assert proc.returncode == 0, proc.stderr
    assert "agg-0" in proc.stdout and "agg-1" in proc.stdout


def test_aggregator_with_unreachable_master_exits_with_a_clear_message():
    proc = run([str(BIN / "autops"), "aggregator", "--master", "tcp://127.0.0.1:9", "--register-timeout", "1"],
               timeout=30)
    assert proc.returncode == 1
    assert "tcp://127.0.0.1:9 did not answer" in proc.stderr


def test_sigterm_to_local_stops_the_command_and_the_pool():
    import signal
    import time
    proc = subprocess.Popen([str(BIN / "autops"), "--log-level", "WARNING", "local", "--aggregators", "1", "--",
                             sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2                    # master and command (aggregators start on demand)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) != 0
        time.sleep(0.2)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()


@pytest.mark.parametrize("script", ["autops_demo.py", "infiniswap_demo.py", "tiresias_demo.py"])
def test_demo_scripts_run_from_examples(script):
    proc = run([sys.executable, f"examples/{script}", "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_makefile_demo_runs_the_three_example_stages():
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    stages = [line.split()[-1] for line in recipe.splitlines()[1:] if line.strip()]
    assert stages == ["examples/autops_demo.py", "examples/tiresias_demo.py", "examples/infiniswap_demo.py"]
    assert all((ROOT / stage).exists() for stage in stages)


@pytest.mark.slow
def test_autops_demo_packs_two_jobs_on_the_elastic_pool():
    proc = run([sys.executable, "examples/autops_demo.py"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "both jobs finished" in proc.stdout
    for job in ("digits-sgd", "digits-adam"):
        assert job in proc.stdout
