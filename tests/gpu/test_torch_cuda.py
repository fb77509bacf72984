"""autops.torch with CUDA tensors: two worker processes train a model on the GPU through the
pool (gradients staged through pinned host buffers) and end where single-process training on
the concatenated batch ends, in both modes. Skipped without a CUDA device."""
from __future__ import annotations

import os
import pathlib
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
