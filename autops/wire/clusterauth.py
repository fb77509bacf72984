"""pMaster and its aggregators prove the cluster key to each other, then seal their control channel.

Registration is a mutual challenge-response over the cluster key (``dlrt.keys``: never
sent; ``dlrt.proof``: HMAC-SHA256 over fresh nonces):

1. aggregator -> pMaster: ``REGISTER_AGG`` with a nonce ``Na`` (nothing else is trusted yet);
2. pMaster -> aggregator: its proof over ``Na`` and a nonce ``Nm`` of its own
   (``MasterHandshake.challenge``); the aggregator checks the proof (``verify_master``) and
   refuses to go on with a peer that does not hold the key (an impostor at pMaster's address);
3. aggregator -> pMaster: ``REGISTER_AGG`` with everything it registers (its held jobs, with
   their secrets, are only sent now) and its proof over ``Nm`` (``answer``); pMaster checks
   it (``MasterHandshake.finish``: ``Nm`` is used once) and registers the aggregator.

Both ends then derive a session key from the cluster key and both nonces and every later
control message, either way, carries a seal: a trailing frame with a sequence number and
an HMAC over it, the direction and the header (``ControlSession``). So the commands and
state pMaster sends (ASSIGN, RELEASE_JOB, MIGRATE_*, REPLICA_PREPARE, FAILOVER, REPLICA_SET, CYCLE) are
accepted by an aggregator only when they carry pMaster's seal of the current session, and
the reports an aggregator sends (heartbeats, answers, TENSOR_COPY_DONE, WORKER_DONE,
MIGRATE_CUTOVER) only when sealed by that aggregator's session: a peer that connects to
either side without the cluster key -- or takes over pMaster's port, or replays a recorded
message (the sequence only goes up) -- is refused and counted. Sealing is used rather than
trusting the connection because without CURVE (loopback deployments) a ZeroMQ connection
authenticates nobody.

What one aggregator sends another (TENSOR_COPY, REPLICATE) goes over the data listeners, so
it carries a ticket instead (``peer_ticket``): a proof of the cluster key bound to the job
and its secret.
"""
from __future__ import annotations

import hmac
import struct
from typing import Sequence

from dlrt.proof import new_nonce, proof

__all__ = ["MASTER_ROLE", "AGGREGATOR_ROLE", "ControlSession", "MasterHandshake", "verify_master", "answer",
           "session_key", "new_nonce", "PEER_OPS", "peer_ticket", "check_peer_ticket"]

MASTER_ROLE = "autops-pmaster"
AGGREGATOR_ROLE = "autops-aggregator"
_SESSION_ROLE = "autops-session"
_SEQ = struct.Struct(">Q")
SEAL_BYTES = _SEQ.size + 32
TO_AGGREGATOR = b"m2a"
TO_MASTER = b"a2m"
PEER_OPS = frozenset({"tensor_copy", "replicate"})     # aggregator -> aggregator (``wire``)


def _bytes(frame: object) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def verify_master(cluster: bytes, nonce: bytes, challenge: object, answer_: object) -> bool:
    """Step 2, aggregator side: whether pMaster's ``answer_`` proves the cluster key over our ``nonce``."""
    return isinstance(challenge, bytes) and len(challenge) >= 16 and isinstance(answer_, bytes) and \
        hmac.compare_digest(answer_, proof(cluster, nonce, MASTER_ROLE, challenge))


def answer(cluster: bytes, challenge: bytes, nonce: bytes) -> bytes:
    """Step 3, aggregator side: our proof over pMaster's ``challenge``."""
    return proof(cluster, challenge, AGGREGATOR_ROLE, nonce)


def session_key(cluster: bytes, nonce: bytes, challenge: bytes) -> bytes:
    """The key sealing one registration's control messages (both ends derive it)."""
    return proof(cluster, nonce + challenge, _SESSION_ROLE)


