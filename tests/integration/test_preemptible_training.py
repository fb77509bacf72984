"""Preemption by checkpoint, exactly: ``examples/train_digits.py`` under torchrun with 2 workers
on a real AutoPS pool stops when asked (all ranks after the same step), saves a checkpoint and
exits 0; a resumed run under a new job id ends with the parameters of an uninterrupted run.
Also the server-mode optimizer state round trip through ``DistributedOptimizer.state_dict``."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

from autops.local import LocalPool

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCHRUN = pathlib.Path(sys.executable).parent / "torchrun"
COMMON = ["--epochs", "3", "--lr-step-size", "1"]     # 21 steps per epoch per worker
MODES = {"sum": "sgd", "server": "adam"}
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def pool():
    with LocalPool(2) as p:
        yield p


@pytest.fixture(scope="module")
def uninterrupted(pool, tmp_path_factory):
    """mode -> final parameters of an uninterrupted run (computed once per mode)."""
    cache: dict[str, dict] = {}

    def get(mode: str) -> dict:
        if mode not in cache:
            out = tmp_path_factory.mktemp(f"full-{mode}") / "params.pt"
            proc = start(pool, mode, ["--save-params", str(out)], {})
            finish(proc)
            cache[mode] = torch.load(out)
        return cache[mode]
    return get


def tiresias_env(tmp_path: pathlib.Path, run: str) -> dict:
    return {"TIRESIAS_JOB_ID": "digits", "TIRESIAS_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            "TIRESIAS_STOP_FILE": str(tmp_path / "stop"), "TIRESIAS_STOPPED_FILE": str(tmp_path / f"stopped-{run}"),
            "TIRESIAS_PROGRESS_FILE": str(tmp_path / "progress")}


def reported_steps(tmp_path: pathlib.Path) -> list[int]:
    """The steps ``tiresias.job.report`` wrote (rank 0 only), every line with a finite loss."""
    lines = (tmp_path / "progress").read_text().splitlines()
    assert all(len(line.split()) == 3 and float(line.split()[2]) >= 0 for line in lines)
    return [int(line.split()[1]) for line in lines]


def start(pool: LocalPool, mode: str, args: list[str], env: dict) -> subprocess.Popen:
    """torchrun with 2 workers of the example, as a new AutoPS job, in its own process group."""
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "examples/train_digits.py",
           *COMMON, "--mode", mode, "--optimizer", MODES[mode], *args]
    full_env = dict(os.environ, AUTOPS_MASTER=pool.master, AUTOPS_JOB=f"digits-{uuid.uuid4().hex[:8]}",
                    AUTOPS_TIMEOUT="30", OMP_NUM_THREADS="1", AUTOPS_JOB_SECRET=uuid.uuid4().hex, **env)
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, on_line=None, timeout: float = 120) -> str:
    """Read ``proc``'s output to the end (``on_line`` sees each line) and check it exited 0.
    Its whole process group is killed if it overruns, or is left running by a failure."""
    watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)
        proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = "".join(lines)
    assert proc.returncode == 0, out[-4000:]
    return out


def resume_and_compare(pool, tmp_path: pathlib.Path, mode: str, stopped_at: int, expected: dict) -> float:
    out_path = tmp_path / "resumed.pt"
    out = finish(start(pool, mode, ["--save-params", str(out_path)], tiresias_env(tmp_path, "resumed")))
    assert f"resumed from step {stopped_at} " in out, out[-3000:]
    assert not (tmp_path / "stopped-resumed").exists()
    got = torch.load(out_path)
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"{mode}: stopped at step {stopped_at}, resumed; max abs difference {diff:g}")
    assert diff <= TOLERANCE
    return diff


def stopped_step(out: str) -> int:
    lines = [line for line in out.splitlines() if line.startswith("stopped at step ")]
    assert len(lines) == 1 and lines[0].endswith("(checkpoint saved)"), out[-3000:]
    return int(lines[0].split()[3])


def test_server_adam_stopped_at_a_step_and_resumed_equals_uninterrupted(pool, uninterrupted, tmp_path):
    # only rank 1 sees the request: the agreement must stop rank 0 after the same step
    out = finish(start(pool, "server", ["--stop-at-step", "30", "--stop-rank", "1"],
                       tiresias_env(tmp_path, "first")))
    assert stopped_step(out) == 30
    assert (tmp_path / "stopped-first").exists()
    assert (tmp_path / "ckpt" / "train_digits.pt").exists()
    assert "test accuracy" not in out
    assert reported_steps(tmp_path) == list(range(1, 31))          # flushed at exit, one rank
    resume_and_compare(pool, tmp_path, "server", 30, uninterrupted("server"))
    steps = reported_steps(tmp_path)
    assert steps[:30] == list(range(1, 31)) and steps[30:] == list(range(31, steps[-1] + 1))


def test_sum_sgd_preempted_by_the_stop_file_and_resumed_equals_uninterrupted(pool, uninterrupted, tmp_path):
    expected = uninterrupted("sum")
    env = tiresias_env(tmp_path, "first")
    stop_file = pathlib.Path(env["TIRESIAS_STOP_FILE"])

    def stop_after_first_epoch(line: str) -> None:     # the job has made progress: ask it to stop
        if line.startswith("epoch  1"):
            stop_file.touch()
    out = finish(start(pool, "sum", [], env), stop_after_first_epoch)
    at = stopped_step(out)
    assert 21 <= at < 63
    assert (tmp_path / "stopped-first").exists()
    stop_file.unlink()                            # the master clears the request before resuming
    resume_and_compare(pool, tmp_path, "sum", at, expected)


# --- server-mode optimizer state round trip (in this process, world size 1) ------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def _train(model, opt, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _make(optname: str, model) -> torch.optim.Optimizer:
    if optname == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)


@pytest.fixture
def aps_session():
    import autops.torch as aps

    def connect(master: str) -> None:
        aps.shutdown()
        aps.init(master=master, job=f"roundtrip-{uuid.uuid4().hex[:8]}", rank=0, world_size=1, timeout=30,
                 secret=uuid.uuid4().hex)
    yield connect
    aps.shutdown()


@pytest.mark.parametrize("optname", ["adam", "sgd"])
def test_server_optimizer_state_round_trip(pool, aps_session, optname):
    import autops.torch as aps
    batches = _batches(4)
    aps_session(pool.master)
    model = _model()
    opt = aps.DistributedOptimizer(_make(optname, model), named_parameters=model.named_parameters(), mode="server")
    _train(model, opt, batches[:3])
    saved = opt.state_dict()
    params3 = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, batches[3:])
    continued = {k: v.clone() for k, v in model.state_dict().items()}

    local_model = _model()                        # the same 3 steps with torch alone
    local_opt = _make(optname, local_model)
    _train(local_model, local_opt, batches[:3])
    local = local_opt.state_dict()
    assert set(saved["state"]) == set(local["state"]) == set(range(4))
    for i, state in local["state"].items():
        assert set(saved["state"][i]) == set(state)
        for key, value in state.items():
            np.testing.assert_allclose(saved["state"][i][key].numpy(), value.numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{optname} {key} of parameter {i}")

    with LocalPool(1) as fresh:                   # new aggregators, new job: only the checkpoint
        aps_session(fresh.master)
        model = _model()
        model.load_state_dict(params3)
        opt = aps.DistributedOptimizer(_make(optname, model), named_parameters=model.named_parameters(),
                                       mode="server")
        opt.load_state_dict(saved)
        _train(model, opt, batches[3:])
        for key, value in continued.items():
            assert torch.equal(model.state_dict()[key], value), key
        aps.shutdown()


def test_state_of_partitioned_keys_is_reassembled(pool):
    """Agent level: a tensor split into 4 keys; its fetched state equals the server optimizer's."""
    from autops.worker.agent import Agent
    from autops.aggregator.optim import make_optimizer
    hp = {"lr": 0.01}
    agent = Agent(pool.master, f"parts-{uuid.uuid4().hex[:8]}", 0, 1, mode="server", optimizer="adam", hp=hp,
                  timeout=30, partition_bytes=1024, secret=uuid.uuid4().hex)
    try:
        agent.declare([("w", (1000,), "float32")])
        assert len(agent.keys_of("w")) == 4
        rng = np.random.default_rng(0)
        param = rng.standard_normal(1000).astype(np.float32)
        agent.init("w", param, hp=hp).wait()
        reference, ref_opt = param.copy(), make_optimizer("adam", hp)
        out = np.empty_like(param)
        for it in (1, 2):
            grad = rng.standard_normal(1000).astype(np.float32)
            agent.push_pull("w", grad, out, it).wait()
            ref_opt.step(reference, grad)
        fetched = agent.fetch_state("w", 2)
        fetched.wait()
        assert fetched.step == 2
        np.testing.assert_array_equal(fetched.param, out)
        np.testing.assert_array_equal(fetched.param, reference)
        for name, arr in ref_opt.state_arrays().items():
            np.testing.assert_array_equal(fetched.state[name], arr, err_msg=name)
        stale = agent.fetch_state("w", 1)             # not the last completed iteration: refused
        with pytest.raises(Exception, match="iteration 2 is the last completed"):
            stale.wait()
    finally:
        agent.close()


