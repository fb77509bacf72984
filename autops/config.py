"""AutoPS's settings in one place: what a worker (``AgentConfig``), an aggregator
(``AggregatorConfig``), pMaster (``MasterConfig``) and the transport under them
(``TransportConfig``) are configured with, their defaults, and the only reads of the
``AUTOPS_*`` environment variables in AutoPS (``from_env``; docs/configuration.md lists them).

The command line (``autops.cli``) and ``autops.torch.init`` fill these from their options and
arguments, falling back to ``from_env``, and hand them to the objects they make; the objects
made without one (tests, benchmarks) read ``from_env`` when they are made, never at import.
A bad value raises ``ValueError`` naming the variable, except for the few settings that have
always fallen back to their default (said at each field).

A leaf: it imports nothing of AutoPS, so that the worker, the aggregator, pMaster and the
shared layers can all read it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from dlrt.limits import env_positive, half_open_files
from dlrt.sizes import parse_size
from dlrt.tcpopts import RTO_MIN_US, rto_min_us_from_env

T = TypeVar("T", int, float)
Environ = Mapping[str, str]

# --- the variables ------------------------------------------------------------------------
# a worker's (read by ``autops.torch.init`` and the ``Agent``; launchers set the first five)
MASTER_ENV = "AUTOPS_MASTER"
JOB_ENV = "AUTOPS_JOB"
SECRET_ENV = "AUTOPS_JOB_SECRET"
AGGREGATORS_ENV = "AUTOPS_AGGREGATORS"
TRANSPORT_ENV = "AUTOPS_TRANSPORT"
TIMEOUT_ENV = "AUTOPS_TIMEOUT"
FAULT_TOLERANT_ENV = "AUTOPS_FAULT_TOLERANT"
PARTITION_ENV = "AUTOPS_PARTITION_BYTES"
WARM_ENV = "AUTOPS_WARM_BYTES"
COALESCE_ENV = "AUTOPS_COALESCE"
# the ``autops`` command's
LOG_ENV = "AUTOPS_LOG"
STATE_ENV = "AUTOPS_STATE_DIR"
RESERVE_ENV = "AUTOPS_AGGREGATOR_RESERVE"
RESERVE_SHARED_ENV = "AUTOPS_AGGREGATOR_RESERVE_SHARED"
SHAPES_ENV = "AUTOPS_TENSOR_SHAPES"
# the transport's, in every process
TCP_STREAM_ENV = "AUTOPS_TCP_STREAM"
TCP_LANES_ENV = "AUTOPS_TCP_LANES"
RTO_MIN_ENV = "AUTOPS_TCP_RTO_MIN_US"
MAX_LINKS_ENV = "AUTOPS_STREAM_MAX_CONNECTIONS"
HANDSHAKE_ENV = "AUTOPS_STREAM_HANDSHAKE_S"
IDLE_ENV = "AUTOPS_STREAM_IDLE_S"
MALLOC_TUNING_ENV = "AUTOPS_MALLOC_TUNING"
RUNTIME_DIR_ENV = "AUTOPS_RUNTIME_DIR"
RDMA_DEVICE_ENV = "AUTOPS_RDMA_DEVICE"
RDMA_PORT_ENV = "AUTOPS_RDMA_PORT"
RDMA_GID_INDEX_ENV = "AUTOPS_RDMA_GID_INDEX"

# --- defaults -----------------------------------------------------------------------------
#: Seconds an aggregator that pMaster's local provider started waits without hearing from any
#: pMaster before it exits (``autops aggregator --orphan-timeout``; one started by hand: 0, never).
DEFAULT_ORPHAN_TIMEOUT = 300.0
#: Seconds a worker's request waits for its reply (and its registration for pMaster).
DEFAULT_TIMEOUT = 60.0
#: Bytes carried to a move's new owner and back over each TCP connection opened for the move,
#: before its switch (``IOLoop.warm``); 0 turns it off.
WARM_BYTES = 32 << 20
#: Connections per ZeroMQ tcp peer (a stream endpoint gets one). One: several connections
#: share a link fairly, so every key crossing it advances at once and all complete late,
#: where one connection delivers keys one after the other and the aggregators answer the
#: first ones while the rest are still coming (measured on emulated 200 Mbit/s hosts,
#: W = A = 4: 4.6 s per iteration with one, 5.3 s with two). More help where one
#: connection cannot fill a link (a long round trip).
TCP_LANES = 1
#: Plain tcp goes over ``stream.py``'s framing (else over ZeroMQ's tcp).
TCP_STREAM = True
#: Seconds a new stream connection has for its first whole message.
HANDSHAKE_S = 10.0
#: Seconds a stream connection that never became a job's channel may stay idle.
IDLE_S = 120.0
#: An aggregator's default share of a core for memory made ready for keys migrating in: a
#: helper thread's nice value would not keep that off the workers' and other jobs' CPU.
PREFAULT_SHARE = 0.25
#: The share of an aggregator's reserve made as shared-memory pieces: about a quarter of what a
#: server-mode job with Adam needs is published buffers (master copies; the rest its gradient
#: accumulators, optimizer state and received pushes), two thirds of a sum-mode job's (two
#: buffers per key).
RESERVE_SHARED = 0.25


# --- reading ------------------------------------------------------------------------------
def _text(environ: Environ, name: str) -> str | None:
    """``$name``; None when unset or empty."""
    return environ.get(name) or None


def _number(environ: Environ, name: str, cast: Callable[[str], T], default: T, what: str) -> T:
    """``$name`` as a number (``cast``), else ``default``; not one: ``ValueError`` naming it."""
    text = _text(environ, name)
    if text is None:
        return default
    try:
        return cast(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not {what}") from None


def _switch(environ: Environ, name: str, off: tuple[str, ...] = ("0",)) -> bool:
    """Whether ``$name`` leaves a setting on: unset, or anything but ``off`` (any case)."""
    return environ.get(name, "").lower() not in off


def master_address(environ: Environ = os.environ) -> str | None:
    """pMaster's address as the environment gives it (``$AUTOPS_MASTER``), else None."""
    return _text(environ, MASTER_ENV)


