"""The master's HTTP JSON API (aiohttp), its dashboard and its Prometheus metrics.

Routes (JSON in and out; every one but ``/metrics`` needs ``Authorization: Bearer TOKEN``,
the token the master wrote to ``STATE/token`` at its first start)::

    POST /api/v1/jobs                   submit {"gpus", "command", "name"?, "memory"?, ...} -> job
    GET  /api/v1/jobs[?status=a,b]      list of jobs
    GET  /api/v1/jobs/{id}              one job, with its runs (placement history)
    POST /api/v1/jobs/{id}/cancel       cancel (a running job is stopped first)
    GET  /api/v1/jobs/{id}/logs?offset  {"data", "offset", "status"}: the job's output from offset
    GET  /api/v1/nodes                  nodes: GPUs, jobs, memory from Infiniswap reports
    POST /api/v1/nodes/{name}/drain     take a node out of service (its jobs resume elsewhere)
    POST /api/v1/nodes/{name}/undrain
    GET  /api/v1/events?since=&job=     recent events
    GET  /api/v1/summary                queues, GPU use, JCTs, report sources
    GET  /metrics                       Prometheus text format, no token
    GET  /                              the dashboard (read-only)

The dashboard and its data (``/api/v1/dashboard``) need no token from a loopback client;
from elsewhere the token is entered once on a login form and kept in an HttpOnly cookie.
A refused request gets 400 (bad input, with the reason), 401 (no or wrong token) or 404,
and nothing is stored. Master calls run in a thread pool: a pass never blocks the server.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import pathlib
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .master import Master, NotFound, Refused

COOKIE = "tiresias_token"
STATIC = pathlib.Path(__file__).with_name("static")
OPEN_PATHS = {"/metrics"}
LOOPBACK_PATHS = {"/", "/api/v1/dashboard", "/login"}


def _loopback(request: web.Request) -> bool:
    peer = request.remote or ""
    try:
        return ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        return False


def _token_ok(request: web.Request, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else request.cookies.get(COOKIE, "")
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _auth(token: str):
    @web.middleware
    async def middleware(request: web.Request, handler):
        path = request.path
        if path in OPEN_PATHS or _token_ok(request, token):
            return await handler(request)
        if path in LOOPBACK_PATHS and (_loopback(request) or path == "/login"):
            return await handler(request)
        if path == "/":
            return web.Response(text=_login_page(), content_type="text/html", status=401)
        return _error(401, "missing or wrong bearer token (see STATE/token, or tiresias ... --state DIR)")
    return middleware


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except Refused as exc:
        return _error(400, str(exc))
    except NotFound as exc:
        return _error(404, str(exc.args[0]) if exc.args else "not found")


def build_app(master: Master, token: str) -> web.Application:
    app = web.Application(middlewares=[_auth(token), _errors], client_max_size=1 << 20)

    async def call(fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))

    async def submit(request: web.Request) -> web.Response:
        try:
            spec = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise Refused(f"malformed JSON: {exc}") from None
        return web.json_response(await call(master.submit, spec), status=201)

    async def jobs(request: web.Request) -> web.Response:
        status = request.query.get("status")
        return web.json_response(await call(master.jobs, status.split(",") if status else None))

    async def job(request: web.Request) -> web.Response:
        return web.json_response(await call(master.job, _job_id(request)))

    async def cancel(request: web.Request) -> web.Response:
        return web.json_response(await call(master.cancel, _job_id(request)))

    async def logs(request: web.Request) -> web.Response:
        job_id = _job_id(request)
        offset = _int_query(request, "offset", 0)
        data, new, status = await call(master.read_log, job_id, offset)
        return web.json_response({"data": data, "offset": new, "status": status})

    async def nodes(request: web.Request) -> web.Response:
        return web.json_response(await call(master.nodes))

    async def drain(request: web.Request) -> web.Response:
        online = request.path.endswith("/undrain")
        return web.json_response(await call(master.drain, request.match_info["name"], online))

    async def events(request: web.Request) -> web.Response:
        job_id = request.query.get("job")
        return web.json_response(await call(master.events, _int_query(request, "since", 0),
                                            int(job_id) if job_id and job_id.isdigit() else None,
                                            min(1000, _int_query(request, "limit", 200))))

    async def summary(request: web.Request) -> web.Response:
        return web.json_response(await call(master.summary))

    async def dashboard_data(request: web.Request) -> web.Response:
        return web.json_response(await call(master.dashboard))

    async def dashboard(request: web.Request) -> web.Response:
        return web.FileResponse(STATIC / "dashboard.html")

    async def login(request: web.Request) -> web.Response:
        form = await request.post()
        given = str(form.get("token", ""))
        if not hmac.compare_digest(given.encode(), token.encode()):
            return web.Response(text=_login_page("wrong token"), content_type="text/html", status=401)
        resp = web.Response(status=303, headers={"Location": "/"})
        resp.set_cookie(COOKIE, given, httponly=True, samesite="Strict")
        return resp

    registry = CollectorRegistry()
    registry.register(_Collector(master))

    async def metrics(request: web.Request) -> web.Response:
        body = await call(generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.add_routes([
        web.post("/api/v1/jobs", submit), web.get("/api/v1/jobs", jobs), web.get("/api/v1/jobs/{id}", job),
        web.post("/api/v1/jobs/{id}/cancel", cancel), web.get("/api/v1/jobs/{id}/logs", logs),
        web.get("/api/v1/nodes", nodes), web.post("/api/v1/nodes/{name}/drain", drain),
        web.post("/api/v1/nodes/{name}/undrain", drain), web.get("/api/v1/events", events),
        web.get("/api/v1/summary", summary), web.get("/api/v1/dashboard", dashboard_data),
        web.get("/metrics", metrics), web.get("/", dashboard), web.post("/login", login),
    ])
    return app


def _job_id(request: web.Request) -> int:
    raw = request.match_info["id"]
    if not raw.isdigit():
        raise Refused(f"job id must be a number, got {raw!r}")
    return int(raw)


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        raise Refused(f"{name} must be an integer, got {raw!r}") from None


def _login_page(error: str = "") -> str:
    note = f"<p style='color:#b00'>{error}</p>" if error else ""
    return ("<!doctype html><title>Tiresias</title><h1>Tiresias master</h1>"
            "<p>Beyond loopback the dashboard needs the master's token (STATE/token).</p>" + note +
            "<form method=post action=/login><input name=token type=password size=50 autofocus> "
            "<button>Open</button></form>")


class _Collector:
    """Prometheus view of the master, read at scrape time."""

    def __init__(self, master: Master) -> None:
        self.master = master

    def collect(self):
        s = self.master.summary()
        jobs = GaugeMetricFamily("tiresias_jobs", "Jobs by status", labels=["status"])
        for status, n in sorted(s["jobs"].items()):
            jobs.add_metric([status], n)
        yield jobs
        yield GaugeMetricFamily("tiresias_gpus", "GPUs of the cluster", value=s["gpus"])
        yield GaugeMetricFamily("tiresias_gpus_used", "GPUs held by running or stopping jobs", value=s["gpus_used"])
        queues = GaugeMetricFamily("tiresias_queue_length", "Waiting jobs per queue", labels=["queue"])
        for q, n in s["queues"].items():
            queues.add_metric([q], n)
        yield queues
        ended = CounterMetricFamily("tiresias_jobs_finished", "Jobs finished so far")
        ended.add_metric([], s["finished"])
        yield ended
        if s["avg_jct"] is not None:
            yield GaugeMetricFamily("tiresias_avg_jct_seconds", "Average JCT of finished jobs", value=s["avg_jct"])
        if s["pass_ms_p50"] is not None:
            yield GaugeMetricFamily("tiresias_pass_seconds", "Median scheduling pass time",
                                    value=s["pass_ms_p50"] / 1e3)
        ages = GaugeMetricFamily("tiresias_report_age_seconds", "Age of the latest report per source",
                                 labels=["topic", "source"])
        for r in s["reports"]:
            ages.add_metric([r["topic"], r["source"]], r["age_s"])
        yield ages
        free = GaugeMetricFamily("tiresias_node_free_memory_bytes", "Free memory per node (Infiniswap reports)",
                                 labels=["node"])
        for node in self.master.nodes():
            if node["memory_free_bytes"] is not None:
                free.add_metric([node["name"]], node["memory_free_bytes"])
        yield free

