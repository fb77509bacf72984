"""The master's HTTP JSON API (aiohttp), its dashboard and its Prometheus metrics.

Routes (JSON in and out; every one but ``/metrics`` needs ``Authorization: Bearer TOKEN``:
the operator's token in ``STATE/token``, or a user's from ``tiresias master users add``;
who may do what is ``tiresias.service.users``' roles, checked through ``auth``)::

    POST /api/v1/jobs                   submit {"gpus", "command", ...} -> job   operator, user
    GET  /api/v1/jobs[?status=a,b&limit=N]  the newest N jobs (default 1000)    all (a user: its own)
    GET  /api/v1/jobs/{id}              one job, with its runs                  all (a user: its own)
    POST /api/v1/jobs/{id}/cancel       cancel (a running job is stopped first) operator, user (its own)
    GET  /api/v1/jobs/{id}/logs?offset  {"data", "offset", "status"}            operator, user (its own)
                                        (offsets: absolute bytes of the job's output; one
                                        rotated away reads from the oldest byte kept)
    GET  /api/v1/nodes                  nodes: GPUs, jobs, memory               all (a user: its jobs)
    POST /api/v1/nodes/{name}/drain     take a node out of service              operator
    POST /api/v1/nodes/{name}/undrain                                           operator
    GET  /api/v1/events?since=&job=     recent events                           all (a user: its jobs')
    GET  /api/v1/summary                queues, GPU use, JCTs, report sources   all
    GET  /metrics                       Prometheus text format, no token
    GET  /                              the dashboard (read-only)

A user asking for another user's job gets the 404 of a job that does not exist. The
dashboard and its data (``/api/v1/dashboard``) need a token like the rest, loopback callers
too: it is entered once on a login form (or given as ``/#token=TOKEN``) and kept in an
HttpOnly cookie. A viewer sees no log content: a failed job's ``detail`` (which ends with
the tail of its log) shows a viewer its first line only. Requests whose ``Host`` is not the
master's, and cross-origin writes, get 403 (``auth``); a submit must be
``application/json`` (else 415). A refused request gets 400 (bad input, with the reason), 401 (no or
wrong token), 403 (a role that may not) or 404, and nothing is stored. A submit past a
user's quota gets 429 with ``Retry-After`` (``quota``); one while the state disk is below its
free-space floor or full gets 507 (``diskspace``); both say which option sets the limit. Master calls run in
a thread pool: a pass never blocks the server.
"""
from __future__ import annotations

import asyncio
import functools
import json
import math
import pathlib
import re
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .auth import (COOKIE, PRINCIPAL, Authenticator, HostRule, Refusals, login_handler, middleware, owner_scope,
                   require)
from .master import Master, NoSpace, NotFound, Refused, Throttled
from .users import OPERATOR, USER, VIEWER

__all__ = ["build_app", "COOKIE"]

STATIC = pathlib.Path(__file__).with_name("static")
SUBMITTERS = (OPERATOR, USER)

