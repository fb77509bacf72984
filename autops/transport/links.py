"""A process's links to its peers: what it listens on, how it reaches a peer, what it lends.

``Transport`` is the one place that decides which kind carries the data to a peer. A
peer is described by ``{"endpoints": {kind: address}, "host": host id}`` (what an
aggregator registers with pMaster). With the preference ``auto`` a peer on this host
(same ``dlrt.hostid.host_id()``) is reached over ``shm`` when both sides can share memory,
else over ``ipc``; any other peer over ``tcp``. Plain tcp (CURVE off) goes over the peer's
``stream`` endpoint: ``stream.py``'s framing on a TCP connection, large payloads spliced
and read straight into the receiver's arrays (about half the CPU of ZeroMQ's tcp, which
copies each payload into the kernel and out again on another thread); with CURVE on, or
``AUTOPS_TCP_STREAM=0``, over ZeroMQ's ``tcp`` endpoint. ``tcp``, ``ipc`` and ``shm`` force a kind
(``ipc`` and ``shm`` only to a peer on this host); so does ``rdma`` (``rdma.py``: it opens
the device at once, fails with ``RdmaUnavailable`` where there is none, and also listens on
rdma). ``ipc`` is ``stream.py`` (unix stream sockets, large payloads spliced), not
ZeroMQ; the ``shm`` kind's control messages still go over ZeroMQ ipc. ``cma`` is the rdma
transport's protocol between processes of this host, its READs done by
``process_vm_readv`` (``cma.py``): one copy of each payload; asked for explicitly, only
to peers on this host. ``auto`` never picks rdma (that path has not run on hardware yet)
nor cma (on one host shm moves fewer bytes still).
"""
from __future__ import annotations

import zmq

from dlrt.curve import Security, default_security
from dlrt.hostid import host_id

from ..config import TCP_STREAM_ENV, TransportConfig
from .base import Channel, Listener, Memory, PlainMemory, TransportError
from .cma import CmaVerbs
from .rdma import RdmaChannel, RdmaListener
from .rdma_memory import RdmaMemory
from .rdma_verbs import PyverbsNic, Verbs
from .shm import SharedMemory, available as shm_available
from .shm_channel import ShmFraming
from .sockpoll import LinkBudget
from .stream import StreamChannel, StreamListener
from .zmq import ZmqChannel, ZmqListener, ipc_address, keep_freed_buffers

TRANSPORTS = ("auto", "tcp", "ipc", "shm", "rdma", "cma")
ONE_SIDED = ("rdma", "cma")      # the kinds whose receiver READs the sender's memory (rdma.py)


def settings_from_env() -> TransportConfig:
    """``TransportConfig.from_env()``, a bad value raised as ``TransportError`` (naming it)."""
    try:
        return TransportConfig.from_env()
    except ValueError as exc:
        raise TransportError(str(exc)) from None