def log_level(environ: Environ = os.environ) -> str:
    """The ``autops`` command's log level: ``$AUTOPS_LOG`` (upper case, checked by the
    command), else INFO."""
    return (_text(environ, LOG_ENV) or "INFO").strip().upper()


def rto_min_us(environ: Environ = os.environ, strict: bool = True) -> int:
    """``$AUTOPS_TCP_RTO_MIN_US`` (microseconds, 0..``dlrt.tcpopts.KERNEL_RTO_MIN_US``), else
    ``RTO_MIN_US``; a bad value: ``ValueError``, or with ``strict`` off ``RTO_MIN_US``."""
    return rto_min_us_from_env(RTO_MIN_ENV, strict, environ)


def tensor_shapes(environ: Environ = os.environ) -> str | None:
    """The tensor shapes file the environment names (``$AUTOPS_TENSOR_SHAPES``), else None."""
    return _text(environ, SHAPES_ENV)


@dataclass(frozen=True)
class TransportConfig:
    """The transport's settings, the same in every AutoPS process (``autops.transport``)."""
    tcp_stream: bool = TCP_STREAM      # plain tcp over stream endpoints (``AUTOPS_TCP_STREAM`` 0: ZeroMQ's tcp)
    tcp_lanes: int = TCP_LANES         # connections to each ZeroMQ tcp peer
    tcp_rto_min_us: int = RTO_MIN_US   # retransmission-timeout floor of TCP data links (0: the kernel's)
    stream_max_connections: int = field(default_factory=half_open_files)   # one cap over a process's stream listeners
    stream_handshake_s: float = HANDSHAKE_S     # for a new stream connection's first whole message
    stream_idle_s: float = IDLE_S      # idle time of a stream connection that never became a job's channel
    malloc_tuning: bool = True         # let glibc keep freed message buffers (``zmq.keep_freed_buffers``)
    runtime_dir: str | None = None     # where unix sockets go (None: the temporary directory)
    # the RDMA device, read by ``rdma_verbs`` from the environment when it opens one
    rdma_device: str | None = None     # its name (None: the first found)
    rdma_port: int = 1                 # its port
    rdma_gid_index: int = 0            # the GID index (RoCE v2 usually wants its IPv4 entry's)

    @classmethod
    def from_env(cls, environ: Environ = os.environ) -> "TransportConfig":
        """The settings from ``environ``. ``AUTOPS_TCP_STREAM`` other than 0 or 1 and
        ``AUTOPS_TCP_LANES`` not a number give the default, bad ``AUTOPS_STREAM_*`` values the
        default with a warning (as they always have); the rest raise ``ValueError``."""
        stream = environ.get(TCP_STREAM_ENV, "").strip()
        try:
            lanes = max(1, int(environ.get(TCP_LANES_ENV, TCP_LANES)))
        except ValueError:
            lanes = TCP_LANES
        return cls(
            tcp_stream=TCP_STREAM if stream not in ("0", "1") else stream == "1",
            tcp_lanes=lanes,
            tcp_rto_min_us=rto_min_us(environ),
            stream_max_connections=env_positive(MAX_LINKS_ENV, half_open_files(), int, env=environ),
            stream_handshake_s=env_positive(HANDSHAKE_ENV, HANDSHAKE_S, env=environ),
            stream_idle_s=env_positive(IDLE_ENV, IDLE_S, env=environ),
            malloc_tuning=_switch(environ, MALLOC_TUNING_ENV),
            runtime_dir=_text(environ, RUNTIME_DIR_ENV),
            rdma_device=_text(environ, RDMA_DEVICE_ENV),
            rdma_port=_number(environ, RDMA_PORT_ENV, int, 1, "a port number"),
            rdma_gid_index=_number(environ, RDMA_GID_INDEX_ENV, int, 0, "a GID index"))


