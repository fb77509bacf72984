"""Who may call the master's HTTP API: bearer tokens, roles, the dashboard's cookie, refusals.

``Authenticator`` maps a token to a ``Principal``: the operator token (``STATE/token``,
compared with ``hmac.compare_digest``) or a user's (``users.UserDirectory``). ``middleware``
puts the caller's principal on every request (``request[PRINCIPAL]``) or refuses it:

* ``/metrics`` needs nothing;
* ``POST /login`` (the dashboard's form) checks the token it is given itself and sets it as
  an HttpOnly, SameSite=Strict cookie;
* the dashboard (``/``, ``/api/v1/dashboard``) is open without a token only when the master
  is bound to loopback and the caller is on loopback (``public=False``); a master bound
  beyond loopback (``public=True``) asks everyone for a token, loopback callers too;
* everything else needs ``Authorization: Bearer TOKEN`` (or the dashboard's cookie).

A handler states the roles an action needs with ``require``. Every refusal (no token:
``no_token``, an unknown or revoked token: ``bad_token``, a role that may not: ``role``)
answers 401 or 403, is logged once (method, path, peer and reason; never the token) and is
counted in ``Refusals``, which the master's metrics export as
``tiresias_auth_refusals_total{reason}``.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import threading
from typing import Awaitable, Callable

from aiohttp import web

from .users import OPERATOR_PRINCIPAL, Principal, UserDirectory

log = logging.getLogger("tiresias.auth")

COOKIE = "tiresias_token"
OPEN_PATHS = {"/metrics"}
DASHBOARD_PATHS = {"/", "/api/v1/dashboard"}
LOGIN_PATH = "/login"
REASONS = ("no_token", "bad_token", "role")
PRINCIPAL: web.RequestKey[Principal | None] = web.RequestKey("principal")   # None: the open dashboard


class Forbidden(Exception):
    """The caller's role may not do this (403)."""


class Authenticator:
    """Tokens -> principals: the operator's token, else the users' (when there is a directory)."""

    def __init__(self, operator_token: str, users: UserDirectory | None = None) -> None:
        if not operator_token:
            raise ValueError("the operator token is empty")
        self.operator_token = operator_token.encode()
        self.users = users

    def is_operator(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self.operator_token)

    def principal(self, token: str) -> Principal | None:
        """Who holds ``token`` (reads the users table: call it off the event loop)."""
        if not token:
            return None
        if self.is_operator(token):
            return OPERATOR_PRINCIPAL
        return self.users.authenticate(token) if self.users is not None else None


class Refusals:
    """Refused requests by reason, for the metrics (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {reason: 0 for reason in REASONS}

    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def require(request: web.Request, *roles: str) -> Principal:
    """The caller, when its role is one of ``roles``; else ``Forbidden``."""
    principal = request.get(PRINCIPAL)
    if principal is None or principal.role not in roles:
        who = f"role {principal.role}" if principal is not None else "a caller without a token"
        raise Forbidden(f"{who} may not {request.method} {request.path} (needs {' or '.join(roles)})")
    return principal


def owner_scope(request: web.Request) -> str | None:
    """Whose jobs the caller sees: None for all (operator, viewer, the open dashboard), else its name."""
    principal = request.get(PRINCIPAL)
    return None if principal is None or principal.sees_all else principal.name


def given_token(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.cookies.get(COOKIE, "")


def is_loopback_peer(request: web.Request) -> bool:
    peer = request.remote or ""
    try:
        return ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        return False


def note_refusal(request: web.Request, refusals: Refusals, reason: str) -> None:
    """Count a refusal and log it: method, path (no query), peer and reason; never the token."""
    refusals.count(reason)
    log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote or "?", reason)


def refuse(request: web.Request, refusals: Refusals, reason: str, status: int, message: str) -> web.Response:
    """Count and log a refusal (once), answer ``status`` with ``message``."""
    note_refusal(request, refusals, reason)
    if request.path == "/" and status == 401:
        return web.Response(text=login_page("a token is needed" if reason == "no_token" else "wrong token"),
                            content_type="text/html", status=401)
    return web.json_response({"error": message}, status=status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(auth: Authenticator, refusals: Refusals, public: bool) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware described in the module docstring."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or path == LOGIN_PATH:
            return await handler(request)
        token = given_token(request)
        principal = await _lookup(auth, token)
        if principal is None:
            if path in DASHBOARD_PATHS and not public and is_loopback_peer(request):
                request[PRINCIPAL] = None              # the open loopback dashboard
            else:
                reason = "bad_token" if token else "no_token"
                return refuse(request, refusals, reason, 401, "missing or wrong bearer token (see STATE/token, "
                              "or tiresias ... --state DIR / --token-file FILE)")
        else:
            request[PRINCIPAL] = principal
        try:
            return await handler(request)
        except Forbidden as exc:
            return refuse(request, refusals, "role", 403, str(exc))

    return check


async def _lookup(auth: Authenticator, token: str) -> Principal | None:
    if not token:
        return None
    if auth.is_operator(token):                  # no database read for the operator
        return OPERATOR_PRINCIPAL
    return await asyncio.get_running_loop().run_in_executor(None, auth.principal, token)   # reads SQLite


def login_handler(auth: Authenticator, refusals: Refusals) -> Handler:
    """``POST /login``: a right token becomes the dashboard's cookie (HttpOnly, SameSite=Strict)."""

    async def login(request: web.Request) -> web.Response:
        form = await request.post()
        token = str(form.get("token", ""))
        if await _lookup(auth, token) is None:
            note_refusal(request, refusals, "bad_token")
            return web.Response(text=login_page("wrong token"), content_type="text/html", status=401)
        resp = web.Response(status=303, headers={"Location": "/"})
        resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return resp

    return login


def login_page(error: str = "") -> str:
    note = f"<p style='color:#b00'>{error}</p>" if error else ""
    return ("<!doctype html><title>Tiresias</title><h1>Tiresias master</h1>"
            "<p>The dashboard needs a token: the master's (STATE/token) or a user's.</p>" + note +
            "<form method=post action=/login><input name=token type=password size=50 autofocus> "
            "<button>Open</button></form>")
