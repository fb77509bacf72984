"""Attacks on a live master's HTTP API from other local processes (loopback is not trusted).

A real ``tiresias master`` (local executor, 127.0.0.1, port 0) runs tenant alice's job, which
fails after printing a secret line: a failed job's ``detail`` carries the tail of its log.
Callers with no or a wrong token, a page that rebinds its DNS name to 127.0.0.1 (a foreign
``Host``), a cross-origin form post, tenant bob, a viewer and a slow-loris flood of stalled
connections each try; none may read alice's job or its log, or keep a victim from being
served.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
import sys
import time
import urllib.parse

import pytest

from tiresias.service.client import Client
from tiresias_live import MasterProcess, wait_for

pytestmark = pytest.mark.timeout(240)

SECRET = "ALICE-PRIVATE-7f3a9c"
READS = ("/", "/api/v1/dashboard", "/api/v1/jobs", "/api/v1/jobs/1", "/api/v1/jobs/1/logs", "/api/v1/events",
         "/api/v1/nodes", "/api/v1/summary")


def add_user(m: MasterProcess, name: str, role: str = "user") -> str:
    r = m.cli("master", "users", "add", name, "--role", role, "--json", "-")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["token"]


def raw(m: MasterProcess, method: str, path: str, headers: dict | None = None,
        body: bytes | None = None) -> tuple[int, bytes]:
    """One request with exactly these headers (http.client adds Host unless given)."""
    url = urllib.parse.urlsplit(m.client.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        headers = dict(headers or {})
        conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A master with alice's failed job (its log holds SECRET), tokens for alice, bob, carol (viewer)."""
    m = MasterProcess(tmp_path_factory.mktemp("attacks") / "state", "--nodes", "1x2", "--interval", "0.3").start()
    try:
        tokens = {"alice": add_user(m, "alice"), "bob": add_user(m, "bob"),
                  "carol": add_user(m, "carol", "viewer"), "operator": m.client.token}
        alice = Client(m.client.url, tokens["alice"])
        job = alice.post("/api/v1/jobs", {"gpus": 1, "name": "alices-model", "launcher": "plain",
                                          "command": [sys.executable, "-c", f"print({SECRET[:6]!r} + {SECRET[6:]!r}); "
                                                      "raise SystemExit(3)"]})       # SECRET: in the log only
        assert job["id"] == 1
        wait_for(lambda: alice.get("/api/v1/jobs/1")["status"] == "failed", 60, "alice's job to fail")
        assert SECRET in alice.get("/api/v1/jobs/1")["detail"]            # the owner sees the tail
        yield m, tokens
    finally:
        m.stop()


def test_reads_without_or_with_a_wrong_token_are_401_and_leak_nothing(cluster):
    m, tokens = cluster
    for headers in ({}, bearer("wrong"), bearer(tokens["alice"] + "x"), {"Cookie": "tiresias_token=wrong"}):
        for path in READS:
            status, body = raw(m, "GET", path, headers)
            assert status == 401, (path, headers)
            assert SECRET.encode() not in body and b"alices-model" not in body and b"alice" not in body, path
    status, body = raw(m, "GET", "/api/v1/dashboard", bearer(tokens["operator"]))
    assert status == 200 and SECRET.encode() in body                  # the operator reads everything


def test_a_foreign_host_header_is_403_even_with_a_token(cluster):
    m, tokens = cluster
    port = urllib.parse.urlsplit(m.client.url).port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "localhost.evil.example", ""):
        for path in ("/api/v1/dashboard", "/metrics", "/"):
            status, body = raw(m, "GET", path, {"Host": host, **bearer(tokens["operator"])})
            assert status == 403, (host, path)
            assert SECRET.encode() not in body and b"alices-model" not in body
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1", "LOCALHOST"):
        status, _ = raw(m, "GET", "/api/v1/summary", {"Host": host, **bearer(tokens["operator"])})
        assert status == 200, host
    text = raw(m, "GET", "/metrics")[1].decode()
    assert 'tiresias_auth_refusals_total{reason="host"}' in text


def test_cross_origin_writes_and_non_json_submits_are_refused(cluster):
    m, tokens = cluster
    port = urllib.parse.urlsplit(m.client.url).port
    spec = json.dumps({"gpus": 1, "name": "csrf", "command": ["true"], "launcher": "plain"}).encode()
    before = len(m.client.get("/api/v1/jobs"))
    for origin in ("http://evil.example", f"http://127.0.0.1:{port + 1}", "null", f"https://evil.example:{port}"):
        headers = {"Origin": origin, "Content-Type": "application/json", **bearer(tokens["operator"])}
        status, _ = raw(m, "POST", "/api/v1/jobs", headers, spec)
        assert status == 403, origin
        status, _ = raw(m, "POST", "/api/v1/jobs/1/cancel", headers, b"{}")
        assert status == 403, origin
        status, _ = raw(m, "POST", "/login", {"Origin": origin, "Content-Type": "application/x-www-form-urlencoded"},
                        f"token={tokens['bob']}".encode())
        assert status == 403, origin
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):       # what a page's form can send
        status, _ = raw(m, "POST", "/api/v1/jobs", {"Content-Type": ctype, **bearer(tokens["operator"])}, spec)
        assert status == 415, ctype
    assert len(m.client.get("/api/v1/jobs")) == before                   # nothing was submitted
    status, _ = raw(m, "POST", "/api/v1/jobs", {"Origin": f"http://127.0.0.1:{port}", "Content-Type": "application/json",
                                                **bearer(tokens["bob"])}, spec)
    assert status == 201                                                 # the master's own origin may