class ControlSession:
    """Seals what one end sends and opens what it receives on an authenticated control channel."""

    def __init__(self, key: bytes, send_direction: bytes, recv_direction: bytes) -> None:
        self._key = key
        self._send_direction, self._recv_direction = send_direction, recv_direction
        self._sent = 0
        self._received = 0

    @classmethod
    def for_aggregator(cls, key: bytes) -> "ControlSession":
        return cls(key, TO_MASTER, TO_AGGREGATOR)

    @classmethod
    def for_master(cls, key: bytes) -> "ControlSession":
        return cls(key, TO_AGGREGATOR, TO_MASTER)

    def _mac(self, seq: bytes, direction: bytes, header: bytes) -> bytes:
        return hmac.new(self._key, direction + seq + header, "sha256").digest()

    def seal(self, frames: list) -> list:
        """``frames`` (one header) with a seal frame appended."""
        if len(frames) != 1:
            raise ValueError("a control message is one header frame")
        self._sent += 1
        seq = _SEQ.pack(self._sent)
        return [*frames, seq + self._mac(seq, self._send_direction, _bytes(frames[0]))]

    def open(self, frames: Sequence) -> list | None:
        """The header frame of a sealed message, or None when the seal is missing, wrong or replayed."""
        if len(frames) != 2:
            return None
        seal = _bytes(frames[1])
        if len(seal) != SEAL_BYTES:
            return None
        seq = seal[:_SEQ.size]
        if not hmac.compare_digest(seal[_SEQ.size:], self._mac(seq, self._recv_direction, _bytes(frames[0]))):
            return None
        number = _SEQ.unpack(seq)[0]
        if number <= self._received:
            return None
        self._received = number
        return [frames[0]]


class MasterHandshake:
    """pMaster's side of the registration handshake: the challenges it issued, by peer identity."""

    MAX_PENDING = 1024

    def __init__(self, cluster: bytes) -> None:
        self._cluster = cluster
        self._pending: dict[bytes, tuple[bytes, bytes]] = {}    # identity -> (Na, Nm)

    def challenge(self, identity: bytes, nonce: object) -> dict:
        """Step 2: the reply fields to a hello with ``nonce`` (ValueError when it is malformed)."""
        if not isinstance(nonce, bytes) or not 16 <= len(nonce) <= 64:
            raise ValueError("register_agg: 'nonce' must be 16 to 64 bytes")
        if len(self._pending) >= self.MAX_PENDING and identity not in self._pending:
            self._pending.pop(next(iter(self._pending)))        # the oldest unanswered challenge
        mine = new_nonce()
        self._pending[identity] = (nonce, mine)
        return {"challenge": mine, "proof": proof(self._cluster, nonce, MASTER_ROLE, mine)}

    def finish(self, identity: bytes, nonce: object, answer_: object) -> ControlSession | None:
        """Step 3: the session when ``answer_`` proves the key over the challenge issued to
        ``identity`` for ``nonce`` (used once either way), else None."""
        pending = self._pending.pop(identity, None)
        if pending is None or pending[0] != nonce or not isinstance(answer_, bytes):
            return None
        na, nm = pending
        if not hmac.compare_digest(answer_, answer(self._cluster, nm, na)):
            return None
        return ControlSession.for_master(session_key(self._cluster, na, nm))


# --- aggregator to aggregator -----------------------------------------------------------------
PEER_ROLE = "autops-aggregator-peer"


def peer_ticket(cluster: bytes, job: str, secret: str) -> bytes:
    """What an aggregator's TENSOR_COPY and REPLICATE carry: a proof of the cluster key bound to
    the job and its secret. The receiver holds the cluster key and checks it
    (``check_peer_ticket``); it is worth nothing for another job, and to someone without the
    cluster key it cannot be made. (It may be replayed for the same job by whoever saw it, who
    then also saw the job's secret sent beside it: CURVE keeps both off the network beyond
    loopback.)"""
    return proof(cluster, job.encode(), PEER_ROLE, secret)


def check_peer_ticket(cluster: bytes, job: object, secret: object, ticket: object) -> bool:
    return isinstance(job, str) and isinstance(secret, str) and isinstance(ticket, bytes) and \
        hmac.compare_digest(ticket, peer_ticket(cluster, job, secret))
