"""The shared security pieces: the key directory, HMAC proofs, CURVE on sockets and its guard."""
from __future__ import annotations

import os
import socket
import stat
import time

import pytest
import zmq
from hypothesis import given, settings, strategies as st

from dlrt import keys, proof
from dlrt.curve import Security, refusal_counts, warn_if_exposed
from dlrt.keys_cli import add_keys_commands  # noqa: F401  (the CLI module imports)
from dlrt.main import main as dlrt_main


# --- the key directory -----------------------------------------------------------------------
def test_first_start_makes_private_cluster_key_and_token_once(tmp_path):
    d = tmp_path / "k"
    secret = keys.ensure_cluster_secret(d)
    token = keys.ensure_operator_token(d)
    assert len(secret) == 32 and token
    assert keys.ensure_cluster_secret(d) == secret and keys.ensure_operator_token(d) == token
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for name in (keys.CLUSTER_SECRET, keys.OPERATOR_TOKEN):
        assert stat.S_IMODE(os.stat(d / name).st_mode) == 0o600
    assert not keys.Keys.load(d).curve           # no CURVE keys: CURVE stays off


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    keys.ensure_cluster_secret(tmp_path)
    os.chmod(tmp_path / keys.CLUSTER_SECRET, 0o644)
    with pytest.raises(keys.KeysError, match="readable by other users"):
        keys.ensure_cluster_secret(tmp_path)


def test_init_tenant_revoke(tmp_path):
    cluster = keys.init_keys(tmp_path / "cluster")
    loaded = keys.Keys.load(cluster)
    assert loaded.curve and loaded.server_secret and loaded.client_secret
    assert keys.authorized_names(cluster) == ["member"]
    tenant = keys.add_tenant("alice", tmp_path / "alice", cluster)
    t = keys.Keys.load(tenant)
    assert t.curve and t.server_public == loaded.server_public and t.server_secret is None
    assert t.client_public != loaded.client_public
    assert not (tenant / keys.CLUSTER_SECRET).exists() and not (tenant / keys.OPERATOR_TOKEN).exists()
    assert keys.authorized_names(cluster) == ["alice", "member"]
    assert keys.revoke("alice", cluster) and not keys.revoke("alice", cluster)
    with pytest.raises(ValueError):
        keys.add_tenant("../evil", tmp_path / "x", cluster)


def test_curve_off_switch(tmp_path, monkeypatch):
    cluster = keys.init_keys(tmp_path)
    monkeypatch.setenv("DLRT_CURVE", "0")
    assert not keys.Keys.load(cluster).curve


def test_keys_cli(tmp_path, capsys):
    d = tmp_path / "k"
    assert dlrt_main(["keys", "init", "--dir", str(d)]) == 0
    assert dlrt_main(["keys", "tenant", "bob", "--out", str(tmp_path / "bob"), "--dir", str(d)]) == 0
    assert dlrt_main(["keys", "show", "--dir", str(d), "--json", "-"]) == 0
    out = capsys.readouterr().out
    assert '"authorized": [' in out and "bob" in out
    assert keys.read_secret_file(d / keys.OPERATOR_TOKEN) not in out        # no secret printed
    assert dlrt_main(["keys", "revoke", "nobody", "--dir", str(d)]) == 1
    with pytest.raises(SystemExit) as exc:
        dlrt_main(["keys", "tenant", "b/ad", "--out", str(tmp_path / "x"), "--dir", str(d)])
    assert exc.value.code == 2


# --- proofs ----------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(secret=st.binary(min_size=16, max_size=64), other=st.binary(min_size=16, max_size=64),
       context=st.text(max_size=20))
def test_proofs_bind_secret_nonce_role_and_context(secret, other, context):
    nonce = proof.new_nonce()
    answer = proof.proof(secret, nonce, "device", context)
    assert proof.check(secret, nonce, answer, "device", context)
    assert not proof.check(secret, proof.new_nonce(), answer, "device", context)     # replayed on a new nonce
    assert not proof.check(secret, nonce, answer, "daemon", context)                 # reflected
    assert not proof.check(secret, nonce, answer[:-1], "device", context)            # truncated
    if other != secret:
        assert not proof.check(other, nonce, answer, "device", context)
    assert not proof.check(secret, nonce, "not bytes", "device", context)


def test_secret_digest_recognises_only_the_secret():
    salt, digest = proof.secret_digest("s3cret")
    assert proof.digest_matches("s3cret", salt, digest)
    assert not proof.digest_matches("s3cres", salt, digest)
    assert not proof.digest_matches(None, salt, digest)
    assert proof.secret_digest("s3cret")[1] != digest        # a fresh salt each time