@dataclass(frozen=True)
class AgentConfig:
    """A worker's settings (``autops.torch.init``, ``autops.worker.agent.Agent``); the
    arguments given to either win over these."""
    master: str | None = None          # pMaster's address (None: train alone, at world size 1)
    job: str | None = None             # the job's id, unique in the pool
    secret: str | None = None          # the job's secret, the same for every rank
    aggregators: int = 0               # the job's standalone aggregator count (0: pMaster's choice)
    transport: str = "auto"            # how to reach aggregators (``autops.transport.TRANSPORTS``)
    timeout: float = DEFAULT_TIMEOUT   # seconds a request waits for its reply
    fault_tolerant: bool = True        # survive an aggregator's loss (pushes kept, server-mode keys replicated)
    partition_bytes: int | None = None     # tensors above this are split (None: pMaster's choice)
    warm_bytes: int = WARM_BYTES       # carried over each TCP connection opened for a move, before its switch
    coalesce: bool = True              # large keys' pushes to one aggregator go as one message per burst
    transport_config: TransportConfig = field(default_factory=TransportConfig)

    @classmethod
    def from_env(cls, environ: Environ = os.environ) -> "AgentConfig":
        """The settings from ``environ`` (``ValueError`` naming a variable whose value is bad)."""
        return cls(
            master=master_address(environ),
            job=_text(environ, JOB_ENV),
            secret=_text(environ, SECRET_ENV),
            aggregators=_number(environ, AGGREGATORS_ENV, int, 0, "a whole number"),
            transport=_text(environ, TRANSPORT_ENV) or "auto",
            timeout=_number(environ, TIMEOUT_ENV, float, DEFAULT_TIMEOUT, "a number of seconds"),
            fault_tolerant=_switch(environ, FAULT_TOLERANT_ENV, ("0", "false", "no")),
            partition_bytes=_number(environ, PARTITION_ENV, int, None, "a number of bytes"),
            warm_bytes=_number(environ, WARM_ENV, int, WARM_BYTES, "a number of bytes"),
            coalesce=_switch(environ, COALESCE_ENV),
            transport_config=TransportConfig.from_env(environ))


def _share(environ: Environ, name: str, default: float) -> float:
    """``$name`` as a share: a number above 0 and at most 1."""
    value = _number(environ, name, float, default, "a number")
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"${name}={environ.get(name)!r} is not a share: a number above 0 and at most 1")
    return value


