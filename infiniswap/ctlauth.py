"""Proofs of the cluster key on Infiniswap's control channel (docs/infiniswap.md, "Security").

A daemon lends memory only to devices that proved the cluster key, and a device maps only
memory offered by a daemon that proved it; both proofs are ``dlrt.proof`` answers to the
other side's fresh nonce, so the key never travels and a recorded answer is worth nothing
later:

* the daemon hands each control peer (a device's ZeroMQ routing id) a *challenge* in its
  FREE_MEM and PONG replies; the device's MAP carries ``proof(key, challenge,
  "isw-device-ctl", routing id)``. A peer whose proof checks is *proven* from then on (its
  routing id holds 128 random bits and is bound into the proof, so another peer cannot
  take it over); MAP and UNMAP from a peer that is not are refused and counted
  (``DaemonAuth``);
* the device's MAP also carries its own nonce; the daemon's MR_INFO answers it with
  ``proof(key, nonce, "isw-daemon-ctl", <the lease and the memory it offers>)``
  (``offer_context``), which the device checks before it opens that memory: the shared
  memory path of a daemon on the same host (``shm_path``) is mapped only when this proof
  holds, and the TCP data path proves the key again per connection in C
  (``csrc/infiniswap/isw_auth.h``).

This holds with CURVE off (loopback) and on: CURVE authenticates and encrypts the
connection, these proofs say the peer is a member of the cluster (a tenant's CURVE key does
not make it one).
"""
from __future__ import annotations

from typing import Any, Mapping

from dlrt.proof import check, new_nonce, proof
from infiniswap.peerrecords import PeerRecords

__all__ = ["DEVICE_ROLE", "DAEMON_ROLE", "DaemonAuth", "device_proof", "offer_context",
           "offer_proof", "offer_proven", "new_nonce_hex"]

DEVICE_ROLE = "isw-device-ctl"
DAEMON_ROLE = "isw-daemon-ctl"
_HEX_NONCE = 32         # 16 bytes


def _unhex(text: Any) -> bytes | None:
    if not isinstance(text, str) or len(text) > 128:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def new_nonce_hex() -> str:
    """A fresh nonce as the control messages carry it (hex)."""
    return new_nonce().hex()


def device_proof(key: bytes, challenge: str, identity: bytes) -> str:
    """A device's answer to a daemon's ``challenge`` for its routing ``identity`` (hex)."""
    nonce = _unhex(challenge)
    if not nonce:
        raise ValueError(f"not a challenge: {challenge!r}")
    return proof(key, nonce, DEVICE_ROLE, identity).hex()


def offer_context(fields: Mapping[str, Any]) -> tuple[str | int, ...]:
    """What a daemon's proof in MR_INFO vouches for: the lease and the memory it offers."""
    return tuple("" if fields.get(name) is None else fields[name]
                 for name in ("slab", "region", "size", "generation", "instance", "host_id",
                              "host", "data_port", "shm_path", "rdma_addr", "rdma_rkey"))


def offer_proof(key: bytes, nonce: str, fields: Mapping[str, Any]) -> str | None:
    """The daemon's proof for an MR_INFO of ``fields`` answering the device's ``nonce``
    (None when the MAP carried no usable nonce)."""
    raw = _unhex(nonce)
    if not raw:
        return None
    return proof(key, raw, DAEMON_ROLE, *offer_context(fields)).hex()


def offer_proven(key: bytes, nonce: str, fields: Mapping[str, Any]) -> bool:
    """Whether an MR_INFO of ``fields`` proves the cluster key for the device's ``nonce``."""
    answer = _unhex(fields.get("proof"))
    raw = _unhex(nonce)
    return answer is not None and raw is not None and \
        check(key, raw, answer, DAEMON_ROLE, *offer_context(fields))


class DaemonAuth:
    """A daemon's proofs of its control peers: the challenge each one got and the ones that
    proved the key, kept in the peer's record (``peerrecords.PeerRecords``: bounded, expired
    by the daemon; default: a table of its own with ``ControlLimits``' defaults), and the
    refusals.  A peer that gets no record (the table is full of pinned ones) gets no
    challenge and is not admitted.  Used from the daemon's control thread only."""

    def __init__(self, key: bytes, records: PeerRecords | None = None) -> None:
        if records is None:
            from infiniswap.limits import ControlLimits
            lim = ControlLimits()
            records = PeerRecords(lim.max_peers, lim.peer_ttl, lim.rate, lim.burst)
        self._key = key
        self._records = records
        self.refusals = 0

    def challenge(self, peer: bytes) -> str | None:
        """The challenge for ``peer`` (hex; the same until it is answered or its record is
        dropped), None once it is proven or when it has no record."""
        rec = self._records.get(peer) or self._records.seen(peer)
        if rec is None or rec.proven:
            return None
        if rec.challenge is None:
            rec.challenge = new_nonce()
        return rec.challenge.hex()

    def admit(self, peer: bytes, answer: Any) -> bool:
        """Whether ``peer`` may change state: proven before, or ``answer`` (the MAP's
        ``proof``) answers its challenge now.  A refusal is counted."""
        rec = self._records.get(peer)
        if rec is not None and rec.proven:
            return True
        raw = _unhex(answer)
        if rec is not None and rec.challenge is not None and raw is not None and \
                check(self._key, rec.challenge, raw, DEVICE_ROLE, peer):
            rec.challenge = None
            rec.proven = True
            return True
        self.refusals += 1
        return False

    def proven(self, peer: bytes) -> bool:
        rec = self._records.get(peer)
        return rec is not None and rec.proven

    def forget(self, peer: bytes) -> None:
        """``peer`` is gone: its record goes, it proves the key again if it comes back."""
        self._records.forget(peer)
