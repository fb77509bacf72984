"""What an agent and its I/O thread (``ioloop.IOLoop``) share besides the commands: the
rank's settings (``LoopConfig``), what the I/O thread counts (``Counters``) and what the rank
registered and declared (``Registration``), which the agent fills and the I/O thread reads
to register again with a restarted pMaster."""
from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from dlrt.curve import Security

from ..config import TransportConfig


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """Who this rank is and how its I/O thread works, fixed when the agent starts: its
    arguments, and what its ``AgentConfig`` gave where they said nothing."""
    job: str
    rank: int
    master: str                        # pMaster's address
    aggregators: tuple[str, ...]       # the job's aggregators when it registered
    timeout: float                     # seconds a request waits for its reply
    fault_tolerant: bool               # keep pushes until no rank can need them again
    mode: str                          # the job's default mode: "sum" or "server"
    warm_bytes: int                    # carried over each TCP connection opened for a move
    transport: str                     # the transport's name (``autops.transport.TRANSPORTS``)
    security: Security
    ctx: zmq.Context
    coalesce: bool                     # large keys' pushes to one aggregator go as one message per burst
    transport_config: TransportConfig  # the transport's settings (``AgentConfig.transport_config``)


@dataclass(slots=True)
class Counters:
    """What the I/O thread counts for the agent's callers."""
    # requests an aggregator answered with REDIRECT (the key had moved): each costs a round
    # trip and a resend; live migration tells the agents ahead, so it should stay 0
    redirects: int = 0
    # connections warmed ahead of a move (``IOLoop.warm``): answers that came back
    warmed: int = 0


@dataclass(slots=True)
class Registration:
    """What this rank told pMaster, to tell a restarted pMaster again (``IOLoop.rejoin``):
    REGISTER_JOB's ``fields``, the job's ``secret`` (every request carries it; the agent's
    ``secret`` attribute reads and sets it) and the tensors ``declared`` since (filled by the
    agent); ``done``: the rank left the job (no more probes)."""
    fields: dict
    secret: str
    declared: list = field(default_factory=list)
    done: bool = False

    @property
    def partition_bytes(self) -> int | None:
        """The job's partition size: the one set, else pMaster's choice (known after a declare)."""
        return self.fields["partition_bytes"]
