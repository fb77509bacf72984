"""autops.torch with CUDA tensors: two worker processes train a model on the GPU through the
pool (gradients staged through pinned host buffers) and end where single-process training on
the concatenated batch ends, in both modes; and the pushpull benchmark's CUDA workers (both
systems) check their aggregate. Skipped without a CUDA device."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "integration"))
from test_torch_api import assert_like_reference, run_two_workers  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False)")


@pytest.mark.parametrize("mode, optname", [("sum", "adam"), ("server", "adam"), ("sum", "sgd")])
def test_two_gpu_workers_equal_single_process_training(pool2, tmp_path, mode, optname):
    run_two_workers("torch_worker.py", pool2.master, tmp_path, [mode, optname],
                    env=dict(os.environ, AUTOPS_TEST_DEVICE="cuda"))
    # GPU kernels round differently from the CPU reference
    assert_like_reference(tmp_path, optname, rtol=1e-4, atol=1e-5)


def test_push_pull_of_a_cuda_tensor_in_place_and_broadcast(pool1):
    import autops.torch as aps
    aps.init(master=pool1.master, job="cuda-one", rank=0, world_size=1, timeout=30, secret="cuda-one-secret-0123456789")
    try:
        t = torch.arange(10, dtype=torch.float32, device="cuda")
        out = aps.push_pull(t, "t", average=False)
        assert out.device.type == "cuda" and torch.equal(out.cpu(), torch.arange(10, dtype=torch.float32))
        params = {"w": torch.full((4,), 3.0, device="cuda")}
        aps.broadcast_parameters(params, root_rank=0)
        assert torch.equal(params["w"].cpu(), torch.full((4,), 3.0))
    finally:
        aps.shutdown()


def test_the_pushpull_benchmark_runs_both_systems_on_cuda_tensors(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "-m", "autops.cli", "bench", "pushpull", "--device", "cuda",
                          "--model", "flat64m", "--workers", "2", "--transport", "ipc", "--iters", "2",
                          "--rounds", "2", "--warmup", "1", "--json", str(out)],
                         cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    row = json.loads(out.read_text().splitlines()[0])
    assert row["device"] == "cuda" and row["autops_s"] > 0 and row["gloo_s"] > 0   # AutoPS checked the mean
