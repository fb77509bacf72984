"""Cross-memory attach: the ``rdma`` transport's verbs between processes of one host.

``CmaVerbs`` is a ``rdma_verbs.Verbs`` whose READ is ``process_vm_readv(2)``: the receiver
copies a payload straight out of the sender's memory, once, where a socket copies every
byte twice (into the kernel and out again). It is how MPI libraries and UCX move large
messages between processes of one machine, and it runs the rdma transport's whole
protocol -- descriptors, READs by the receiver, the sender's buffers kept until ``DONE``
-- on any Linux host, with real concurrent processes.

What stands for what: a queue pair's number is the process id (what ``process_vm_readv``
needs), its GID field carries a digest of the host identity (``dlrt.hostid``) and the pid
namespace, so that two emulated hosts -- which share the kernel, and so the process ids --
never read each other's memory past their shaped link, and a pid is never taken in another
namespace's sense; a memory region is bookkeeping only (keys from a
counter, checked for this side's landing buffers). The kernel checks the rest: reading
another process needs the ptrace permission (same user; with Yama's ``ptrace_scope`` 1 a
process must allow it, which ``allow_peers`` does where the kernel has Yama).
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import os
import random
from typing import Sequence

from dlrt.hostid import host_id

from .base import TransportError
from .rdma_layout import ConnInfo
from .rdma_verbs import MemoryRegion, RdmaUnavailable, ReadOp

__all__ = ["CmaVerbs", "CmaQueuePair", "available", "require_cma", "host_digest", "allow_peers"]

DEVICE = "cma"
_IOV_MAX = 1024                    # iovecs per process_vm_readv call (UIO_MAXIOV)
_PID_MAX = 0xFFFFFF                # a queue pair number has 24 bits; Linux pids stay below 2**22
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = -1


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_readv():
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _libc_readv()


YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def _yama_scope(path: str = YAMA_SCOPE) -> int | None:
    """Yama's ``ptrace_scope`` (0 classic, 1 restricted, 2 admin only, 3 none); ``None``
    where the kernel has no Yama."""
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def available(yama_scope: int | None = None) -> str | None:
    """``None`` when this process can read its peers' memory, else why not. (The kernel
    decides per peer at each READ; this rules out what fails for every peer.)"""
    if _READV is None:
        return "libc has no process_vm_readv"
    scope = _yama_scope() if yama_scope is None else yama_scope
    if scope is not None and scope >= 3:
        return f"Yama's ptrace_scope is {scope}: no process may read another's memory"
    if scope == 2 and os.geteuid() != 0:
        return "Yama's ptrace_scope is 2: only a process with CAP_SYS_PTRACE may read another's memory"
    probe = ctypes.create_string_buffer(b"cma", 4)
    dest = ctypes.create_string_buffer(4)
    local = _IoVec(ctypes.addressof(dest), 4)
    remote = _IoVec(ctypes.addressof(probe), 4)
    if _READV(os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0) != 4:
        return f"process_vm_readv refused: {os.strerror(ctypes.get_errno())}"
    return None


def require_cma() -> None:
    """``RdmaUnavailable`` at once (a runtime error, exit status 1) when ``available`` says no."""
    why = available()
    if why is not None:
        raise RdmaUnavailable(f"the cma transport cannot read other processes' memory here ({why}); "
                              "use --transport ipc")


def allow_peers() -> None:
    """Let the peers (same user) read this process under Yama's ``ptrace_scope`` 1; no-op
    where the kernel has no Yama (``prctl`` then fails with EINVAL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(ctypes.c_int(_PR_SET_PTRACER), ctypes.c_long(_PR_SET_PTRACER_ANY), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")       # e.g. pid:[4026531836]
    except OSError:
        return ""


def host_digest(identity: str | None = None) -> str:
    """What a HELLO's GID field carries: 32 hex digits of the host identity and this
    process's pid namespace -- a pid means the same process only within one namespace
    (containers given one ``DLRT_HOST_ID`` may still have their own)."""
    seen = f"{identity or host_id()}\0{_pid_namespace()}"
    return hashlib.sha256(seen.encode()).hexdigest()[:32]


class CmaVerbs:
    """One process's "device": regions are keys over address ranges, READs are system calls."""

    device = DEVICE
    pins_memory = False       # READs go through the sender's page tables: any live buffer can be read

    def __init__(self, identity: str | None = None, pid: int | None = None) -> None:
        require_cma()
        self.pid = os.getpid() if pid is None else pid
        if not 0 < self.pid <= _PID_MAX:
            raise RdmaUnavailable(f"process id {self.pid} does not fit a queue pair number")
        self.host = host_digest(identity)
        self._keys = itertools.count(random.getrandbits(20) << 8 | 1)
        self.regions: dict[int, tuple[MemoryRegion, bool]] = {}     # key -> (region, writable)
        allow_peers()

    def reg_mr(self, addr: int, nbytes: int, writable: bool) -> MemoryRegion:
        key = next(self._keys) & 0xFFFFFFFF
        region = MemoryRegion(addr, nbytes, key, key)
        self.regions[key] = (region, writable)
        return region

    def dereg_mr(self, region: MemoryRegion) -> None:
        self.regions.pop(region.lkey, None)

    def queue_pair(self) -> "CmaQueuePair":
        return CmaQueuePair(self)

    def close(self) -> None:
        self.regions.clear()


class CmaQueuePair:
    """The connection to one peer process: its pid once ``connect`` has checked its host."""

    def __init__(self, verbs: CmaVerbs) -> None:
        self.verbs = verbs
        self.psn = random.getrandbits(24)
        self.peer: int | None = None

    def local_info(self) -> ConnInfo:
        return ConnInfo(qpn=self.verbs.pid, psn=self.psn, gid=self.verbs.host, device=DEVICE)

    def connect(self, remote: ConnInfo) -> None:
        if remote.device != DEVICE:
            raise TransportError(f"the peer uses RDMA device {remote.device!r}, this side cma: "
                                 "give both sides the same --transport")
        if remote.gid != self.verbs.host:
            raise TransportError("the cma transport reaches only processes on this host and in this pid "
                                 "namespace; the peer is elsewhere (use --transport tcp, or ipc on this host)")
        if remote.qpn <= 0:
            raise TransportError(f"bad peer process id {remote.qpn}")
        self.peer = remote.qpn

    def _check_local(self, op: ReadOp) -> None:
        region, writable = self.verbs.regions.get(op.lkey, (None, False))
        if (region is None or not writable or op.local_addr < region.addr
                or op.local_addr + op.nbytes > region.addr + region.nbytes):
            raise TransportError(f"local protection error: [{op.local_addr:#x}, +{op.nbytes}) is not in a "
                                 f"writable region with key {op.lkey:#x}")

    def read(self, ops: Sequence[ReadOp]) -> None:
        if self.peer is None:
            raise TransportError("the cma queue pair is not connected")
        todo = [op for op in ops if op.nbytes]
        for op in todo:
            self._check_local(op)
        for start in range(0, len(todo), _IOV_MAX):
            self._read_batch(todo[start:start + _IOV_MAX])

    def _read_batch(self, ops: Sequence[ReadOp]) -> None:
        n = len(ops)
        local, remote = (_IoVec * n)(), (_IoVec * n)()
        for i, op in enumerate(ops):
            local[i].base, local[i].len = op.local_addr, op.nbytes
            remote[i].base, remote[i].len = op.remote_addr, op.nbytes
        want = sum(op.nbytes for op in ops)
        first, done = 0, 0
        while done < want:
            skip = first * ctypes.sizeof(_IoVec)
            got = _READV(self.peer, ctypes.addressof(local) + skip, n - first, ctypes.addressof(remote) + skip,
                         n - first, 0)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else errno.EFAULT
                raise TransportError(self._why(err))
            done += got
            # a short read stops inside one iovec: skip the whole ones, trim the partial one
            while first < n and got >= local[first].len:
                got -= local[first].len
                first += 1
            if got and first < n:
                local[first].base += got
                local[first].len -= got
                remote[first].base += got
                remote[first].len -= got

    def _why(self, err: int) -> str:
        if err == errno.ESRCH:
            return f"cma READ: peer process {self.peer} is gone"
        if err == errno.EPERM:
            return (f"cma READ: not allowed to read process {self.peer} (ptrace permission: same user, "
                    "and /proc/sys/kernel/yama/ptrace_scope at most 1)")
        if err == errno.EFAULT:
            return f"cma READ: an address of process {self.peer} is not mapped (remote access error)"
        return f"cma READ from process {self.peer} failed: {os.strerror(err)}"

    def close(self) -> None:
        self.peer = None