def test_agreement_helpers_alone(monkeypatch):
    import autops.torch as aps
    monkeypatch.delenv("AUTOPS_MASTER", raising=False)
    aps.shutdown()
    aps.init(rank=0, world_size=1)
    try:
        t = torch.arange(3)
        assert [torch.equal(g, t) for g in aps.allgather(t, "z")] == [True]
        assert aps.any_rank(True, "x") and not aps.any_rank(False, "x")
        assert aps.any_rank_async(True, "y")()
    finally:
        aps.shutdown()


# --- elastic: --global-batch resumes at another world size (Optimus §5.4) ----------------------
def start_elastic(pool: LocalPool, workers: int, args: list[str], env: dict) -> subprocess.Popen:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(workers), "examples/train_digits.py",
           *COMMON, "--global-batch", "64", *args]
    full_env = dict(os.environ, AUTOPS_MASTER=pool.master, AUTOPS_JOB=f"elastic-{uuid.uuid4().hex[:8]}",
                    AUTOPS_TIMEOUT="30", OMP_NUM_THREADS="1", AUTOPS_JOB_SECRET=uuid.uuid4().hex, **env)
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def test_global_batch_stopped_at_two_workers_resumes_at_one(pool, tmp_path):
    full = tmp_path / "full.pt"
    finish(start_elastic(pool, 1, ["--save-params", str(full)], {}))
    env = tiresias_env(tmp_path, "first")
    out = finish(start_elastic(pool, 2, ["--stop-at-step", "25"], env))
    assert stopped_step(out) == 25
    resumed = tmp_path / "resumed.pt"
    out = finish(start_elastic(pool, 1, ["--save-params", str(resumed)], tiresias_env(tmp_path, "resumed")))
    assert "resumed from step 25 " in out, out[-3000:]
    assert "workers 1" in out
    steps = reported_steps(tmp_path)               # the same global steps, whatever the world size
    assert steps == list(range(1, 64))
    expected, got = torch.load(full), torch.load(resumed)
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    scale = max(expected[k].abs().max().item() for k in expected)
    print(f"elastic: 25 steps at 2 workers then 38 at 1; max abs difference {diff:g} of {scale:g}")
    assert diff <= 1e-3 * scale                     # the same training up to float summation order


def test_global_batch_refuses_a_checkpoint_of_another_global_batch(pool, tmp_path):
    finish(start_elastic(pool, 1, ["--stop-at-step", "3"], tiresias_env(tmp_path, "first")))
    cmd = [sys.executable, "examples/train_digits.py", *COMMON, "--global-batch", "32"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **tiresias_env(tmp_path, "again")),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "global_batch 64 (now 32)" in proc.stderr


def test_emulate_gpu_is_checked():
    proc = subprocess.run([sys.executable, "examples/train_digits.py", "--emulate-gpu", "-1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--emulate-gpu must be from 0 to 60 seconds" in proc.stderr
