"""The master's HTTP API: validation, authentication, the dashboard's access rule, metrics.

Runs the aiohttp application in-process (``aiohttp.test_utils``) on 127.0.0.1 around a master
with an in-memory executor; nothing is launched.
"""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from test_tiresias_master import Clock, FakeExecutor
from tiresias.service import api
from tiresias.service.master import Master, MasterConfig
from tiresias.service.reports import ReportFeed

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def master(tmp_path):
    clock = Clock()
    m = Master(MasterConfig(str(tmp_path / "state")), FakeExecutor(), reports=ReportFeed(clock=clock), clock=clock)
    yield m
    m.close()


def run(master, scenario, loopback=True):
    async def main():
        app = api.build_app(master, TOKEN)
        if not loopback:
            app.middlewares.insert(0, _pretend_remote)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await scenario(client)
    asyncio.run(main())


@web.middleware
async def _pretend_remote(request, handler):
    return await handler(request.clone(remote="10.1.2.3"))


GOOD = {"gpus": 1, "command": ["python", "x.py"], "name": "ok", "workdir": "/"}


def test_requests_need_the_bearer_token(master):
    async def scenario(c):
        for method, path in (("GET", "/api/v1/jobs"), ("POST", "/api/v1/jobs"), ("GET", "/api/v1/nodes"),
                             ("GET", "/api/v1/events"), ("POST", "/api/v1/jobs/1/cancel")):
            r = await c.request(method, path, json=GOOD)
            assert r.status == 401, path
            r = await c.request(method, path, json=GOOD, headers={"Authorization": "Bearer wrong"})
            assert r.status == 401, path
        assert master.jobs() == []
        r = await c.get("/api/v1/jobs", headers=AUTH)
        assert r.status == 200 and await r.json() == []
    run(master, scenario)


def test_bad_input_is_a_400_with_the_reason_and_nothing_is_stored(master):
    async def scenario(c):
        cases = [(b"{not json", "malformed JSON"), ({**GOOD, "gpus": 99}, "cluster has 4"),
                 ({**GOOD, "gpus": "two"}, "gpus"), ({**GOOD, "command": "python x.py"}, "command"),
                 ({**GOOD, "priority": 1}, "unknown field"), ([1, 2], "JSON object"),
                 ({**GOOD, "memory": -5}, "memory")]
        for body, reason in cases:
            kw = {"data": body, "headers": {**AUTH, "Content-Type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body, "headers": AUTH}
            r = await c.post("/api/v1/jobs", **kw)
            assert r.status == 400, body
            assert reason in (await r.json())["error"]
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = await c.post("/api/v1/jobs", headers={**AUTH, "Content-Type": ctype}, data=b'{"gpus": 1}')
            assert r.status == 415, ctype                     # a submit is JSON only (no form a page can post)
        assert master.jobs() == []
        r = await c.get("/api/v1/jobs/abc", headers=AUTH)
        assert r.status == 400
        r = await c.get("/api/v1/jobs/7", headers=AUTH)
        assert r.status == 404 and "no job 7" in (await r.json())["error"]
        r = await c.post("/api/v1/nodes/node9/drain", headers=AUTH)
        assert r.status == 404
        r = await c.post("/api/v1/jobs", headers=AUTH, json=GOOD)
        assert r.status == 201 and (await r.json())["status"] == "waiting"
    run(master, scenario)


def test_metrics_need_no_token_and_describe_the_cluster(master):
    master.submit(dict(GOOD))
    master.tick()

    async def scenario(c):
        r = await c.get("/metrics")
        text = await r.text()
        assert r.status == 200
        assert 'tiresias_jobs{status="running"} 1.0' in text and "tiresias_gpus 4.0" in text
        assert "tiresias_gpus_used 1.0" in text
    run(master, scenario)


def test_dashboard_needs_the_token_on_loopback_too(master):
    async def local(c):
        r = await c.get("/")
        assert r.status == 401 and "token" in await r.text() and "Tiresias master" in await r.text()
        assert (await c.get("/api/v1/dashboard")).status == 401
        assert (await c.get("/api/v1/dashboard", headers={"Authorization": "Bearer wrong"})).status == 401
        r = await c.get("/api/v1/dashboard", headers=AUTH)
        assert r.status == 200 and {"summary", "nodes", "jobs", "events"} <= set(await r.json())
        r = await c.get("/", headers=AUTH)
        assert r.status == 200 and "/api/v1/dashboard" in await r.text()
    run(master, local)

    async def remote(c):
        r = await c.get("/")
        assert r.status == 401 and "token" in await r.text()
        assert (await c.get("/api/v1/dashboard")).status == 401
        r = await c.post("/login", data={"token": "wrong"}, allow_redirects=False)
        assert r.status == 401
        r = await c.post("/login", data={"token": TOKEN}, allow_redirects=False)
        assert r.status == 303 and api.COOKIE in r.cookies
        r = await c.get("/api/v1/dashboard")       # the cookie jar carries it now
        assert r.status == 200
    run(master, remote, loopback=False)
