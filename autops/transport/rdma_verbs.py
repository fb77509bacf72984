"""The verbs layer of the ``rdma`` transport: finding a device, and pyverbs behind a small interface.

Only this module imports ``pyverbs`` (rdma-core's Python bindings), and only when asked.
What the transport needs from a device is small -- register memory (``reg_mr``), make an RC
queue pair, connect it to the peer's, and READ from the peer's registered memory -- so it
is a ``Verbs`` and a ``QueuePair`` protocol; ``PyverbsNic`` is the real one, and tests
inject a fake through the constructors of ``RdmaMemory`` and the channels.

``require_device()`` answers, before anything else is set up, whether this process can
use RDMA at all: pyverbs importable and ``ibv_get_device_list`` naming at least one
device. When not, it raises ``RdmaUnavailable`` (a ``TransportError`` that the CLIs report
as a runtime error, exit status 1) whose text says what to do.

Settings (``autops.config.TransportConfig``): ``AUTOPS_RDMA_DEVICE`` (device name, default
the first), ``AUTOPS_RDMA_PORT`` (default 1), ``AUTOPS_RDMA_GID_INDEX`` (default 0; RoCE v2
usually wants the index of the port's RoCE v2 GID, see ``show_gids``).

Not run on hardware: this machine has no RDMA device and cannot load Soft-RoCE; the
code follows rdma-core's pyverbs API (v44) and its tests' RC set-up.
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from ..config import RDMA_DEVICE_ENV, TransportConfig
from .base import TransportError
from .rdma_layout import ConnInfo

__all__ = ["RdmaUnavailable", "NO_DEVICE", "NO_PYVERBS", "MemoryRegion", "ReadOp", "Verbs", "QueuePair",
           "load_pyverbs", "device_names", "require_device", "PyverbsNic", "split_reads"]

NO_DEVICE = "no RDMA device found (ibv_get_device_list returned none): use --transport tcp"
NO_PYVERBS = ("the rdma transport needs pyverbs (rdma-core's Python bindings), which this interpreter "
              "cannot import ({error}): install python3-pyverbs and run `make setup` (it links Debian's "
              "pyverbs into .venv), or use --transport tcp")
READ_CHUNK = 1 << 30          # the largest single READ posted (ports allow 1-2 GiB messages)
READ_TIMEOUT = 30.0           # seconds a READ may take before the connection is taken as broken


class RdmaUnavailable(TransportError, RuntimeError):
    """This process cannot use RDMA (no pyverbs, or no device): a runtime error, exit 1."""


class MemoryRegion(NamedTuple):
    """A registered range: what a local SGE (``lkey``) or a peer's READ (``rkey``) names."""
    addr: int
    nbytes: int
    lkey: int
    rkey: int
    handle: Any = None


class ReadOp(NamedTuple):
    """READ ``nbytes`` from the peer's ``remote_addr``/``rkey`` into ``local_addr``/``lkey``."""
    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int
    nbytes: int


class QueuePair(Protocol):
    def local_info(self) -> ConnInfo: ...

    def connect(self, remote: ConnInfo) -> None: ...

    def read(self, ops: Sequence[ReadOp]) -> None:
        """Every READ done, or ``TransportError`` (the queue pair is then unusable)."""

    def close(self) -> None: ...


class Verbs(Protocol):
    device: str
    # a region pins its pages, so only memory whose lifetime is watched is registered (and
    # the rest staged); cma.CmaVerbs sets it False: its READs see the sender's current pages
    pins_memory: bool

    def reg_mr(self, addr: int, nbytes: int, writable: bool) -> MemoryRegion: ...

    def dereg_mr(self, region: MemoryRegion) -> None: ...

    def queue_pair(self) -> QueuePair: ...

    def close(self) -> None: ...


# --- discovery ----------------------------------------------------------------------------

