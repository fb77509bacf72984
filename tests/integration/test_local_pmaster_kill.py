"""Training under ``autops local`` survives pMaster's SIGKILL, bit for bit.

The real command runs a two-rank torch job (``pmaster_kill_worker.py``: 10 deterministic Adam
steps, ``sum`` or ``server`` mode) against the pool it makes; pMaster's local provider starts
the job's two aggregators. After step 3 the ranks wait on a file while the test SIGKILLs
pMaster. Without a restart the rest of the run goes on without it; with one, the test starts
pMaster again on the same address and state directory after step 6 (the same command line
and environment) and lets the ranks go on once they joined it again. Either way the final
parameters of both ranks must equal an uninterrupted run's exactly, and when the command ends
no aggregator of the pool may be left running: ``autops local`` stops the ones a dead pMaster
left behind, found by their records in the state directory.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from autops.master import poolfiles
from autops.admin import query_status
from dlrt.procs import stop_processes
from waiting import until
from ports import free_port

HERE = pathlib.Path(__file__).parent
RUN_TIMEOUT_S = 90


def autops_local(mode: str, out: pathlib.Path, pause_at: str = "") -> subprocess.Popen:
    env = {**os.environ, "PAUSE_AT": pause_at, "AUTOPS_LOG": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "autops.cli", "local", "--aggregators", "2", "--",
                             sys.executable, str(HERE / "pmaster_kill_worker.py"), mode, str(out)],
                            env=env, cwd=HERE, stdin=subprocess.DEVNULL)


def reached(out: pathlib.Path, step: int) -> bool:
    return all((out / f"at-{step}-r{rank}").exists() for rank in range(2))


def pmaster_of(local: subprocess.Popen) -> psutil.Process | None:
    """The pMaster process ``autops local`` started (its child whose command is ``master``)."""
    for child in psutil.Process(local.pid).children():
        try:
            if "master" in child.cmdline():
                return child
        except psutil.Error:
            pass
    return None


def option(cmdline: list[str], name: str) -> str:
    return cmdline[cmdline.index(name) + 1]


def results(out: pathlib.Path) -> list[dict]:
    return [dict(np.load(out / f"r{rank}.npz")) for rank in range(2)]


def assert_bit_identical(got: list[dict], want: list[dict]) -> None:
    for rank in range(2):
        assert sorted(got[rank]) == sorted(want[rank])
        for name, value in want[rank].items():
            assert np.array_equal(got[rank][name], value), f"rank {rank}, {name}: differs from the uninterrupted run"
            assert np.array_equal(got[rank][name], got[0][name]), f"{name}: the ranks differ"


_references: dict[str, list[dict]] = {}


@pytest.fixture
def reference(tmp_path_factory):
    """The uninterrupted run's parameters, per mode (computed once)."""
    def get(mode: str) -> list[dict]:
        if mode not in _references:
            out = tmp_path_factory.mktemp(f"reference-{mode}")
            local = autops_local(mode, out)
            assert local.wait(RUN_TIMEOUT_S) == 0
            _references[mode] = results(out)
        return _references[mode]
    return get


