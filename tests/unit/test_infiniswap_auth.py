"""The cluster-key proofs of Infiniswap, without processes: the C core's HMAC (OpenSSL) equals
``dlrt.proof``'s; the data server's handshake state machine on the wire, each way it can go
wrong (wrong key, garbled, truncated, replayed answer, a request before the handshake, a
silent peer); the client's refusal of a server that cannot prove the key; the control
channel's challenge bookkeeping (``ctlauth``)."""
from __future__ import annotations

import errno
import os
import socket
import struct
import threading

import pytest

from dlrt.proof import proof
from infiniswap import handshake as hs
from infiniswap.core import PAGE_SIZE, CoreDevice, DataServer, SlabStore, auth_proof
from infiniswap.ctlauth import DaemonAuth, device_proof, new_nonce_hex, offer_proof, offer_proven

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20
KEY = bytes(range(32))
REQ = struct.Struct("<IHHQIQQ")
MAGIC, VERSION, READ = 0x50575349, 2, 1


@pytest.mark.parametrize("key_len", [16, 32, 64])
def test_c_proof_equals_python_proof(key_len):
    for _ in range(20):
        key, nonce, ctx = os.urandom(key_len), os.urandom(16), os.urandom(16)
        assert auth_proof(key, nonce, "isw-device") == proof(key, nonce, "isw-device")
        assert auth_proof(key, nonce, "isw-daemon", ctx) == proof(key, nonce, "isw-daemon", ctx)
    assert auth_proof(KEY, nonce, "isw-device") != auth_proof(KEY, nonce, "isw-daemon")


def test_keys_of_the_wrong_size_are_refused(tmp_path):
    with SlabStore(4 * MiB, MiB, lock=False) as store:
        with pytest.raises(ValueError, match="16..64 bytes"):
            DataServer(store, key=b"short")
        with pytest.raises(ValueError, match="16..64 bytes"):
            DataServer(store, key=bytes(65))
    with CoreDevice(MiB, MiB, tmp_path / "b") as dev:
        with pytest.raises(ValueError, match="16..64 bytes"):
            dev.add_remote_tcp("127.0.0.1", 1, key=b"x" * 8)


@pytest.fixture
def store():
    s = SlabStore(4 * MiB, MiB, lock=False)
    yield s
    s.close()


@pytest.fixture
def server(store):
    srv = DataServer(store, key=KEY, handshake_timeout=0.2)
    yield srv
    srv.stop()


def connect(srv: DataServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port()), timeout=5)
    return s


def closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (reads what is left; blocks up to the timeout)."""
    try:
        while True:
            if not s.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_the_right_key_is_served(store, server):
    region = store.alloc_slab(lock=False)
    store.write(region, b"s" * PAGE_SIZE)
    with connect(server) as s:
        hs.client_handshake(s, KEY)
        s.sendall(REQ.pack(MAGIC, VERSION, READ, region, PAGE_SIZE, 1, store.generation(region)))
        assert hs.recv_exact(s, 16 + PAGE_SIZE)[16:] == b"s" * PAGE_SIZE
    st = server.stats()
    assert (st.auth_successes, st.auth_refusals, st.requests) == (1, 0, 1)


@pytest.mark.parametrize("case", ["wrong-key", "garbled", "replayed", "request-first"])
def test_a_bad_answer_gets_a_refusal_and_the_connection_closes(store, server, case):
    region = store.alloc_slab(lock=False)
    store.write(region, b"s" * PAGE_SIZE)
    if case == "replayed":                      # an answer recorded on an earlier connection
        with connect(server) as s:
            nonce_s = hs.parse_hello(hs.recv_exact(s, hs.HELLO.size))
            recorded = hs.answer(KEY, nonce_s, os.urandom(16))
            s.sendall(recorded)
            assert struct.unpack("<Ii", hs.recv_exact(s, hs.VERDICT.size)[:8])[1] == 0
    with connect(server) as s:
        hello = hs.recv_exact(s, hs.HELLO.size)
        nonce_s = hs.parse_hello(hello)
        payload = {
            "wrong-key": hs.answer(os.urandom(32), nonce_s, os.urandom(16)),
            "garbled": os.urandom(hs.ANSWER.size),
            "replayed": recorded if case == "replayed" else b"",
            # a READ of the slab straight away, padded to an answer's size: never served
            "request-first": REQ.pack(MAGIC, VERSION, READ, region, PAGE_SIZE, 1,
                                      store.generation(region)).ljust(hs.ANSWER.size, b"\0"),
        }[case]
        s.sendall(payload)
        magic, status, proof_s = hs.VERDICT.unpack(hs.recv_exact(s, hs.VERDICT.size))
        assert magic == hs.VERDICT_MAGIC and proof_s == bytes(32)
        assert status == (-errno.EACCES if case in ("wrong-key", "replayed") else -errno.EPROTO)
        assert closed(s)
    st = server.stats()
    assert st.auth_refusals == 1 and st.requests == 0 and st.bytes_read == 0
    assert "proof" in server.last_refusal() or "answer" in server.last_refusal()


def test_truncated_and_silent_peers_are_closed_and_counted(server):
    with connect(server) as s:                  # half an answer, then hang up
        nonce_s = hs.parse_hello(hs.recv_exact(s, hs.HELLO.size))
        s.sendall(hs.answer(KEY, nonce_s, os.urandom(16))[:30])
    with connect(server) as s:                  # silent past the deadline (0.2 s)
        hs.recv_exact(s, hs.HELLO.size)
        assert closed(s)
    deadline_hit = server.stats()
    assert deadline_hit.auth_timeouts == 1
    with connect(server) as s:                  # a half answer and silence: the deadline again
        s.sendall(b"\x49\x53\x57")
        hs.recv_exact(s, hs.HELLO.size)
        assert closed(s)
    for _ in range(200):                        # the hang-up is seen by the server's loop
        st = server.stats()
        if st.auth_refusals == 3:
            break
        threading.Event().wait(0.01)
    assert (st.auth_refusals, st.auth_timeouts, st.auth_successes, st.requests) == (3, 2, 0, 0)


def fake_server(behaviour) -> tuple[socket.socket, threading.Thread]:
    """A listener whose one connection is handled by ``behaviour(conn)`` on a thread."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    lsock.settimeout(10)

    def run() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(10)
            try:
                behaviour(conn)
                conn.recv(1)                    # until the client closes
            except OSError:
                pass
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return lsock, th