# --- CURVE on sockets ------------------------------------------------------------------------
@pytest.fixture
def curve_server(tmp_path):
    """A ROUTER serving CURVE on loopback with a fresh cluster's keys; yields (address, cluster dir)."""
    cluster = keys.init_keys(tmp_path / "cluster")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    Security(keys.Keys.load(cluster)).server(router, "tcp://127.0.0.1:0")
    router.bind("tcp://127.0.0.1:0")
    try:
        yield ctx, router, router.getsockopt_string(zmq.LAST_ENDPOINT), cluster
    finally:
        router.close(0)
        ctx.term()


def _reaches(ctx, router, address, security, payload: bytes) -> bool:
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    try:
        if security is not None:
            security.client(client, address)
        client.connect(address)
        client.send(payload)
        if not router.poll(1000):
            return False
        return router.recv_multipart()[-1] == payload
    finally:
        client.close(0)


def _wait_for_refusal(before: dict, reason_prefix: str = "curve_") -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = refusal_counts()
        if sum(v for k, v in now.items() if k.startswith(reason_prefix)) > \
                sum(v for k, v in before.items() if k.startswith(reason_prefix)):
            return now
        time.sleep(0.02)
    raise AssertionError(f"no refusal counted: {refusal_counts()}")


def test_members_and_tenants_are_served(curve_server, tmp_path):
    ctx, router, address, cluster = curve_server
    assert _reaches(ctx, router, address, Security(keys.Keys.load(cluster)), b"member")
    alice = keys.add_tenant("alice", tmp_path / "alice", cluster)
    assert _reaches(ctx, router, address, Security(keys.Keys.load(alice)), b"alice")


@pytest.mark.parametrize("who", ["revoked tenant", "plaintext", "other cluster"])
def test_strangers_are_refused_and_counted(curve_server, tmp_path, who):
    ctx, router, address, cluster = curve_server
    if who == "revoked tenant":
        security = Security(keys.Keys.load(keys.add_tenant("eve", tmp_path / "eve", cluster)))
        keys.revoke("eve", cluster)
    elif who == "plaintext":
        security = None
    else:
        security = Security(keys.Keys.load(keys.init_keys(tmp_path / "other")))
    before = refusal_counts()
    assert not _reaches(ctx, router, address, security, b"let me in")
    _wait_for_refusal(before)


def test_a_truncated_or_garbage_handshake_is_refused_and_counted(curve_server):
    ctx, router, address, _ = curve_server
    host, port = address[len("tcp://"):].rsplit(":", 1)
    before = refusal_counts()
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        # a ZMTP 3 greeting announcing CURVE as a client, then a HELLO command cut short
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31
        raw.sendall(greeting + b"\x04\x20\x05HELLO" + b"\0" * 10)
        raw.settimeout(2)
        try:
            while raw.recv(4096):
                pass
        except (socket.timeout, ConnectionResetError):
            pass
    assert not router.poll(200)
    _wait_for_refusal(before)


def test_ipc_stays_plaintext_and_curve_off_changes_nothing(tmp_path):
    security = Security(keys.Keys.load(keys.init_keys(tmp_path / "c")))
    off = Security(keys.Keys.load(tmp_path / "none"))
    ctx = zmq.Context()
    sockets = [ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)]
    try:
        security.server(sockets[0], f"ipc://{tmp_path}/s.sock")
        off.client(sockets[1], "tcp://127.0.0.1:1")
        security.client(sockets[2], "tcp://127.0.0.1:1")
        security.client(sockets[3], "tcp://127.0.0.1:1")
        security.client(sockets[3], f"ipc://{tmp_path}/s.sock")       # the next connect is plain again
        assert [s.mechanism for s in sockets] == [zmq.NULL, zmq.NULL, zmq.CURVE, zmq.NULL]
    finally:
        for sock in sockets:
            sock.close(0)
        ctx.term()


def test_binding_beyond_loopback_without_curve_warns(tmp_path, caplog):
    off = Security(keys.Keys.load(tmp_path / "none"))
    on = Security(keys.Keys.load(keys.init_keys(tmp_path / "c")))
    assert not warn_if_exposed("svc", "tcp://127.0.0.1:5555", off)
    assert warn_if_exposed("svc", "tcp://0.0.0.0:5556", off)
    assert "WITHOUT CURVE" in caplog.text
    assert not warn_if_exposed("svc", "tcp://0.0.0.0:5557", on)
