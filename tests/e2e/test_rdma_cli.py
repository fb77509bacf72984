"""``--transport rdma`` on a machine without an RDMA device: every command of both systems
that takes it fails at once -- exit status 1, one line on stderr saying what to do, no
traceback, nothing started (the console scripts, as a user runs them)."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from autops.transport.rdma_verbs import RdmaUnavailable, device_names
from infiniswap import rdma as infiniswap_rdma

BIN = pathlib.Path(sys.executable).parent
NO_DEVICE = "no RDMA device found (ibv_get_device_list returned none): use --transport tcp"


def _autops_device() -> bool:
    try:
        return bool(device_names())
    except RdmaUnavailable:
        return False


pytestmark = pytest.mark.skipif(_autops_device() or infiniswap_rdma.device_count() > 0,
                                reason="an RDMA device is present: the no-device failures cannot be shown here")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv, prefix", [
    (["autops", "aggregator", "--master", "127.0.0.1:9", "--transport", "rdma"], "autops aggregator: error: "),
    (["autops", "bench", "pushpull", "--transport", "rdma", "--model", "flat64m", "--workers", "2"],
     "autops bench: error: "),
    (["infiniswap", "device", "--size", "8M", "--slab-size", "1M", "--backup", "{tmp}/backup",
      "--transport", "rdma"], "infiniswap device: error: "),
    (["infiniswap", "daemon", "--bind", "127.0.0.1:0", "--transport", "rdma"], "infiniswap daemon: error: "),
])
def test_transport_rdma_fails_at_once_with_one_line(argv, prefix, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    started = time.monotonic()
    out = _run(argv)
    lines = out.stderr.strip().splitlines()
    print(f"{' '.join(argv[:2])}: exit {out.returncode} in {time.monotonic() - started:.1f} s: {out.stderr.strip()}")
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    if argv[0] == "infiniswap" and not infiniswap_rdma.built():
        assert lines[0].startswith(prefix) and "built without libibverbs" in lines[0]
    else:
        assert lines[0] == prefix + NO_DEVICE or (argv[0] == "autops" and "pyverbs" in lines[0]), lines[0]
    assert not (tmp_path / "backup").exists()                 # the device never started


def test_an_agent_asked_for_rdma_fails_in_its_constructor():
    """Not later, in its I/O thread (whose failure there would leave the constructor waiting)."""
    from autops.worker.agent import Agent
    with pytest.raises(RdmaUnavailable, match="no RDMA device found|pyverbs"):
        Agent("127.0.0.1:9", "job", 0, 1, transport="rdma", timeout=1.0, secret="s" * 32)
