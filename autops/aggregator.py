"""The aggregator process: serves push/pull of the keys pMaster assigned to it.

One aggregator per machine. It binds a ZeroMQ ROUTER on tcp (and on ipc for agents on the
same host), registers with pMaster over a DEALER, heartbeats, accepts ``ASSIGN`` and
``RELEASE_JOB`` from pMaster, and runs the data plane over the ``Store``: pushes are
acknowledged at once, pulls are parked until their iteration is published. Any bad
request is answered with an error to that client only; the loop never dies on input.
"""
from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import psutil
import zmq

from . import wire
from .hostinfo import host_id
from .partition import KeySpec
from .store import KeyState, Store, StoreError
from .transport import shm
from .transport.zmq import bound_address, ipc_address, keep_freed_buffers, make_context

log = logging.getLogger("autops.aggregator")


@dataclass
class PendingPull:
    sock: zmq.Socket
    identity: bytes
    req: int | None
    items: list            # [(KeyState, iteration)]
    waiting: set = field(default_factory=set)   # id(KeyState) still unpublished
    iteration: dict = field(default_factory=dict)  # id(KeyState) -> iteration asked for
    finished: bool = False
    shm: bool = False          # the agent reads published values from shared memory


def default_advertise_host(bind_host: str) -> str:
    if bind_host not in ("0.0.0.0", "*", ""):
        return bind_host
    try:
        return pysocket.gethostbyname(pysocket.gethostname())
    except OSError:
        return "127.0.0.1"


