"""The README's AutoPS quick start as written: its clipping block, pasted into a training
step, trains two workers under `autops local -- torchrun` as one process trains the whole batch
(both modes); without synchronize() the same clip is refused."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
WORKER = pathlib.Path(__file__).with_name("readme_clip_worker.py")


def _run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, timeout=240, capture_output=True, text=True,
                          env=dict(env, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("mode", ["sum", "server"])
def test_the_clipping_block_trains_like_one_process(tmp_path, mode):
    alone = _run([sys.executable, str(WORKER), mode, str(tmp_path / "alone.npz")],
                 {k: v for k, v in os.environ.items() if k != "AUTOPS_MASTER"})
    assert alone.returncode == 0, alone.stderr[-3000:]
    both = _run([str(BIN / "autops"), "local", "--log-level", "WARNING", "--aggregators", "2", "--",
                 str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(WORKER), mode,
                 str(tmp_path / "two.npz")], dict(os.environ))
    assert both.returncode == 0, both.stdout[-3000:] + both.stderr[-3000:]
    ref, got = np.load(tmp_path / "alone.npz"), np.load(tmp_path / "two.npz")
    for name in ref.files:
        np.testing.assert_allclose(got[name], ref[name], rtol=5e-5, atol=5e-6, err_msg=name)