def _bogus_proof(conn: socket.socket) -> None:
    """Accepts any answer and 'proves' with zeros: it does not hold the key."""
    conn.sendall(hs.HELLO.pack(hs.HELLO_MAGIC, 1, 0, os.urandom(16)))
    hs.recv_exact(conn, hs.ANSWER.size)
    conn.sendall(hs.VERDICT.pack(hs.VERDICT_MAGIC, 0, bytes(32)))


@pytest.mark.parametrize("behaviour, code, text", [
    (lambda c: hs.server_handshake(c, os.urandom(32)), errno.EACCES, "refused this device's proof"),
    (_bogus_proof, errno.EACCES, "could not prove the cluster key"),
    (lambda c: c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"), errno.EPROTO, "does not speak"),
    (lambda c: c.recv(1), errno.ETIMEDOUT, "no handshake"),
], ids=["other-key", "bogus-proof", "not-a-daemon", "silent"])
def test_the_client_refuses_a_server_that_cannot_prove_the_key(tmp_path, behaviour, code, text):
    lsock, th = fake_server(behaviour)
    try:
        with CoreDevice(MiB, MiB, tmp_path / "b") as dev:
            with pytest.raises(OSError, match=text) as e:
                dev.add_remote_tcp("127.0.0.1", lsock.getsockname()[1], connections=1,
                                   timeout=0.5, key=KEY)
            assert e.value.errno == code
    finally:
        th.join(10)
        lsock.close()


def test_a_python_server_with_the_key_is_accepted(tmp_path):
    lsock, th = fake_server(lambda c: hs.server_handshake(c, KEY))
    try:
        with CoreDevice(MiB, MiB, tmp_path / "b") as dev:
            assert dev.add_remote_tcp("127.0.0.1", lsock.getsockname()[1], connections=1,
                                      key=KEY) == 0
    finally:
        th.join(10)
        lsock.close()


# ---- the control channel (ctlauth) ----

def test_daemon_auth_admits_only_an_answer_to_its_challenge_for_that_peer():
    auth = DaemonAuth(KEY)
    challenge = auth.challenge(b"dev-a")
    assert auth.challenge(b"dev-a") == challenge                   # stable until answered
    assert not auth.admit(b"dev-a", None)
    assert not auth.admit(b"dev-a", device_proof(os.urandom(32), challenge, b"dev-a"))
    answer = device_proof(KEY, challenge, b"dev-a")
    assert not auth.admit(b"dev-b", answer)                        # another routing id
    assert not auth.admit(b"dev-a", "zz-not-hex")
    assert auth.refusals == 4
    assert auth.admit(b"dev-a", answer) and auth.proven(b"dev-a")
    assert auth.challenge(b"dev-a") is None and auth.admit(b"dev-a", None)
    auth.forget(b"dev-a")                                          # gone: prove again
    assert not auth.proven(b"dev-a")
    assert auth.challenge(b"dev-a") != challenge
    assert not auth.admit(b"dev-a", answer)                        # the old answer is spent


def test_a_daemons_offer_is_proven_only_as_sent_and_with_the_key():
    offer = {"slab": 3, "region": 0, "size": MiB, "generation": 7, "instance": "i1",
             "host_id": "h", "host": "127.0.0.1", "data_port": 7301, "shm_path": "/proc/1/fd/5"}
    nonce = new_nonce_hex()
    signed = dict(offer, proof=offer_proof(KEY, nonce, offer))
    assert offer_proven(KEY, nonce, signed)
    assert not offer_proven(KEY, new_nonce_hex(), signed)          # answers another MAP
    assert not offer_proven(os.urandom(32), nonce, signed)
    assert not offer_proven(KEY, nonce, dict(signed, shm_path="/proc/666/fd/5"))
    assert not offer_proven(KEY, nonce, dict(signed, data_port=6666))
    assert not offer_proven(KEY, nonce, offer)                     # no proof at all
    assert offer_proof(KEY, "", offer) is None
