"""autops.torch against one process on the whole batch, for what real scripts do between
backward() and step() (Horovod's test_torch.py is the checklist): clipping after
synchronize() and by the clip_grad_norm option, gradient accumulation, param groups, LR
schedules, frozen layers, parameters unused in some steps, state_dict() mid-training,
optimizer-state broadcast, GradScaler with a skipped step, two models with the same names,
gradients thrown away by zero_grad(), sparse embeddings; W=2 and W=3, sum and server mode.
And the slips those scripts make, each refused with an error that says what to do."""
from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from autops.wire.jobauth import new_job_secret

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from conformance_idioms import _batches, _model, idioms_for, reference  # noqa: E402


@functools.lru_cache(maxsize=None)
def expected(name: str) -> dict:
    return reference(name)


def run_workers(master: str, world: int, mode: str, tmp_path) -> list[dict]:
    job = f"conformance-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, AUTOPS_JOB_SECRET=new_job_secret())
    outs = [tmp_path / f"r{r}.npz" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "conformance_worker.py"), master, job, str(r),
                               str(world), mode, str(outs[r])], env=env, cwd=HERE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-4000:]}"
    return [dict(np.load(o)) for o in outs]


@pytest.mark.parametrize("world, mode", [(2, "sum"), (3, "sum"), (2, "server"), (3, "server")])
def test_idioms_train_like_one_process_on_the_whole_batch(pool2, tmp_path, world, mode):
    ranks = run_workers(pool2.master, world, mode, tmp_path)
    wrong = []
    for name in idioms_for(mode):
        for param, value in expected(name).items():
            for r, got in enumerate(ranks):
                have = got[f"{name}/{param}"]
                if not np.allclose(have, value, rtol=5e-5, atol=5e-6):
                    wrong.append(f"{name}: {param} on rank {r} off by {np.abs(have - value).max():.3g}")
    assert not wrong, "\n".join(wrong)


# --- the slips, refused ----------------------------------------------------------------------
@pytest.fixture
def one_worker(pool1):
    import autops.torch as aps
    aps.init(master=pool1.master, job=f"slips-{uuid.uuid4().hex[:6]}", rank=0, world_size=1, timeout=30,
             secret=new_job_secret())
    try:
        yield aps
    finally:
        aps.shutdown()


def _backward(model) -> None:
    x, y = next(_batches(0))
    torch.nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("mode, hint", [("sum", "synchronize()"), ("server", "clip_grad_norm=")])
def test_clipping_before_synchronize_is_refused(one_worker, mode, hint):
    model = _model(0)
    opt = one_worker.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), mode=mode)
    _backward(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with pytest.raises(one_worker.AutoPSError, match="changed after backward") as err:
        opt.step()
    assert hint in str(err.value)


def test_server_mode_clipping_after_synchronize_without_averaged_grads_is_refused(one_worker):
    model = _model(0)
    opt = one_worker.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), mode="server")
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with pytest.raises(one_worker.AutoPSError, match="averaged_grads=True"):
        with opt.skip_synchronize():
            opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "nothing applied"


def test_a_second_backward_without_accumulation_names_the_option(one_worker):
    model = _model(0)
    one_worker.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters())
    _backward(model)
    with pytest.raises(one_worker.AutoPSError, match="backward_passes_per_step"):
        _backward(model)


def test_a_sparse_gradient_without_sparse_as_dense_is_refused_in_backward(one_worker):
    model = torch.nn.Embedding(10, 4, sparse=True)
    one_worker.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters())
    with pytest.raises(one_worker.AutoPSError, match="sparse_as_dense=True"):
        model(torch.tensor([1, 2])).sum().backward()


def test_two_optimizers_with_the_same_names_are_refused_with_the_names(one_worker):
    gen, disc = _model(0), _model(1)
    one_worker.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), named_parameters=gen.named_parameters())
    with pytest.raises(ValueError, match=r"'0\.weight'.*prefix=") as refused:
        one_worker.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters())
    assert "~" not in str(refused.value), "only the names the script gave"
    one_worker.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                    named_parameters=disc.named_parameters(), prefix="disc.")


def test_step_in_skip_synchronize_without_synchronize_is_refused(one_worker):
    model = _model(0)
    opt = one_worker.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters())
    _backward(model)
    with pytest.raises(one_worker.AutoPSError, match="before synchronize"):
        with opt.skip_synchronize():
            opt.step()


def test_server_mode_gradients_thrown_away_by_zero_grad_are_refused(one_worker):
    model = _model(0)
    opt = one_worker.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), mode="server")
    _backward(model)
    with pytest.raises(one_worker.AutoPSError, match="requires_grad_"):
        opt.zero_grad()


def test_the_idioms_train_alone_without_a_service(monkeypatch):
    """World size 1 and no AUTOPS_MASTER: the same scripts, options included, train locally."""
    import autops.torch as aps
    from conformance_idioms import IDIOMS, Run
    monkeypatch.delenv("AUTOPS_MASTER", raising=False)
    aps.init(world_size=1)
    try:
        for name in idioms_for("sum"):
            wrap = lambda opt, model, **options: aps.DistributedOptimizer(  # noqa: E731
                opt, named_parameters=model.named_parameters(), **options)
            got = IDIOMS[name](Run(wrap=wrap, mode="sum"))
            for param, value in expected(name).items():
                np.testing.assert_allclose(got[param], value, rtol=1e-6, atol=1e-7, err_msg=f"{name} {param}")
    finally:
        aps.shutdown()