MAX_BODY = 1 << 20             # bytes of a request body
MAX_DEPTH = 32                 # nesting of a JSON body (a job spec needs 3)
MAX_QUERY_INT = 1 << 53        # offset, since, limit and job ids above this are refused
DEFAULT_LIST_LIMIT = 1000      # jobs a list read returns unless ?limit= says otherwise
MAX_LIST_LIMIT = 10000
_INT_RE = re.compile(r"[+-]?[0-9]{1,20}")


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except Throttled as exc:
        response = _error(429, str(exc))
        response.headers["Retry-After"] = exc.retry_after
        return response
    except NoSpace as exc:
        return _error(507, str(exc))
    except Refused as exc:
        return _error(400, str(exc))
    except NotFound as exc:
        return _error(404, str(exc.args[0]) if exc.args else "not found")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def build_app(master: Master, auth: Authenticator | str, public: bool = False,
              refusals: Refusals | None = None, hosts: HostRule | None = None,
              guard: Any = None) -> web.Application:
    """The API of ``master``. ``auth``: an ``Authenticator`` (a bare token: the operator's only);
    ``public``: the master listens beyond loopback (``hosts``: the Host names it answers,
    ``auth.HostRule``); ``guard``: a ``httpguard.ConnectionGuard`` whose middleware times requests."""
    if isinstance(auth, str):
        auth = Authenticator(auth)
    refusals = refusals or Refusals()
    first = [guard.middleware()] if guard is not None else []
    app = web.Application(middlewares=[*first, middleware(auth, refusals, public, hosts), _errors],
                          client_max_size=MAX_BODY)

    async def call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def submit(request: web.Request) -> web.Response:
        owner = require(request, *SUBMITTERS).name
        if request.content_type != "application/json":
            return _error(415, f"a job is submitted as application/json, not {request.content_type or 'nothing'}")
        spec = _parse_json(await request.read())
        return web.json_response(await call(master.submit, spec, owner=owner), status=201)

    async def jobs(request: web.Request) -> web.Response:
        status = request.query.get("status")
        limit = min(MAX_LIST_LIMIT, max(1, _int_query(request, "limit", DEFAULT_LIST_LIMIT)))
        return web.json_response(_redact(request, await call(master.jobs, status.split(",") if status else None,
                                                             owner=owner_scope(request), limit=limit)))

    async def job(request: web.Request) -> web.Response:
        return web.json_response(_redact(request, [await call(master.job, _job_id(request),
                                                              owner=owner_scope(request))])[0])

    async def cancel(request: web.Request) -> web.Response:
        require(request, *SUBMITTERS)
        return web.json_response(await call(master.cancel, _job_id(request), owner=owner_scope(request)))

    async def logs(request: web.Request) -> web.Response:
        require(request, *SUBMITTERS)
        job_id = _job_id(request)
        offset = _int_query(request, "offset", 0)
        data, new, status = await call(master.read_log, job_id, offset, owner=owner_scope(request))
        return web.json_response({"data": data, "offset": new, "status": status})

    async def nodes(request: web.Request) -> web.Response:
        return web.json_response(await call(master.nodes, owner=owner_scope(request)))

    async def drain(request: web.Request) -> web.Response:
        require(request, OPERATOR)
        online = request.path.endswith("/undrain")
        return web.json_response(await call(master.drain, request.match_info["name"], online))

    async def events(request: web.Request) -> web.Response:
        job_id = request.query.get("job")
        return web.json_response(await call(master.events, _int_query(request, "since", 0),
                                            _id_of("job", job_id) if job_id else None,
                                            min(1000, _int_query(request, "limit", 200)),
                                            owner=owner_scope(request)))

    async def summary(request: web.Request) -> web.Response:
        return web.json_response(await call(master.summary))

    async def dashboard_data(request: web.Request) -> web.Response:
        board = await call(master.dashboard, owner=owner_scope(request))
        _redact(request, board["jobs"])
        return web.json_response(board)

    async def dashboard(request: web.Request) -> web.Response:
        return web.FileResponse(STATIC / "dashboard.html")

    registry = CollectorRegistry()
    registry.register(_Collector(master, refusals))

    async def metrics(request: web.Request) -> web.Response:
        body = await call(generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.add_routes([
        web.post("/api/v1/jobs", submit), web.get("/api/v1/jobs", jobs), web.get("/api/v1/jobs/{id}", job),
        web.post("/api/v1/jobs/{id}/cancel", cancel), web.get("/api/v1/jobs/{id}/logs", logs),
        web.get("/api/v1/nodes", nodes), web.post("/api/v1/nodes/{name}/drain", drain),
        web.post("/api/v1/nodes/{name}/undrain", drain), web.get("/api/v1/events", events),
        web.get("/api/v1/summary", summary), web.get("/api/v1/dashboard", dashboard_data),
        web.get("/metrics", metrics), web.get("/", dashboard), web.post("/login", login_handler(auth, refusals)),
    ])
    return app


def _redact(request: web.Request, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A viewer reads no log content: a job's ``detail`` (a failed job's ends with the tail of
    its log) is cut to its first line."""
    principal = request.get(PRINCIPAL)
    if principal is not None and principal.role == VIEWER:
        for view in views:
            if view.get("detail"):
                view["detail"] = view["detail"].splitlines()[0]
    return views


def _job_id(request: web.Request) -> int:
    return _id_of("job id", request.match_info["id"])


def _id_of(name: str, raw: str) -> int:
    """A job id: ASCII digits only (``str.isdigit`` also takes '²' and '٣'), at most ``MAX_QUERY_INT``."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 20 or int(raw) > MAX_QUERY_INT:
        raise Refused(f"{name} must be a number (ASCII digits, at most {MAX_QUERY_INT}), got {raw[:40]!r}")
    return int(raw)


def _int_query(request: web.Request, name: str, default: int) -> int:
    """A non-negative integer query parameter (a negative one counts as 0), at most ``MAX_QUERY_INT``."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not _INT_RE.fullmatch(raw):
        raise Refused(f"{name} must be an integer, got {raw[:40]!r}")
    value = int(raw)
    if value > MAX_QUERY_INT:
        raise Refused(f"{name} must be at most {MAX_QUERY_INT}, got {raw}")
    return max(0, value)


def _parse_json(body: bytes) -> Any:
    """A request's JSON body; ``Refused`` when it is not UTF-8 JSON, nests deeper than
    ``MAX_DEPTH``, or holds a non-finite number (``NaN``, ``Infinity``, ``1e999``)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(f"malformed JSON: not UTF-8 ({exc.reason})") from None
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise Refused(f"malformed JSON: nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except Refused:
        raise
    except (ValueError, RecursionError) as exc:
        raise Refused(f"malformed JSON: {exc}") from None


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (brackets in strings skipped)."""
    depth = deepest = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _no_constant(name: str) -> float:
    raise Refused(f"malformed JSON: {name} is not a number this API accepts (finite numbers only)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Refused(f"malformed JSON: {text[:40]} is out of range (finite numbers only)")
    return value


class _Collector:
    """Prometheus view of the master, read at scrape time."""

    def __init__(self, master: Master, refusals: Refusals) -> None:
        self.master = master
        self.refusals = refusals

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
        disk = s["state_disk"]
        if disk["free_bytes"] is not None:
            yield GaugeMetricFamily("tiresias_state_disk_free_bytes", "Free bytes on the state dir's filesystem",
                                    value=disk["free_bytes"])
        yield GaugeMetricFamily("tiresias_state_pending_writes", "State writes waiting for disk space",
                                value=disk["pending_writes"])
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
        refused = CounterMetricFamily("tiresias_auth_refusals", "API requests refused, by reason "
                                      "(no_token, bad_token, role, host, origin)", labels=["reason"])
        for reason, n in sorted(self.refusals.snapshot().items()):
            refused.add_metric([reason], n)
        yield refused

