"""The data server's cluster-key handshake, in Python (``csrc/infiniswap/isw_auth.h`` has the
wire format and is what devices run): for tools and tests that talk to a data server from
Python.  The proofs are ``dlrt.proof``'s, the same function the C core computes.

    sock = socket.create_connection((host, port))
    client_handshake(sock, key)      # raises HandshakeRefused / HandshakeError
    ... READ / WRITE requests (isw_proto.h) ...
"""
from __future__ import annotations

import socket
import struct

from dlrt.proof import NONCE_BYTES, check, new_nonce, proof

__all__ = ["HandshakeError", "HandshakeRefused", "HELLO", "ANSWER", "VERDICT", "DEVICE_ROLE",
           "DAEMON_ROLE", "parse_hello", "answer", "parse_verdict", "client_handshake",
           "server_handshake", "recv_exact"]

VERSION = 1
HELLO_MAGIC, ANSWER_MAGIC, VERDICT_MAGIC = 0x48575349, 0x41575349, 0x56575349
HELLO = struct.Struct(f"<IHH{NONCE_BYTES}s")             # magic, version, 0, nonce_s
ANSWER = struct.Struct(f"<IHH32s{NONCE_BYTES}s")         # magic, version, 0, proof_c, nonce_c
VERDICT = struct.Struct("<Ii32s")                        # magic, status, proof_s
DEVICE_ROLE, DAEMON_ROLE = "isw-device", "isw-daemon"


class HandshakeError(OSError):
    """The peer does not speak the handshake (or broke the connection during it)."""


class HandshakeRefused(HandshakeError):
    """One side did not prove the cluster key."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; ``HandshakeError`` if it closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeError(f"the connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def parse_hello(data: bytes) -> bytes:
    """The server's nonce in a HELLO."""
    magic, version, _, nonce_s = HELLO.unpack(data)
    if magic != HELLO_MAGIC or version != VERSION:
        raise HandshakeError(f"not a HELLO of version {VERSION}: {data[:8].hex()}")
    return nonce_s


def answer(key: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """The ANSWER to ``nonce_s`` carrying our challenge ``nonce_c``."""
    return ANSWER.pack(ANSWER_MAGIC, VERSION, 0, proof(key, nonce_s, DEVICE_ROLE), nonce_c)


def parse_verdict(key: bytes, nonce_s: bytes, nonce_c: bytes, data: bytes) -> None:
    """Check a VERDICT: ``HandshakeRefused`` when the server refused us or cannot prove the key."""
    magic, status, proof_s = VERDICT.unpack(data)
    if magic != VERDICT_MAGIC:
        raise HandshakeError(f"not a VERDICT: {data[:8].hex()}")
    if status != 0:
        raise HandshakeRefused(-status, f"the data server refused our proof (status {status})")
    if not check(key, nonce_c, proof_s, DAEMON_ROLE, nonce_s):
        raise HandshakeRefused("the data server could not prove the cluster key")


def client_handshake(sock: socket.socket, key: bytes) -> tuple[bytes, bytes]:
    """The client's side of the whole handshake on a connected socket; returns
    ``(nonce_s, nonce_c)``."""
    nonce_s = parse_hello(recv_exact(sock, HELLO.size))
    nonce_c = new_nonce()
    sock.sendall(answer(key, nonce_s, nonce_c))
    parse_verdict(key, nonce_s, nonce_c, recv_exact(sock, VERDICT.size))
    return nonce_s, nonce_c


def server_handshake(sock: socket.socket, key: bytes) -> None:
    """The server's side on an accepted socket (a data server written in Python, for tests):
    ``HandshakeRefused`` after sending the refusing VERDICT when the client's proof is wrong."""
    nonce_s = new_nonce()
    sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION, 0, nonce_s))
    magic, version, _, proof_c, nonce_c = ANSWER.unpack(recv_exact(sock, ANSWER.size))
    if magic != ANSWER_MAGIC or version != VERSION or not check(key, nonce_s, proof_c, DEVICE_ROLE):
        sock.sendall(VERDICT.pack(VERDICT_MAGIC, -13, bytes(32)))      # -EACCES
        raise HandshakeRefused("the client did not prove the cluster key")
    sock.sendall(VERDICT.pack(VERDICT_MAGIC, 0, proof(key, nonce_c, DAEMON_ROLE, nonce_s)))