def load_pyverbs() -> Any:
    """The ``pyverbs`` package with the modules used here imported; ``RdmaUnavailable`` when
    this interpreter cannot import it."""
    try:
        import pyverbs.addr
        import pyverbs.cq
        import pyverbs.device
        import pyverbs.enums
        import pyverbs.mr
        import pyverbs.pd
        import pyverbs.qp
        import pyverbs.wr
    except ImportError as exc:
        raise RdmaUnavailable(NO_PYVERBS.format(error=exc)) from None
    return pyverbs


def _ibv_devices() -> list:
    """pyverbs' device list; ``[]`` where ``ibv_get_device_list`` returns NULL (what it does
    where the kernel has no RDMA support) -- pyverbs raises for that."""
    pv = load_pyverbs()
    from pyverbs.pyverbs_error import PyverbsError
    try:
        return list(pv.device.get_device_list())
    except PyverbsError:
        return []


def device_names(list_devices: Callable[[], Sequence] = _ibv_devices) -> list[str]:
    """Names of the RDMA devices ``ibv_get_device_list`` reports (``[]`` when none)."""
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in list_devices()]


def require_device(name: str | None = None, list_devices: Callable[[], Sequence] = _ibv_devices) -> str:
    """The device to use (``name``, else ``TransportConfig.from_env()``'s, ``$AUTOPS_RDMA_DEVICE``,
    else the first found); ``RdmaUnavailable`` at once when there is none."""
    names = device_names(list_devices)
    if not names:
        raise RdmaUnavailable(NO_DEVICE)
    wanted = name or TransportConfig.from_env().rdma_device or names[0]
    if wanted not in names:
        raise RdmaUnavailable(f"RDMA device {wanted!r} not found (found: {', '.join(names)}); "
                              f"set {RDMA_DEVICE_ENV} to one of them, or use --transport tcp")
    return wanted


def split_reads(ops: Sequence[ReadOp], chunk: int = READ_CHUNK) -> list[ReadOp]:
    """``ops`` with every READ longer than ``chunk`` split into consecutive pieces."""
    out = []
    for op in ops:
        for start in range(0, op.nbytes, chunk):
            n = min(chunk, op.nbytes - start)
            out.append(ReadOp(op.local_addr + start, op.lkey, op.remote_addr + start, op.rkey, n))
    return out


# --- pyverbs ------------------------------------------------------------------------------

class PyverbsNic:
    """One opened device: context, protection domain, the port's address (LID, GID, MTU)."""

    pins_memory = True

    def __init__(self, device: str | None = None, port: int | None = None, gid_index: int | None = None) -> None:
        """``device``, ``port``, ``gid_index``: None takes ``TransportConfig.from_env()``'s."""
        pv = load_pyverbs()
        self.pv = pv
        if device is None or port is None or gid_index is None:
            config = TransportConfig.from_env()
            device, port = device or config.rdma_device, port or config.rdma_port
            gid_index = config.rdma_gid_index if gid_index is None else gid_index
        self.device = require_device(device)
        self.port = port
        self.gid_index = gid_index
        self.ctx = pv.device.Context(name=self.device)
        self.pd = pv.pd.PD(self.ctx)
        attr = self.ctx.query_device()
        self.rd_atomic = max(1, min(16, attr.max_qp_rd_atom, attr.max_qp_init_rd_atom))
        port_attr = self.ctx.query_port(self.port)
        self.lid = port_attr.lid
        self.mtu = port_attr.active_mtu
        self.ethernet = port_attr.link_layer == pv.enums.IBV_LINK_LAYER_ETHERNET
        self.gid = self.ctx.query_gid(self.port, self.gid_index).gid if port_attr.gid_tbl_len else ""

    def reg_mr(self, addr: int, nbytes: int, writable: bool) -> MemoryRegion:
        e = self.pv.enums
        access = e.IBV_ACCESS_REMOTE_READ | (e.IBV_ACCESS_LOCAL_WRITE if writable else 0)
        try:
            mr = self.pv.mr.MR(self.pd, nbytes, access, address=addr)
        except Exception as exc:  # PyverbsRDMAError: pinning refused (ulimit -l), bad range
            raise TransportError(f"cannot register {nbytes} bytes with {self.device}: {exc} "
                                 "(is `ulimit -l` large enough?)") from None
        return MemoryRegion(addr, nbytes, mr.lkey, mr.rkey, mr)

    def dereg_mr(self, region: MemoryRegion) -> None:
        region.handle.close()

    def queue_pair(self) -> "PyverbsQueuePair":
        try:
            return PyverbsQueuePair(self)
        except Exception as exc:  # PyverbsRDMAError and friends
            raise TransportError(f"cannot create a queue pair on {self.device}: {exc}") from None

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