def test_tenant_bob_sees_nothing_of_alices_job_and_a_viewer_no_log(cluster):
    m, tokens = cluster
    for path in ("/api/v1/jobs/1", "/api/v1/jobs/1/logs"):
        status, body = raw(m, "GET", path, bearer(tokens["bob"]))
        assert status == 404 and SECRET.encode() not in body, path
    for path in ("/api/v1/jobs", "/api/v1/dashboard", "/api/v1/events?job=1", "/api/v1/events", "/api/v1/nodes"):
        status, body = raw(m, "GET", path, bearer(tokens["bob"]))
        assert status == 200, path
        assert SECRET.encode() not in body and b"alices-model" not in body, path
    carol = bearer(tokens["carol"])
    status, body = raw(m, "GET", "/api/v1/jobs/1/logs", carol)
    assert status == 403 and SECRET.encode() not in body
    for path in ("/api/v1/jobs/1", "/api/v1/jobs", "/api/v1/dashboard", "/api/v1/events"):
        status, body = raw(m, "GET", path, carol)
        assert status == 200 and SECRET.encode() not in body, path
    job = json.loads(raw(m, "GET", "/api/v1/jobs/1", carol)[1])
    assert job["status"] == "failed" and job["detail"].startswith("exit code 3") and "\n" not in job["detail"]


def stall(url: str, n: int) -> list[socket.socket]:
    """``n`` connections that send half a request header and then nothing."""
    parts = urllib.parse.urlsplit(url)
    socks = []
    for _ in range(n):
        s = socket.create_connection((parts.hostname, parts.port), timeout=10)
        s.sendall(f"GET /api/v1/summary HTTP/1.1\r\nHost: {parts.hostname}\r\nX-Slow: ".encode())
        socks.append(s)
    return socks


@pytest.mark.parametrize("cap", [None, 64])
def test_stalled_connections_do_not_keep_a_victim_waiting_or_flood_the_log(tmp_path, cap):
    env = {**os.environ, "TIRESIAS_HTTP_HEADER_TIMEOUT": "3"}
    if cap:
        env["TIRESIAS_HTTP_MAX_CONNECTIONS"] = str(cap)                 # beyond it, stalled ones are evicted
    m = MasterProcess(tmp_path / "state", "--nodes", "1x2", env=env).start()
    socks: list[socket.socket] = []
    try:
        victim = Client(m.client.url, m.client.token, timeout=10)
        victim.get("/api/v1/summary")
        log_before = m.log.stat().st_size
        socks = stall(m.client.url, 200)
        t0 = time.monotonic()
        assert victim.get("/api/v1/summary")["nodes"] == 1
        assert victim.post("/api/v1/jobs", {"gpus": 1, "command": ["true"], "launcher": "plain"})["id"] == 1
        assert time.monotonic() - t0 < 3.0
        # the stalled ones are closed once the header timeout passes
        socks[-1].settimeout(10)
        t1 = time.monotonic()
        try:
            data = socks[-1].recv(100)
        except ConnectionResetError:
            data = b""
        assert data == b"" and time.monotonic() - t1 < 8.0
        closed = 0
        for s in socks:
            s.settimeout(0.01)
            try:
                if s.recv(100) == b"":
                    closed += 1
            except (socket.timeout, BlockingIOError):
                pass
            except OSError:
                closed += 1
        assert closed == len(socks)
        assert victim.get("/api/v1/summary")["nodes"] == 1
        assert m.log.stat().st_size - log_before < 4096                  # no line per connection
    finally:
        for s in socks:
            s.close()
        m.stop()


def test_accept_errors_are_logged_at_most_once_a_minute_and_free_descriptors(caplog):
    from tiresias.service.httpguard import ConnectionGuard, rate_limited_accept_errors

    class Transport:
        closed = False

        def abort(self):
            self.closed = True

        def is_closing(self):
            return self.closed

    async def main():
        loop = asyncio.get_running_loop()
        guard = ConnectionGuard(max_connections=100, header_timeout=60)
        waiting = [Transport() for _ in range(40)]
        for t in waiting:
            guard.opened(t)
        rate_limited_accept_errors(loop, guard)
        for _ in range(500):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(24, "Too many open files")})
        return waiting
    caplog.set_level(logging.INFO)
    waiting = asyncio.run(main())
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage()
    assert all(t.closed for t in waiting)                                # evicted to free descriptors
