"""The cma verbs: READs by process_vm_readv from another real process, and what they refuse."""
from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from autops.transport import cma
from autops.transport.base import TransportError
from autops.transport.rdma_layout import ConnInfo
from autops.transport.rdma_memory import locate
from autops.transport.rdma_verbs import RdmaUnavailable, ReadOp

pytestmark = pytest.mark.skipif(cma.available() is not None, reason=f"cma unavailable: {cma.available()}")

# a process that fills 3 MiB with a known pattern, prints its pid and address, then waits
HOLDER = r"""
import os, sys, numpy as np
a = np.arange(3 << 18, dtype=np.uint32) * np.uint32(2654435761)
print(os.getpid(), a.ctypes.data, a.nbytes, flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def holder():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid, addr, nbytes = map(int, proc.stdout.readline().split())
        yield proc, pid, addr, nbytes
    finally:
        proc.kill()
        proc.wait(10)


def expected_pattern() -> np.ndarray:
    return (np.arange(3 << 18, dtype=np.uint32) * np.uint32(2654435761)).view(np.uint8)


def connected(peer_pid: int, verbs: cma.CmaVerbs | None = None) -> tuple[cma.CmaVerbs, cma.CmaQueuePair]:
    verbs = verbs or cma.CmaVerbs()
    qp = verbs.queue_pair()
    qp.connect(ConnInfo(qpn=peer_pid, psn=1, gid=verbs.host, device="cma"))
    return verbs, qp


def landing(verbs: cma.CmaVerbs, nbytes: int, writable: bool = True):
    buf = np.zeros(nbytes, np.uint8)
    addr, _ = locate(buf)
    return buf, verbs.reg_mr(addr, nbytes, writable)


def test_reads_another_process_memory_in_many_pieces(holder):
    _, pid, addr, nbytes = holder
    verbs, qp = connected(pid)
    buf, region = landing(verbs, nbytes)
    # 1536 pieces of 2 KiB, in order but landing reversed: more than one system call's iovecs
    piece = 2048
    count = nbytes // piece
    ops = [ReadOp(region.addr + (count - 1 - i) * piece, region.lkey, addr + i * piece, 0, piece)
           for i in range(count)]
    assert count > cma._IOV_MAX
    qp.read(ops)
    want = expected_pattern().reshape(count, piece)[::-1].reshape(-1)
    np.testing.assert_array_equal(buf, want)


def test_one_large_read_is_exact(holder):
    _, pid, addr, nbytes = holder
    verbs, qp = connected(pid)
    buf, region = landing(verbs, nbytes)
    qp.read([ReadOp(region.addr, region.lkey, addr, 0, nbytes)])
    np.testing.assert_array_equal(buf, expected_pattern())


def test_a_read_past_the_mapping_fails_as_a_remote_access_error(holder):
    _, pid, _, _ = holder
    verbs, qp = connected(pid)
    buf, region = landing(verbs, 4096)
    with pytest.raises(TransportError, match="not mapped"):
        qp.read([ReadOp(region.addr, region.lkey, 4096, 0, 4096)])       # page 1 is never mapped


def test_a_peer_that_is_gone_is_named(holder):
    proc, pid, addr, _ = holder
    verbs, qp = connected(pid)
    buf, region = landing(verbs, 64)
    proc.kill()
    proc.wait(10)
    with pytest.raises(TransportError, match="is gone"):
        qp.read([ReadOp(region.addr, region.lkey, addr, 0, 64)])


def test_the_landing_buffer_must_be_a_writable_registered_region():
    verbs, qp = connected(1)
    buf, region = landing(verbs, 64, writable=False)
    with pytest.raises(TransportError, match="local protection"):
        qp.read([ReadOp(region.addr, region.lkey, 0, 0, 64)])
    _, writable = landing(verbs, 64)
    with pytest.raises(TransportError, match="local protection"):
        qp.read([ReadOp(writable.addr, writable.lkey, 0, 0, 128)])           # runs past its end
    verbs.dereg_mr(writable)
    with pytest.raises(TransportError, match="local protection"):
        qp.read([ReadOp(writable.addr, writable.lkey, 0, 0, 64)])


def test_connect_refuses_another_host_and_another_device():
    verbs = cma.CmaVerbs(identity="host-a")
    qp = verbs.queue_pair()
    with pytest.raises(TransportError, match="only processes on this host"):
        qp.connect(ConnInfo(qpn=1, psn=1, gid=cma.host_digest("host-b"), device="cma"))
    with pytest.raises(TransportError, match="RDMA device 'mlx5_0'"):
        qp.connect(ConnInfo(qpn=1, psn=1, gid=verbs.host, device="mlx5_0"))
    with pytest.raises(TransportError, match="not connected"):
        qp.read([])


def test_another_pid_namespace_is_another_host(monkeypatch):
    """Containers given one DLRT_HOST_ID but their own pid namespaces: a pid would name
    another process there, so the digests differ and connect refuses."""
    here = cma.host_digest("host-a")
    monkeypatch.setattr(cma, "_pid_namespace", lambda: "pid:[1]")
    assert cma.host_digest("host-a") != here
    qp = cma.CmaVerbs(identity="host-a").queue_pair()
    with pytest.raises(TransportError, match="pid namespace"):
        qp.connect(ConnInfo(qpn=1, psn=1, gid=here, device="cma"))


def test_local_info_names_this_process_and_host():
    verbs = cma.CmaVerbs(identity="host-a")
    info = verbs.queue_pair().local_info()
    assert info.device == "cma" and info.gid == cma.host_digest("host-a")
    assert info.qpn == __import__("os").getpid()
    assert ConnInfo.from_wire(info.to_wire()) == info          # fits the HELLO's limits


def test_without_process_vm_readv_it_fails_at_once(monkeypatch):
    monkeypatch.setattr(cma, "_READV", None)
    with pytest.raises(RdmaUnavailable, match="--transport ipc"):
        cma.require_cma()
    with pytest.raises(RdmaUnavailable):
        cma.CmaVerbs()


def test_empty_reads_touch_nothing(holder):
    _, pid, _, _ = holder
    _, qp = connected(pid)
    qp.read([ReadOp(0, 0, 0, 0, 0)])       # nothing to read: no system call, no check


def test_a_short_read_resumes_where_it_stopped(monkeypatch, holder):
    """process_vm_readv may stop inside an iovec; the rest is asked for again."""
    _, pid, addr, nbytes = holder
    real = cma._READV
    calls = []

    def stingy(p, local, nl, remote, nr, flags):
        calls.append(nl)
        first = cma._IoVec.from_address(local)
        if len(calls) == 1:       # the first call delivers half of its first iovec only
            half = first.len // 2
            saved = first.len
            first.len = half
            try:
                return real(p, local, 1, remote, 1, flags)
            finally:
                first.len = saved
        return real(p, local, nl, remote, nr, flags)

    verbs, qp = connected(pid)
    buf, region = landing(verbs, nbytes)
    monkeypatch.setattr(cma, "_READV", stingy)
    third = nbytes // 3
    qp.read([ReadOp(region.addr + i * third, region.lkey, addr + i * third, 0, third) for i in range(3)])
    np.testing.assert_array_equal(buf, expected_pattern())
    assert calls == [3, 3]
    assert ctypes.sizeof(cma._IoVec) == 16


def test_yama_scopes_that_forbid_every_read_are_refused_at_once(monkeypatch, tmp_path):
    assert "ptrace_scope is 3" in cma.available(yama_scope=3)
    monkeypatch.setattr(cma.os, "geteuid", lambda: 1000)
    assert "CAP_SYS_PTRACE" in cma.available(yama_scope=2)
    monkeypatch.setattr(cma.os, "geteuid", lambda: 0)
    assert cma.available(yama_scope=2) is None          # root may
    assert cma.available(yama_scope=1) is None          # each process allows its peers (allow_peers)
    scope = tmp_path / "ptrace_scope"
    scope.write_text("2\n")
    assert cma._yama_scope(str(scope)) == 2
    assert cma._yama_scope(str(tmp_path / "absent")) is None    # no Yama: the classic rules
