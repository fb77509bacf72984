"""Proving knowledge of a shared secret without sending it: HMAC-SHA256 over a fresh nonce.

The cluster key (``dlrt.keys``) and a job's secret are never sent; a peer proves it holds
one by answering a challenge: ``proof(secret, nonce, role, *context)`` is
HMAC-SHA256(secret, role || nonce || context...). The verifier makes the nonce
(``new_nonce``, 16 random bytes, used once), so a recorded answer is worth nothing later
(replay), and ``role`` keeps an answer given as one side from serving as the other's
(reflection). ``check`` compares in constant time. The C data server of Infiniswap computes
the same function with OpenSSL's libcrypto, so Python and C proofs agree byte for byte.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["NONCE_BYTES", "new_nonce", "proof", "check", "secret_digest", "digest_matches"]

NONCE_BYTES = 16


def new_nonce() -> bytes:
    """A fresh challenge."""
    return secrets.token_bytes(NONCE_BYTES)


def _bytes(part: bytes | str | int) -> bytes:
    if isinstance(part, bytes):
        return part
    if isinstance(part, int):
        return str(part).encode()
    return part.encode()


def proof(secret: bytes, nonce: bytes, role: str, *context: bytes | str | int) -> bytes:
    """HMAC-SHA256(secret, role NUL nonce (NUL context)...): the answer to ``nonce``."""
    mac = hmac.new(secret, _bytes(role) + b"\0" + nonce, hashlib.sha256)
    for part in context:
        mac.update(b"\0" + _bytes(part))
    return mac.digest()


def check(secret: bytes, nonce: bytes, answer: object, role: str, *context: bytes | str | int) -> bool:
    """Whether ``answer`` is ``proof(secret, nonce, role, *context)`` (constant time)."""
    if not isinstance(answer, bytes) or not nonce:
        return False
    return hmac.compare_digest(answer, proof(secret, nonce, role, *context))


def secret_digest(secret: str, salt: bytes | None = None) -> tuple[bytes, bytes]:
    """(salt, SHA-256(salt || secret)): what a service keeps of a secret it must recognise
    later (a job's, across its restarts) without keeping the secret. Secrets here are random
    tokens of 128 bits or more, so a fast hash is enough (no password stretching)."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    return salt, hashlib.sha256(salt + secret.encode()).digest()


def digest_matches(secret: object, salt: bytes, digest: bytes) -> bool:
    """Whether ``secret`` is the one ``(salt, digest)`` was made from (constant time)."""
    if not isinstance(secret, str) or not secret:
        return False
    return hmac.compare_digest(secret_digest(secret, salt)[1], digest)