def _size(environ: Environ, name: str, default: int) -> int:
    """``$name`` as a byte size (``4G``, ``512M``, ``4096``; ``dlrt.sizes``)."""
    text = _text(environ, name)
    try:
        return default if text is None else parse_size(text)
    except ValueError as exc:
        raise ValueError(f"${name}: {exc}") from None


@dataclass(frozen=True)
class AggregatorConfig:
    """An aggregator's settings (``autops aggregator``; ``aggregator.service.serve``)."""
    bind_host: str = "127.0.0.1"       # where workers reach it over TCP
    port: int = 0                      # its tcp port (0: a free one)
    advertise_host: str | None = None  # the address workers use (None: the bind host)
    ipc: bool = True                   # also offer unix-socket and shared-memory endpoints
    name: str | None = None            # its id (None: pMaster gives agg-N)
    register_timeout: float = 30.0     # seconds to wait for pMaster's answer to its registration
    heartbeat_interval: float = 1.0    # seconds between heartbeats
    transport: str = "auto"            # auto, tcp, rdma or cma
    prefault_share: float = PREFAULT_SHARE     # of a core, for memory made ready for keys migrating in
    reserve: int = 0                   # bytes populated at start and kept for what arrives later
    reserve_shared: float = RESERVE_SHARED     # the share of ``reserve`` made as shared memory
    orphan_timeout: float = 0.0        # seconds without any pMaster before it exits (0: never)
    max_job_bytes: int | None = None   # the most one job may take here (None: half of what it can give)
    max_tenant_bytes: int | None = None    # the most one tenant's jobs may take here together
    transport_config: TransportConfig = field(default_factory=TransportConfig)

    @classmethod
    def from_env(cls, environ: Environ = os.environ) -> "AggregatorConfig":
        """The defaults, with the reserve and the transport's settings from ``environ``
        (``ValueError`` naming a variable whose value is bad)."""
        return cls(reserve=_size(environ, RESERVE_ENV, 0),
                   reserve_shared=_share(environ, RESERVE_SHARED_ENV, RESERVE_SHARED),
                   transport_config=TransportConfig.from_env(environ))


def _state_dir(environ: Environ) -> str:
    return _text(environ, STATE_ENV) or str(Path.home() / ".dlrt" / "autops")


@dataclass(frozen=True)
class MasterConfig:
    """pMaster's settings (``autops master``; ``master.pmaster.serve``), but for elasticity's
    (``master.elastic.ElasticConfig``)."""
    bind: str = "tcp://127.0.0.1:5555"     # the address it listens on
    heartbeat_timeout: float = 5.0     # silence after which an aggregator counts as lost
    provider: str = "standby"          # standby: aggregators started by hand; local / ray: it starts them too
    ray_address: str | None = None     # the ray provider's Ray cluster, HOST:PORT (None: the one this machine runs)
    ray_resource: str | None = None    # the ray provider's custom resource: nodes lending aggregators (None: CPUs)
    max_aggregators: int | None = None     # the local provider's most processes (None: the CPU count)
    aggregator_transport: str = "auto"     # the --transport of the aggregators the local provider starts
    aggregator_orphan_timeout: float = DEFAULT_ORPHAN_TIMEOUT     # and their --orphan-timeout
    report_bind: str | None = None     # a ZeroMQ PUB address for utilization reports
    metrics_port: int | None = None    # an HTTP port for Prometheus metrics
    report_period: float = 1.0         # seconds between reports
    state_dir: str = field(default_factory=lambda: _state_dir({}))   # the live jobs' secret hashes
    log_level: str = "INFO"            # its log level, and that of the aggregators it starts

    @classmethod
    def from_env(cls, environ: Environ = os.environ) -> "MasterConfig":
        """The defaults, with the state directory (``$AUTOPS_STATE_DIR``, else
        ``~/.dlrt/autops``) and the log level (``$AUTOPS_LOG``) from ``environ``."""
        return cls(state_dir=_state_dir(environ), log_level=log_level(environ))