class Aggregator:
    """A keyed aggregation server; ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, master: str, bind_host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, ipc: bool = True,
                 heartbeat_interval: float = 1.0, register_timeout: float = 30.0,
                 name: str | None = None) -> None:
        self.master = master
        self.heartbeat_interval = heartbeat_interval
        self.register_timeout = register_timeout
        self.name = name
        self.agg_id: str | None = None
        keep_freed_buffers()
        self.shm = shm.available() and ipc
        self.arenas: dict[str, shm.Arena] = {}
        self.attached = shm.Attachments()
        self.store = Store(self._allocate if self.shm else None)
        self.waiters: dict[int, list[PendingPull]] = {}
        self._stop = threading.Event()
        self.ctx = make_context()
        self.data_socks: list[zmq.Socket] = []
        self.endpoints: dict[str, str] = {}
        tcp = self.ctx.socket(zmq.ROUTER)
        tcp.bind(f"tcp://{bind_host}:{port}")
        port_bound = int(bound_address(tcp).rsplit(":", 1)[1])
        self.endpoints["tcp"] = f"tcp://{advertise_host or default_advertise_host(bind_host)}:{port_bound}"
        self.data_socks.append(tcp)
        if ipc:
            ipc_sock = self.ctx.socket(zmq.ROUTER)
            addr = ipc_address("agg")
            ipc_sock.bind(addr)
            self.endpoints["ipc"] = addr
            self.data_socks.append(ipc_sock)
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.connect(master)
        self.proc = psutil.Process()
        self.stats = {"pushes": 0, "pulls": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0}

    def _allocate(self, job: str, sizes: list) -> list:
        """Published buffers in shared memory, so same-host agents read them with one memcpy."""
        if not sizes:
            return []
        arena = self.arenas.setdefault(job, shm.Arena(f"autops-{job}"))
        return arena.allocate(sizes)

    # --- lifecycle ------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def register(self) -> str:
        """Register with pMaster; raises TimeoutError naming the address if it never answers."""
        deadline = time.monotonic() + self.register_timeout
        msg = wire.encode(wire.REGISTER_AGG, endpoints=self.endpoints, host=host_id(),
                          pid=os.getpid(), name=self.name, cpus=os.cpu_count())
        while time.monotonic() < deadline and not self._stop.is_set():
            self.ctrl.send_multipart(msg)
            if self.ctrl.poll(1000):
                reply = wire.decode(self.ctrl.recv_multipart())
                if reply.op == wire.ERROR:
                    raise RuntimeError(f"master {self.master} refused registration: {reply['message']}")
                self.agg_id = reply["agg"]
                log.info("registered as %s at %s (endpoints %s)", self.agg_id, self.master, self.endpoints)
                return self.agg_id
        raise TimeoutError(f"AutoPS master at {self.master} did not answer within {self.register_timeout:.0f}s")

    def run(self) -> None:
        try:
            if self.agg_id is None:
                self.register()
            self._loop()
        finally:
            self.close()

    def close(self) -> None:
        for sock in self.data_socks:
            sock.close(0)
        self.ctrl.close(0)
        self.ctx.term()
        self.attached.close()
        for arena in self.arenas.values():
            arena.close()
        for addr in self.endpoints.values():
            if addr.startswith("ipc://"):
                try:
                    os.unlink(addr[len("ipc://"):])
                except OSError:
                    pass

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in self.data_socks:
            poller.register(sock, zmq.POLLIN)
        poller.register(self.ctrl, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + self.heartbeat_interval
            timeout = max(0.0, min(next_beat - now, 0.2))
            for sock, _ in poller.poll(int(timeout * 1000) + 1):
                # drain what is queued on this socket before polling again
                for _ in range(64):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if sock is self.ctrl:
                        self._on_master(frames)
                    else:
                        self._on_data(sock, frames)

    def _heartbeat(self) -> None:
        try:
            cpu = self.proc.cpu_percent(None)
        except psutil.Error:
            cpu = 0.0
        self.ctrl.send_multipart(wire.encode(
            wire.HEARTBEAT, agg=self.agg_id or "", cpu_percent=cpu,
            bytes_held=self.store.bytes_held(), jobs=sorted(self.store.jobs), **self.stats))

    # --- control from pMaster -------------------------------------------------------
    def _on_master(self, frames: list) -> None:
        try:
            msg = wire.decode(frames)
        except wire.ProtocolError as exc:
            log.warning("bad message from master: %s", exc)
            return
        req = msg.get("req")
        if msg.op == wire.ASSIGN:
            try:
                keys = [KeySpec.from_wire(k) for k in msg["keys"]]
                self.store.assign(msg["job"], msg["secret"], msg["world_size"], msg["mode"], keys,
                                  average=bool(msg.get("average", True)),
                                  optimizer=msg.get("optimizer"), hp=msg.get("hp") or {})
                self.ctrl.send_multipart(wire.encode(wire.OK, req=req, agg=self.agg_id))
            except (StoreError, ValueError, TypeError) as exc:
                self.ctrl.send_multipart(wire.error(str(exc), req=req, agg=self.agg_id))
        elif msg.op == wire.RELEASE_JOB:
            self._release(msg["job"])
        elif msg.op in (wire.OK, wire.ERROR):
            if msg.op == wire.ERROR:
                log.warning("master: %s", msg["message"])
                if msg.get("reregister"):
                    self.agg_id = None
                    self.register()
        else:
            log.warning("unexpected %s from master", msg.op)

    def _release(self, job: str) -> None:
        state = self.store.jobs.get(job)
        if state is None:
            return
        for ks in state.keys.values():
            for pending in self.waiters.pop(id(ks), []):
                self._send_error(pending.sock, pending.identity, pending.req, f"job {job!r} was released")
        self.store.release(job)
        self.attached.release(job)
        arena = self.arenas.pop(job, None)
        if arena is not None:
            arena.close()
        log.info("released job %s", job)

    # --- data plane -----------------------------------------------------------------
    def _send_error(self, sock: zmq.Socket, identity: bytes, req: int | None, text: str) -> None:
        self.stats["errors"] += 1
        sock.send_multipart([identity, *wire.error(text, req=req)])

    def _on_data(self, sock: zmq.Socket, frames: list) -> None:
        identity = frames[0].bytes
        req = None
        try:
            msg = wire.decode(frames[1:])
            req = msg.get("req")
            if msg.op == wire.PUSH:
                self._push(sock, identity, msg)
            elif msg.op == wire.PULL:
                self._pull(sock, identity, msg)
            elif msg.op == wire.INIT:
                self._init(sock, identity, msg)
            elif msg.op == wire.BCAST_PUT:
                self._bcast_put(sock, identity, msg)
            elif msg.op == wire.BCAST_GET:
                self._bcast_get(sock, identity, msg)
            else:
                raise wire.ProtocolError(f"operation {msg.op!r} is not served by an aggregator")
        except (wire.ProtocolError, StoreError) as exc:
            self._send_error(sock, identity, req, str(exc))
        except Exception as exc:  # a bug must not take the shared service down
            log.exception("internal error on a data request")
            self._send_error(sock, identity, req, f"internal aggregator error: {exc.__class__.__name__}: {exc}")

    @staticmethod
    def _array(msg: wire.Message, frame_idx: object, offset: object, nbytes: object, dtype: str) -> np.ndarray:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (frame_idx, offset, nbytes)):
            raise wire.ProtocolError(f"{msg.op}: frame index, offset and size must be integers")
        if not 0 <= frame_idx < len(msg.payloads):
            raise wire.ProtocolError(f"{msg.op}: payload frame {frame_idx} missing")
        buf = wire.payload_view(msg.payloads[frame_idx])
        itemsize = np.dtype(dtype).itemsize
        if offset < 0 or nbytes < 0 or offset + nbytes > buf.nbytes or nbytes % itemsize:
            raise wire.ProtocolError(f"{msg.op}: payload slice [{offset}, {offset + nbytes}) outside a "
                                     f"{buf.nbytes}-byte frame or not a whole number of {dtype}")
        return np.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset)

    def _push(self, sock: zmq.Socket, identity: bytes, msg: wire.Message) -> None:
        state = self.store.job(msg["job"], msg["secret"])
        rank = msg["rank"]
        checked: list[tuple[KeyState, np.ndarray]] = []
        seen: set[str] = set()
        for item in wire.items_of(msg, 5):
            key, iteration, frame_idx, offset, nbytes = item[:5]
            hp = item[5] if len(item) > 5 else None
            if not isinstance(key, str) or not isinstance(iteration, int) or key in seen:
                raise wire.ProtocolError(f"push: bad or repeated key {key!r}")
            if hp is not None and not isinstance(hp, dict):
                raise wire.ProtocolError(f"push: hyper-parameters of {key!r} must be a map")
            seen.add(key)
            ks = self.store.key(state, key)
            ref = item[6].get("shm") if len(item) > 6 and isinstance(item[6], dict) else None
            if ref is not None:
                if not isinstance(nbytes, int):
                    raise wire.ProtocolError("push: size must be an integer")
                try:
                    data = self.attached.array(ref, nbytes, ks.spec.dtype, tag=state.job)
                except ValueError as exc:
                    raise StoreError(f"push of {key!r}: {exc}") from None
            else:
                data = self._array(msg, frame_idx, offset, nbytes, ks.spec.dtype)
            checked.append((self.store.check_push(state, rank, key, iteration, data), data, hp, ref is not None))
        for ks, _, hp, _ in checked:
            if hp:
                try:
                    self.store.set_hp(ks, hp)
                except ValueError as exc:
                    raise StoreError(f"key {ks.spec.key!r}: bad hyper-parameters: {exc}") from None
        sock.send_multipart([identity, *wire.encode(wire.PUSH_ACK, req=msg.get("req"), items=list(seen))])
        for ks, data, _, deferred in checked:
            self.stats["pushes"] += 1
            self.stats["bytes_in"] += data.nbytes
            if self.store.push(ks, rank, data, deferred=deferred):
                self._published(ks)

    def _pull(self, sock: zmq.Socket, identity: bytes, msg: wire.Message) -> None:
        state = self.store.job(msg["job"], msg["secret"])
        rank = msg["rank"]
        if not 0 <= rank < state.world_size:
            raise StoreError(f"job {state.job!r}: rank {rank} outside world size {state.world_size}")
        items = []
        for key, iteration in (i[:2] for i in wire.items_of(msg, 2)):
            if not isinstance(key, str) or not isinstance(iteration, int):
                raise wire.ProtocolError(f"pull: bad item {key!r}")
            ks = self.store.key(state, key)
            items.append((ks, iteration))
        pending = PendingPull(sock, identity, msg.get("req"), items,
                              iteration={id(ks): it for ks, it in items}, shm=bool(msg.get("shm")))
        for ks, iteration in items:
            if not self.store.pull_ready(ks, iteration):
                pending.waiting.add(id(ks))
        if pending.waiting:
            for ks, _ in items:
                if id(ks) in pending.waiting:
                    self.waiters.setdefault(id(ks), []).append(pending)
        else:
            self._reply_pull(pending)

    def _published(self, ks: KeyState) -> None:
        """Answer the parked pulls that waited for ``ks`` and are now complete."""
        waiting = self.waiters.pop(id(ks), None)
        if not waiting:
            return
        keep = []
        for pending in waiting:
            if pending.finished:
                continue
            try:
                if not self.store.pull_ready(ks, pending.iteration[id(ks)]):
                    keep.append(pending)
                    continue
            except StoreError as exc:
                pending.finished = True
                self._send_error(pending.sock, pending.identity, pending.req, str(exc))
                continue
            pending.waiting.discard(id(ks))
            if not pending.waiting:
                pending.finished = True
                self._reply_pull(pending)
        if keep:
            self.waiters[id(ks)] = keep

    def _reply_pull(self, pending: PendingPull) -> None:
        items, payloads = [], []
        for ks, iteration in pending.items:
            value = ks.value(iteration)
            ref = ks.value_ref(iteration) if pending.shm else None
            if ref is not None:
                items.append([ks.spec.key, iteration, -1, ref])
            else:
                items.append([ks.spec.key, iteration, len(payloads)])
                payloads.append(value)
            self.stats["bytes_out"] += value.nbytes
        self.stats["pulls"] += len(items)
        pending.sock.send_multipart(
            [pending.identity, *wire.encode(wire.PULL_REPLY, payloads, req=pending.req, items=items)],
            copy=False)

    def _init(self, sock: zmq.Socket, identity: bytes, msg: wire.Message) -> None:
        state = self.store.job(msg["job"], msg["secret"])
        prepared = []
        for item in wire.items_of(msg, 4):
            key, frame_idx, offset, nbytes = item[:4]
            ks = self.store.key(state, key)
            extra = item[4] if len(item) > 4 and isinstance(item[4], dict) else {}
            if extra.get("shm") is not None:
                if not isinstance(nbytes, int):
                    raise wire.ProtocolError("init: size must be an integer")
                try:
                    data = self.attached.array(extra["shm"], nbytes, ks.spec.dtype, tag=state.job)
                except ValueError as exc:
                    raise StoreError(f"INIT of {key!r}: {exc}") from None
            else:
                data = self._array(msg, frame_idx, offset, nbytes, ks.spec.dtype)
            opt_state = {}
            for name, (fidx, off, nb) in (extra.get("state") or {}).items():
                opt_state[name] = self._array(msg, fidx, off, nb, ks.spec.dtype)
            prepared.append((key, data, opt_state, extra.get("step")))
        for key, data, opt_state, step in prepared:
            try:
                self.store.init(state, key, data, hp=msg.get("hp"), opt_state=opt_state or None, step=step)
            except ValueError as exc:
                raise StoreError(f"INIT of {key!r}: {exc}") from None
        sock.send_multipart([identity, *wire.encode(wire.OK, req=msg.get("req"))])
        for key, *_ in prepared:
            # a pull of iteration 0, or one whose update only waited for the master copy
            self._published(state.keys[key])

    def _bcast_put(self, sock: zmq.Socket, identity: bytes, msg: wire.Message) -> None:
        state = self.store.job(msg["job"], msg["secret"])
        if len(msg.payloads) != 1:
            raise wire.ProtocolError("bcast_put: exactly one payload frame expected")
        data = np.frombuffer(wire.payload_view(msg.payloads[0]), dtype=np.uint8)
        self.store.bcast_put(state, msg["name"], msg["seq"], data)
        sock.send_multipart([identity, *wire.encode(wire.OK, req=msg.get("req"))])
        waiting = self.waiters.pop(("bcast", msg["job"], msg["name"], msg["seq"]), [])
        for pending_sock, pending_identity, pending_req in waiting:
            self._answer_bcast(state, msg["name"], msg["seq"], pending_sock, pending_identity, pending_req)

    def _bcast_get(self, sock: zmq.Socket, identity: bytes, msg: wire.Message) -> None:
        state = self.store.job(msg["job"], msg["secret"])
        if (msg["name"], msg["seq"]) in state.broadcasts:
            self._answer_bcast(state, msg["name"], msg["seq"], sock, identity, msg.get("req"))
        else:
            self.waiters.setdefault(("bcast", msg["job"], msg["name"], msg["seq"]), []).append(
                (sock, identity, msg.get("req")))

    def _answer_bcast(self, state, name: str, seq: int, sock: zmq.Socket, identity: bytes, req) -> None:
        data = self.store.bcast_get(state, name, seq)
        sock.send_multipart([identity, *wire.encode(wire.PULL_REPLY, [data], req=req, items=[[name, seq, 0]])],
                            copy=False)


def serve(master: str, **kwargs) -> None:
    """Run one aggregator in this process until SIGTERM/SIGINT."""
    agg = Aggregator(master, **kwargs)
    agg.install_signal_handlers()
    agg.run()