class Transport:
    """Channels to peers (one per address, kept open), listeners, and lendable memory.

    ``local``: same-host kinds may be offered (``listen``) and memory lent to them; without
    it this process's memory is plain and it listens on tcp only. ``label`` names the
    shared-memory segments (visible in ``/proc/<pid>/fd``). ``verbs``: the RDMA device
    for ``rdma`` (default: pyverbs' first device, opened here). ``security``: CURVE on the
    ZeroMQ tcp channels and listeners (default: the key directory's, ``dlrt.curve``); without
    CURVE tcp peers are reached over their ``stream`` endpoint (unless ``config.tcp_stream``
    is off). For ``cma`` the ``verbs`` default to ``cma.CmaVerbs``. ``config``: the
    transport's settings, handed to every channel and listener made here (default
    ``settings_from_env()``: a bad value fails here, not in a link later)."""

    def __init__(self, ctx: zmq.Context, preference: str = "auto", local: bool = True,
                 label: str | None = None, verbs: Verbs | None = None, security: Security | None = None,
                 config: TransportConfig | None = None) -> None:
        if preference not in TRANSPORTS:
            raise TransportError(f"unknown transport {preference!r} (one of {', '.join(TRANSPORTS)})")
        config = config if config is not None else settings_from_env()
        self.config = config
        self.ctx = ctx
        self.security = security if security is not None else default_security()
        self.preference = preference
        self.local = local
        self.streams = not self.security.curve and config.tcp_stream
        self.verbs = (verbs or PyverbsNic()) if preference == "rdma" else \
            (verbs or CmaVerbs()) if preference == "cma" else None
        self.memory: Memory = (RdmaMemory(self.verbs) if self.verbs is not None
                               else SharedMemory(label) if local and shm_available() else PlainMemory())
        self.channels: dict[str, Channel] = {}
        self.listeners: list[Listener] = []
        # one cap on the connections of all of this process's stream listeners (tcp and ipc):
        # a peer connecting to every endpoint holds no more than $AUTOPS_STREAM_MAX_CONNECTIONS
        self.link_budget = LinkBudget(config.stream_max_connections)
        self._tuned = False

    # --- which kind reaches a peer ------------------------------------------------------
    def kind_for(self, peer: dict) -> str:
        """The kind that reaches ``peer``; ``TransportError`` when the preference cannot."""
        endpoints = peer.get("endpoints") or {}
        host = peer.get("host")
        same_host = host == host_id()
        want = self.preference
        if want in ONE_SIDED:
            if want not in endpoints:
                raise TransportError(f"transport {want} asked for, but the peer offers no {want} endpoint: {endpoints}")
            if want == "cma" and not same_host:
                raise TransportError(f"transport cma asked for, but the peer runs on another host ({host})")
            return want
        if same_host and want in ("auto", "shm") and self.memory.lends and "shm" in endpoints:
            return "shm"
        if want == "shm":
            raise TransportError(f"transport shm asked for, but the peer is not on this host ({host}) "
                                 "or cannot share memory")
        if same_host and want in ("auto", "ipc") and "ipc" in endpoints:
            return "ipc"
        if want == "ipc" and not same_host:
            raise TransportError(f"transport ipc asked for, but the peer runs on another host ({host})")
        if self.streams and "stream" in endpoints:
            return "stream"
        if "tcp" not in endpoints:
            raise TransportError(f"the peer offers no tcp endpoint: {endpoints}")
        return "tcp"

    def lends_to(self, peer: dict) -> bool:
        """Whether payloads given as ``Shared`` reach ``peer`` by reference (shm: mapped;
        rdma: READ in place)."""
        try:
            return self.kind_for(peer) in ("shm", *ONE_SIDED)
        except TransportError:
            return False

    def reads_in_place(self, peer: dict) -> bool:
        """Whether ``peer`` reads a payload lent as ``Shared`` in place, with no copy of its own
        (shm): only then is staging data in lendable memory worth a copy here. A one-sided
        kind READs every large payload into its own memory wherever it lies, so the
        caller's array goes as it is."""
        try:
            return self.kind_for(peer) == "shm"
        except TransportError:
            return False

    # --- connecting and listening -------------------------------------------------------
    def connect(self, peer: dict) -> Channel:
        """The channel to ``peer``: one per address, so a peer that moved to another address
        still delivers the replies to requests sent to the old one."""
        kind = self.kind_for(peer)
        address = peer["endpoints"][kind]
        channel = self.channels.get(address)
        if channel is None:
            if kind == "shm":
                channel = ZmqChannel(self.ctx, address, kind, ShmFraming(self.memory), security=self.security)
            elif kind in ONE_SIDED:
                channel = RdmaChannel(self.verbs, self.memory, address, kind=kind)
            elif kind in ("ipc", "stream"):
                self._tune()
                channel = StreamChannel(address, config=self.config)
            else:
                self._tune()
                channel = ZmqChannel(self.ctx, address, kind, lanes=self.config.tcp_lanes, security=self.security)
            self.channels[address] = channel
        return channel

    def listen(self, bind_host: str, port: int, advertise_host: str) -> dict[str, str]:
        """Bind tcp on ``bind_host:port``; without CURVE the ``stream`` endpoint on the next
        port (``port + 1``; a free one when ``port`` is 0); rdma on a free port of
        ``bind_host`` when this transport is ``rdma`` (cma on one of 127.0.0.1 for ``cma``);
        and, when ``local``, ipc and shm endpoints. Returns the endpoints (kind -> address)
        peers connect to. The listeners are in ``self.listeners``."""
        self._tune()
        self.listeners.append(ZmqListener(self.ctx, f"tcp://{bind_host}:{port}", "tcp", advertise_host,
                                          security=self.security))
        if self.streams:
            stream_port = port + 1 if port else 0
            if stream_port > 65535:
                raise TransportError(f"port {port}: the stream endpoint needs the next port free too (at most 65534)")
            try:
                self.listeners.append(StreamListener(f"tcp://{bind_host}:{stream_port}", advertise_host,
                                                     budget=self.link_budget, config=self.config))
            except OSError as exc:
                raise TransportError(f"cannot listen on {bind_host}:{stream_port} for the stream endpoint "
                                     f"({exc.strerror or exc}); free that port or set {TCP_STREAM_ENV}=0") from None
        if self.preference == "cma":
            # its peers are on this host: loopback only, whatever the tcp endpoint's interface
            self.listeners.append(RdmaListener(self.verbs, self.memory, "127.0.0.1", 0, "127.0.0.1", kind="cma"))
        elif self.verbs is not None:
            self.listeners.append(RdmaListener(self.verbs, self.memory, bind_host.strip("[]"), 0, advertise_host))
        if self.local:
            self.listeners.append(StreamListener(ipc_address("agg", self.config.runtime_dir), budget=self.link_budget,
                                                 config=self.config))
            if isinstance(self.memory, SharedMemory):
                self.listeners.append(ZmqListener(self.ctx, ipc_address("agg-shm", self.config.runtime_dir), "shm",
                                                  framing=ShmFraming(self.memory), security=self.security))
        return {listener.kind: listener.address for listener in self.listeners}

    # --- memory shared with peers -------------------------------------------------------
    def premap(self, peer: dict) -> None:
        """Map ``peer``'s published regions (``peer["segments"]``) ahead of their first use,
        when this process reads them in place."""
        if self.lends_to(peer):
            self.memory.premap(peer.get("segments"))

    def handles_for(self, peer: dict, scope: str) -> list:
        """The regions of other processes mapped here for ``scope`` that ``peer`` can map too
        (none unless it shares this host's memory)."""
        return self.memory.mapped_handles(scope) if self.lends_to(peer) else []

    def _tune(self) -> None:
        if not self._tuned and self.config.malloc_tuning:
            # tensors arrive in socket frames: let their buffers reuse heap pages
            # (process-wide glibc setting; AUTOPS_MALLOC_TUNING=0 turns it off)
            self._tuned = keep_freed_buffers()

    def sending(self) -> bool:
        """Whether replies wait at one of the listeners to be sent (``Listener.sending``;
        safe to ask from another thread)."""
        return any(listener.sending() for listener in list(self.listeners))

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        for listener in self.listeners:
            listener.close()
        self.channels.clear()
        self.listeners.clear()
        self.memory.close()
        if self.verbs is not None:
            self.verbs.close()
