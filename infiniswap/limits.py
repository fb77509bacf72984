"""Limits of an Infiniswap daemon against peers nobody has vouched for: its control socket
(``ControlLimits``: per-identity records, rate, ZeroMQ queues and message size) and its TCP
data server (``DataLimits``: connection cap, handshake deadline).

This module owns the defaults, reading them from the environment (a bad value is logged and
the default used) and turning them into ZeroMQ socket options; ``infiniswap.cli`` overrides
them with its options, ``peerrecords.PeerRecords`` and the C data server enforce them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, TypeVar

from dlrt.limits import env_positive, half_open_files

__all__ = ["ControlLimits", "DataLimits", "default_max_connections", "ZMQ_CONNECTION_BYTES",
           "DATA_MAX_CONNECTIONS_ENV", "DATA_HANDSHAKE_ENV", "CTL_MAX_PEERS_ENV",
           "CTL_PEER_TTL_ENV", "CTL_RATE_ENV", "CTL_MAX_MESSAGE_ENV"]

DATA_MAX_CONNECTIONS_ENV = "INFINISWAP_DATA_MAX_CONNECTIONS"
DATA_HANDSHAKE_ENV = "INFINISWAP_DATA_HANDSHAKE_S"
CTL_MAX_PEERS_ENV = "INFINISWAP_CTL_MAX_PEERS"
CTL_PEER_TTL_ENV = "INFINISWAP_CTL_PEER_TTL_S"
CTL_RATE_ENV = "INFINISWAP_CTL_RATE"
CTL_MAX_MESSAGE_ENV = "INFINISWAP_CTL_MAX_MESSAGE"

# What one control connection costs libzmq whatever its queues hold: a pipe chunk of 256
# messages (64 bytes each) each way, the encoder's and decoder's 8 KiB batches, the
# session and engine (measured on libzmq 4.3: about 46 KiB a connection with the default
# queues full of small messages).
ZMQ_CONNECTION_BYTES = 48 << 10
ZMQ_MESSAGE_BYTES = 64              # a queued message's own header (zmq_msg_t)
RECORD_BYTES = 1 << 10              # a peer record with its key, challenge and name, at most

T = TypeVar("T", int, float)


def default_max_connections(soft_nofile: int | None = None) -> int:
    """Half of the open-file limit, between 16 and 4096 (``dlrt.limits.half_open_files``): 512
    at the usual 1024. The other half is left to the control socket's connections, the slab
    store and everything else of the process."""
    return half_open_files(soft_nofile)


def _env(env: Mapping[str, str], name: str, default: T, cast: Callable[[str], T]) -> T:
    return env_positive(name, default, cast, env)


@dataclass(frozen=True)
class DataLimits:
    """The TCP data server's limits.  ``max_connections``: connections held at once (at the
    cap the oldest one that has not proved the cluster key is closed to make room; proven
    ones are kept); ``handshake_timeout``: seconds a connection has to prove the key."""

    max_connections: int
    handshake_timeout: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections {self.max_connections!r} must be an int >= 1")
        if not 0.001 <= self.handshake_timeout <= 3600:
            raise ValueError(f"handshake_timeout {self.handshake_timeout!r} must be in 0.001..3600 s")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DataLimits":
        """``$INFINISWAP_DATA_MAX_CONNECTIONS`` and ``$INFINISWAP_DATA_HANDSHAKE_S``, else the
        defaults."""
        env = os.environ if env is None else env
        return cls(_env(env, DATA_MAX_CONNECTIONS_ENV, default_max_connections(), int),
                   _env(env, DATA_HANDSHAKE_ENV, cls.handshake_timeout, float))


@dataclass(frozen=True)
class ControlLimits:
    """The control socket's limits (per ZeroMQ routing id, i.e. per peer).

    ``max_peers``: identities the daemon remembers (challenge, proof, name, shared-memory
    counts, rate bucket); a new one past it drops the least recently seen that does not hold
    leases.  ``peer_ttl``: seconds after which an identity not seen is forgotten (a proven
    one holding leases never is).  ``rate`` / ``burst``: messages per second (token bucket)
    an identity that has not proved the cluster key may send; the rest are dropped
    unanswered.  ``sndhwm`` / ``rcvhwm``: messages ZeroMQ queues per peer each way (a reply
    to a peer whose queue is full is dropped).  ``max_message``: bytes of the largest
    message accepted (a larger one closes that connection).  ``handshake_ivl``: seconds a
    connection has to finish the ZeroMQ (ZMTP/CURVE) handshake.  ``keepalive_idle``:
    seconds of silence before TCP keepalive probes a connection (dead peers are noticed).
    """

    max_peers: int = 4096
    peer_ttl: float = 300.0
    rate: float = 100.0
    burst: float = 300.0
    sndhwm: int = 32
    rcvhwm: int = 8
    max_message: int = 64 << 10
    handshake_ivl: float = 5.0
    keepalive_idle: int = 60

    def __post_init__(self) -> None:
        for name in ("max_peers", "sndhwm", "rcvhwm", "max_message", "keepalive_idle"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be an int >= 1")
        for name in ("peer_ttl", "rate", "burst", "handshake_ivl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)!r} must be above 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ControlLimits":
        """``$INFINISWAP_CTL_MAX_PEERS``, ``_PEER_TTL_S``, ``_RATE`` (burst: three seconds' worth)
        and ``_MAX_MESSAGE``, else the defaults."""
        env = os.environ if env is None else env
        rate = _env(env, CTL_RATE_ENV, cls.rate, float)
        return cls(max_peers=_env(env, CTL_MAX_PEERS_ENV, cls.max_peers, int),
                   peer_ttl=_env(env, CTL_PEER_TTL_ENV, cls.peer_ttl, float),
                   rate=rate, burst=max(1.0, 3 * rate),
                   max_message=_env(env, CTL_MAX_MESSAGE_ENV, cls.max_message, int))

    def connection_bytes(self, request: int | None = None, reply: int = 1 << 10) -> int:
        """Most memory one control connection holds: libzmq's own plus ``rcvhwm`` requests
        of ``request`` bytes (default ``max_message``, the worst case) and ``sndhwm`` replies
        of ``reply`` bytes queued (one partial request more in the decoder)."""
        request = self.max_message if request is None else request
        return (ZMQ_CONNECTION_BYTES + (self.rcvhwm + 1) * (ZMQ_MESSAGE_BYTES + request) +
                self.sndhwm * (ZMQ_MESSAGE_BYTES + reply))

    def records_bytes(self) -> int:
        """Most memory the per-peer records hold (``max_peers`` of them)."""
        return self.max_peers * RECORD_BYTES

    def socket_options(self) -> dict[str, int]:
        """ZeroMQ options of the control ROUTER (names of ``zmq`` constants)."""
        return {"SNDHWM": self.sndhwm, "RCVHWM": self.rcvhwm, "MAXMSGSIZE": self.max_message,
                "HANDSHAKE_IVL": int(self.handshake_ivl * 1000), "TCP_KEEPALIVE": 1,
                "TCP_KEEPALIVE_IDLE": self.keepalive_idle, "TCP_KEEPALIVE_INTVL": 10,
                "TCP_KEEPALIVE_CNT": 3}