class PyverbsQueuePair:
    """An RC queue pair with its own completion queue; READs are posted signalled and
    polled to completion by the caller's thread."""

    DEPTH = 64

    def __init__(self, nic: PyverbsNic) -> None:
        pv = nic.pv
        self.nic, self.pv = nic, pv
        self.cq = pv.cq.CQ(nic.ctx, 2 * self.DEPTH, None, None, 0)
        cap = pv.qp.QPCap(max_send_wr=self.DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1)
        self.qp = pv.qp.QP(nic.pd, init)
        self.psn = random.getrandbits(24)

    def local_info(self) -> ConnInfo:
        nic = self.nic
        return ConnInfo(qpn=self.qp.qp_num, psn=self.psn, lid=nic.lid, gid=nic.gid, mtu=nic.mtu, device=nic.device)

    def connect(self, remote: ConnInfo) -> None:
        """RESET -> INIT -> RTR -> RTS towards ``remote``; the peer may READ our memory."""
        pv, nic = self.pv, self.nic
        e = pv.enums
        attr = pv.qp.QPAttr(port_num=nic.port)
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_LOCAL_WRITE
        attr.path_mtu = min(nic.mtu, remote.mtu) if remote.mtu else nic.mtu
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = nic.rd_atomic
        attr.max_rd_atomic = nic.rd_atomic
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        routed = nic.ethernet or remote.lid == 0
        if routed:
            if not remote.gid:
                raise TransportError(f"the peer's device {remote.device!r} gave no GID, needed on {nic.device}")
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(remote.gid), sgid_index=nic.gid_index)
            attr.ah_attr = pv.addr.AHAttr(dlid=remote.lid, port_num=nic.port, is_global=1, gr=gr)
        else:
            attr.ah_attr = pv.addr.AHAttr(dlid=remote.lid, port_num=nic.port)
        try:
            self.qp.to_rts(attr)
        except Exception as exc:  # PyverbsRDMAError
            raise TransportError(f"cannot connect queue pair {self.qp.qp_num} of {nic.device} to "
                                 f"{remote.qpn} of {remote.device}: {exc}") from None

    def read(self, ops: Sequence[ReadOp]) -> None:
        pv = self.pv
        e = pv.enums
        todo = split_reads(ops)
        posted = done = 0
        deadline = time.monotonic() + READ_TIMEOUT
        while done < len(todo):
            while posted < len(todo) and posted - done < self.nic.rd_atomic:
                op = todo[posted]
                sge = pv.wr.SGE(op.local_addr, op.nbytes, op.lkey)
                wr = pv.wr.SendWR(wr_id=posted, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge],
                                  send_flags=e.IBV_SEND_SIGNALED)
                wr.set_wr_rdma(op.rkey, op.remote_addr)
                try:
                    self.qp.post_send(wr)
                except Exception as exc:  # PyverbsRDMAError
                    raise TransportError(f"cannot post an RDMA READ on {self.nic.device}: {exc}") from None
                posted += 1
            try:
                n, wcs = self.cq.poll(posted - done)
            except Exception as exc:  # PyverbsRDMAError
                raise TransportError(f"polling the completion queue of {self.nic.device} failed: {exc}") from None
            for wc in wcs:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise TransportError(f"RDMA READ failed on {self.nic.device}: completion status "
                                         f"{wc.status} (vendor error {wc.vendor_err})")
            done += n
            if n == 0 and time.monotonic() > deadline:
                raise TransportError(f"RDMA READ on {self.nic.device} did not complete in {READ_TIMEOUT:g} s")

    def close(self) -> None:
        self.qp.close()
        self.cq.close()