@pytest.mark.parametrize("restart", [False, True], ids=["no-restart", "restart"])
@pytest.mark.parametrize("mode", ["sum", "server"])
def test_training_under_autops_local_survives_pmaster_sigkill_bit_identical(tmp_path, reference, mode, restart):
    want = reference(mode)
    local = autops_local(mode, tmp_path, pause_at="3,6")
    restarted = None
    try:
        until("step 3", lambda: reached(tmp_path, 3) or local.poll() is not None, 60)
        assert local.poll() is None, "the command ended before step 3"
        master = pmaster_of(local)
        cmdline, env = master.cmdline(), master.environ()
        state_dir, address = option(cmdline, "--state-dir"), option(cmdline, "--bind")
        aggregators = poolfiles.running(state_dir)
        assert len(aggregators) == 2, "pMaster's provider started the job's two aggregators"
        master.send_signal(signal.SIGKILL)
        until("pMaster to be gone (reaped by autops local)", lambda: not psutil.pid_exists(master.pid), 10)
        (tmp_path / "go-3").touch()                       # steps 4-6 run without pMaster
        until("step 6", lambda: reached(tmp_path, 6) or local.poll() is not None, 60)
        assert local.poll() is None, "the command ended before step 6"
        assert all(proc.is_running() for _, proc in aggregators.values()), "aggregators outlive pMaster"
        if restart:
            restarted = subprocess.Popen(cmdline, env=env, stdin=subprocess.DEVNULL)

            def rejoined():
                try:
                    status = query_status(address, timeout=1.0)
                except Exception:  # not answering yet
                    return None
                jobs = [j for j in status["jobs"] if j["ranks_joined"] == [0, 1]]
                alive = {a["id"] for a in status["aggregators"] if a["alive"]}
                return jobs and alive == set(aggregators)
            until("the ranks to join the restarted pMaster", rejoined, 30)
        (tmp_path / "go-6").touch()
        assert local.wait(RUN_TIMEOUT_S) == 0
        assert_bit_identical(results(tmp_path), want)
        # nothing of the pool is left: autops local stopped the aggregators pMaster left behind
        assert until("the aggregators to be gone",
                        lambda: not any(poolfiles.process_of(rec) for rec, _ in aggregators.values()), 10)
        if restarted is not None:
            status = query_status(address, timeout=5.0)
            assert status["jobs"] == [], "the restarted pMaster released the job when both ranks ended"
    finally:
        stop_processes([p for p in (local, restarted) if p is not None], timeout=20)


def test_a_job_that_trains_on_while_pmaster_is_killed_and_restarted_ends_right_and_is_released(tmp_path):
    """The README's pool (`autops master --provider local --state-dir`) and its example job
    under torchrun, asking for two aggregators, whose steps wait for nothing: the ranks train on
    through pMaster's SIGKILL and restart, and never register again (they need nothing from
    pMaster). The restarted pMaster adopts the job from its aggregators; the ranks' profile
    records and their exits must neither fail the job nor release it early (once, a rank's
    profile record raised in the restarted pMaster, the error reached the rank, and its exit
    released the adopted job -- whose registered ranks were none -- under the other rank), and
    it releases the job once both ranks are done. The result is the uninterrupted run's."""
    import torch
    from autops.wire.jobauth import new_job_secret
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    pmaster = [sys.executable, "-m", "autops.cli", "master", "--provider", "local", "--bind", f"127.0.0.1:{port}",
               "--state-dir", str(tmp_path / "state"), "--max-aggregators", "4", "--log-level", "WARNING"]
    env = {**os.environ, "AUTOPS_MASTER": address, "AUTOPS_AGGREGATORS": "2", "AUTOPS_JOB_SECRET": new_job_secret(),
           "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []

    def run_job(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")
        procs.append(subprocess.Popen(
            [str(pathlib.Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
             str(EXAMPLE), "--epochs", "40", "--save-params", str(tmp_path / f"{name}.pt")],
            env={**env, "AUTOPS_JOB": name}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()
        return procs[-1]

    def epoch(name: str, n: int) -> bool:
        return f"epoch {n:2d}" in (tmp_path / f"{name}.log").read_text()
    try:
        procs.append(subprocess.Popen(pmaster, stdin=subprocess.DEVNULL))
        assert run_job("reference").wait(RUN_TIMEOUT_S) == 0, (tmp_path / "reference.log").read_text()[-3000:]
        job = run_job("killed")
        until("epoch 8", lambda: epoch("killed", 8) or job.poll() is not None, 60)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        procs.append(subprocess.Popen(pmaster, stdin=subprocess.DEVNULL))
        assert not epoch("killed", 40), "the job ended before pMaster came back: make it longer"
        assert job.wait(RUN_TIMEOUT_S) == 0, (tmp_path / "killed.log").read_text()[-3000:]
        got, want = torch.load(tmp_path / "killed.pt"), torch.load(tmp_path / "reference.pt")
        assert all(torch.equal(got[name], want[name]) for name in want), "differs from the uninterrupted run"
        assert until("the restarted pMaster to release the job",
                     lambda: query_status(address, timeout=2.0)["jobs"] == [], 20)
    finally:
        stop_processes(list(reversed(procs)), timeout=20)


EXAMPLE = HERE.parents[1] / "examples" / "train_digits.py"
