"""Per-user tokens of the live master, its roles, the dashboard's rule and per-job AutoPS secrets.

The aiohttp application runs in-process (``aiohttp.test_utils``) around a master with the
in-memory ``FakeExecutor``; users live in the master's state database as
``tiresias master users`` would put them there. An attacker (user bob, a viewer, callers
with no or a wrong token) tries every way at alice's job; it must answer as a missing job
would, be counted and logged, and leave alice's job exactly as it was.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from test_tiresias_master import Clock, FakeExecutor, make, spec
from tiresias.service import api
from tiresias.service.auth import Authenticator, Refusals
from tiresias.service.master import SECRET_ENV, Master, MasterConfig
from tiresias.service.reports import ReportFeed
from tiresias.service.users import UserDirectory, UserError

OPERATOR_TOKEN = "operator-token-for-tests"
GOOD = {"gpus": 1, "command": ["python", "x.py"], "name": "ok", "workdir": "/"}


@pytest.fixture
def master(tmp_path):
    clock = Clock()
    m = Master(MasterConfig(str(tmp_path / "state")), FakeExecutor(), reports=ReportFeed(clock=clock), clock=clock)
    yield m
    m.close()


@pytest.fixture
def tokens(master):
    users = UserDirectory(master.store)
    return {"alice": users.add("alice"), "bob": users.add("bob"), "carol": users.add("carol", role="viewer"),
            "operator": OPERATOR_TOKEN}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def run(master, scenario, public=False):
    refusals = Refusals()

    async def main():
        app = api.build_app(master, Authenticator(OPERATOR_TOKEN, UserDirectory(master.store)), public=public,
                            refusals=refusals)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await scenario(client)
    asyncio.run(main())
    return refusals.snapshot()


def test_users_store_only_a_salted_hash_and_revoke_then_add_rotates(master):
    users = UserDirectory(master.store)
    token = users.add("alice")
    assert len(token) >= 43 and users.authenticate(token).name == "alice"
    raw = master.store._db.execute("SELECT * FROM users").fetchall()
    assert token not in json.dumps([dict(r) for r in raw])           # only salt and hash are stored
    assert users.list()[0].keys() == {"name", "role", "created", "revoked"}
    with pytest.raises(UserError, match="exists"):
        users.add("alice")
    for bad in ("operator", "Alice", "-x", "a b", ""):
        with pytest.raises(ValueError):
            users.add(bad)
    with pytest.raises(ValueError, match="role"):
        users.add("dave", role="operator")
    users.revoke("alice")
    assert users.authenticate(token) is None
    with pytest.raises(UserError, match="no active user"):
        users.revoke("alice")
    new = users.add("alice")
    assert new != token and users.authenticate(new).name == "alice" and users.authenticate(token) is None
    assert users.authenticate("") is None and users.authenticate(token + "x") is None


def test_a_user_sees_and_touches_only_its_own_jobs_the_operator_all(master, tokens, caplog):
    caplog.set_level(logging.INFO, logger="tiresias.auth")

    async def scenario(c):
        r = await c.post("/api/v1/jobs", headers=bearer(tokens["alice"]), json={**GOOD, "name": "victim"})
        assert r.status == 201
        victim = await r.json()
        a = victim["id"]
        assert victim["owner"] == "alice"
        r = await c.post("/api/v1/jobs", headers=bearer(tokens["bob"]), json={**GOOD, "name": "bobs"})
        b = (await r.json())["id"]
        master.tick()
        before = master.job(a)
        missing = a + b + 100
        bob = bearer(tokens["bob"])
        # bob at alice's job: exactly the answers of a job that does not exist
        for method, path in (("GET", "/api/v1/jobs/{}"), ("POST", "/api/v1/jobs/{}/cancel"),
                             ("GET", "/api/v1/jobs/{}/logs")):
            theirs = await c.request(method, path.format(a), headers=bob)
            absent = await c.request(method, path.format(missing), headers=bob)
            assert theirs.status == absent.status == 404, path
            assert (await theirs.json())["error"].replace(str(a), "N") == \
                (await absent.json())["error"].replace(str(missing), "N")
        assert [j["id"] for j in await (await c.get("/api/v1/jobs", headers=bob)).json()] == [b]
        assert await (await c.get(f"/api/v1/events?job={a}", headers=bob)).json() == []
        events = await (await c.get("/api/v1/events", headers=bob)).json()
        assert events and {e["job_id"] for e in events} == {b}
        nodes = await (await c.get("/api/v1/nodes", headers=bob)).json()
        assert {int(j) for n in nodes for j in n["jobs"]} == {b}
        board = await (await c.get("/api/v1/dashboard", headers=bob)).json()
        assert [j["id"] for j in board["jobs"]] == [b] and board["summary"]["jobs"] == {"running": 2}
        # alice's own view, and the operator's
        alice = bearer(tokens["alice"])
        assert [j["id"] for j in await (await c.get("/api/v1/jobs", headers=alice)).json()] == [a]
        r = await c.get(f"/api/v1/jobs/{a}/logs", headers=alice)
        assert r.status == 200
        op = bearer(tokens["operator"])
        every = await (await c.get("/api/v1/jobs", headers=op)).json()
        assert [(j["id"], j["owner"]) for j in every] == [(a, "alice"), (b, "bob")]
        assert (await c.get(f"/api/v1/jobs/{b}", headers=op)).status == 200
        after = master.job(a)
        assert after["status"] == before["status"] == "running" and after["run"] == before["run"]
        assert master.executor.signals == []                  # nobody signalled alice's run
        r = await c.post(f"/api/v1/jobs/{a}/cancel", headers=alice)
        assert r.status == 200 and (await r.json())["status"] == "stopping"
        r = await c.post(f"/api/v1/jobs/{b}/cancel", headers=op)
        assert r.status == 200
    refused = run(master, scenario)
    assert refused == {"no_token": 0, "bad_token": 0, "role": 0}      # a foreign job is a 404, not a refusal
    assert not [r for r in caplog.records if r.name == "tiresias.auth"]


def test_a_viewer_reads_everything_and_changes_nothing(master, tokens):
    master.submit(dict(GOOD), owner="alice")
    master.tick()

    async def scenario(c):
        carol = bearer(tokens["carol"])
        jobs = await (await c.get("/api/v1/jobs", headers=carol)).json()
        assert [j["owner"] for j in jobs] == ["alice"]
        for path in ("/api/v1/jobs/1", "/api/v1/nodes", "/api/v1/events", "/api/v1/summary", "/api/v1/dashboard"):
            assert (await c.get(path, headers=carol)).status == 200, path
        for method, path in (("POST", "/api/v1/jobs"), ("POST", "/api/v1/jobs/1/cancel"),
                             ("GET", "/api/v1/jobs/1/logs"), ("POST", "/api/v1/nodes/node0/drain")):
            r = await c.request(method, path, headers=carol, json=GOOD)
            assert r.status == 403 and "viewer" in (await r.json())["error"], path
        r = await c.post("/api/v1/nodes/node0/drain", headers=bearer(tokens["bob"]))
        assert r.status == 403                                 # draining is the operator's
        assert [j["status"] for j in master.jobs()] == ["running"] and master.executor.signals == []
        assert not master.drained
        r = await c.post("/api/v1/nodes/node0/drain", headers=bearer(tokens["operator"]))
        assert r.status == 200 and master.drained == {"node0"}
    refused = run(master, scenario)
    assert refused["role"] == 5


def test_no_or_bad_or_revoked_tokens_are_refused_logged_once_and_counted(master, tokens, caplog):
    caplog.set_level(logging.INFO, logger="tiresias.auth")
    job_id = master.submit(dict(GOOD), owner="alice")["id"]
    master.tick()
    UserDirectory(master.store).revoke("bob")

    async def scenario(c):
        for headers in ({}, bearer("nope"), bearer(tokens["bob"]), bearer(tokens["alice"] + "x")):
            for method, path in (("GET", "/api/v1/jobs"), ("POST", f"/api/v1/jobs/{job_id}/cancel"),
                                 ("GET", f"/api/v1/jobs/{job_id}/logs")):
                r = await c.request(method, path, headers=headers)
                assert r.status == 401, (headers, path)
        r = await c.post("/login", data={"token": tokens["bob"]}, allow_redirects=False)
        assert r.status == 401
        text = await (await c.get("/metrics")).text()
        assert 'tiresias_auth_refusals_total{reason="no_token"} 3.0' in text
        assert 'tiresias_auth_refusals_total{reason="bad_token"} 10.0' in text
        assert 'tiresias_auth_refusals_total{reason="role"} 0.0' in text
    refused = run(master, scenario)
    assert refused == {"no_token": 3, "bad_token": 10, "role": 0}
    lines = [r.getMessage() for r in caplog.records if r.name == "tiresias.auth"]
    assert len(lines) == 13 and all(line.startswith("refused ") for line in lines)
    for token in tokens.values():
        assert not any(token in line for line in lines)
    assert master.job(job_id)["status"] == "running" and master.executor.signals == []


def test_dashboard_of_a_master_bound_beyond_loopback_needs_a_token_even_from_loopback(master, tokens):
    master.submit(dict(GOOD, name="alices"), owner="alice")
    master.submit(dict(GOOD, name="bobs"), owner="bob")

    async def public(c):
        r = await c.get("/")
        assert r.status == 401 and "token" in await r.text()
        assert (await c.get("/api/v1/dashboard")).status == 401
        r = await c.post("/login", data={"token": "wrong"}, allow_redirects=False)
        assert r.status == 401
        r = await c.post("/login", data={"token": tokens["alice"]}, allow_redirects=False)
        cookie = r.headers["Set-Cookie"]
        assert r.status == 303 and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        board = await (await c.get("/api/v1/dashboard")).json()       # the cookie jar carries it
        assert [j["name"] for j in board["jobs"]] == ["alices"]
        assert (await c.get("/")).status == 200
    refused = run(master, public, public=True)
    assert refused["no_token"] == 2 and refused["bad_token"] == 1

    async def loopback(c):
        assert (await c.get("/api/v1/dashboard")).status == 401      # loopback is not trusted either
        assert (await c.get("/")).status == 401
        board = await (await c.get("/api/v1/dashboard", headers=bearer(tokens["operator"]))).json()
        assert sorted(j["name"] for j in board["jobs"]) == ["alices", "bobs"]
        board = await (await c.get("/api/v1/dashboard", headers=bearer(tokens["bob"]))).json()
        assert [j["name"] for j in board["jobs"]] == ["bobs"]
    run(master, loopback)


def test_each_job_gets_its_own_autops_secret_kept_across_preemption_and_restart(tmp_path):
    m, clock, ex = make(tmp_path)
    a = m.submit(spec(2, "a"), owner="alice")["id"]
    m.tick()
    first = ex.launched[-1].env[SECRET_ENV]
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    b = m.submit(spec(4, "b"))["id"]
    clock.t += 200                                             # a demoted below b: a is preempted
    m.tick()
    assert [s.job_id for s in ex.launched] == [a]
    ex.end(a, 1, stopped=True)
    m.tick()
    assert ex.launched[-1].job_id == b and ex.launched[-1].env[SECRET_ENV] != first
    ex.end(b, 1)
    m.tick()
    again = ex.launched[-1]
    assert (again.job_id, again.run) == (a, 2) and again.env[SECRET_ENV] == first
    m.close()
    m2, _, ex2 = make(tmp_path, clock=clock, executor=ex)      # a restarted master: same secret
    ex.end(a, 2, lost=True)                                    # its node lost: requeued, started again
    m2.tick()
    m2.tick()
    relaunched = [s for s in ex2.launched if s.job_id == a][-1]
    assert relaunched.run == 3 and relaunched.env[SECRET_ENV] == first
    shown = json.dumps([m2.jobs(), m2.job(a), m2.events(limit=1000), m2.dashboard(), m2.nodes()])
    assert first not in shown                                   # no view shows it
    m2.close()


def test_user_env_cannot_choose_the_secret(tmp_path):
    m, _, ex = make(tmp_path)
    m.submit(spec(1, "x", env={SECRET_ENV: "chosen-by-the-user"}), owner="alice")
    m.tick()
    assert ex.launched[-1].env[SECRET_ENV] != "chosen-by-the-user"
    m.close()


def test_host_rule_names_only_the_master_and_origin_must_be_its_own():
    from aiohttp.test_utils import make_mocked_request

    from tiresias.service.auth import HostRule, same_origin
    local = HostRule(public=False, extra=[])
    for host in ("127.0.0.1", "127.0.0.1:8470", "localhost:8470", "LOCALHOST", "[::1]:8470", "[::1]"):
        assert local.allows(host), host
    for host in ("", "evil.example", "evil.example:8470", "10.0.0.5:8470", "127.0.0.1:x", "[::1]x",
                 "localhost.evil.example", "127.0.0.1.nip.io", "a@127.0.0.1", "[::1"):
        assert not local.allows(host), host
    public = HostRule(public=True, bind="0.0.0.0", extra=["tiresias.example.org"])
    assert public.allows("10.0.0.5:8470") and public.allows("tiresias.example.org")
    assert not public.allows("evil.example")

    def origin_ok(host, origin=None):
        headers = {"Host": host, **({"Origin": origin} if origin is not None else {})}
        return same_origin(make_mocked_request("POST", "/api/v1/jobs", headers=headers))
    assert origin_ok("127.0.0.1:8470") and origin_ok("127.0.0.1:8470", "http://127.0.0.1:8470")
    assert origin_ok("localhost", "http://localhost") and origin_ok("[::1]:9", "http://[::1]:9")
    for origin in ("http://evil.example", "http://127.0.0.1:8471", "null", "file://", "http://127.0.0.1",
                   "ftp://127.0.0.1:8470", "http://localhost:8470"):
        assert not origin_ok("127.0.0.1:8470", origin), origin
