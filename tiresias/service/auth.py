"""Who may call the master's HTTP API: bearer tokens, roles, the dashboard's cookie, refusals.

``Authenticator`` maps a token to a ``Principal``: the operator token (``STATE/token``,
compared with ``hmac.compare_digest``) or a user's (``users.UserDirectory``). ``middleware``
puts the caller's principal on every request (``request[PRINCIPAL]``) or refuses it:

* a request whose ``Host`` is not one of the master's own names (``HostRule``: for a
  loopback bind 127.0.0.1, localhost, [::1], any port) gets 403 (reason ``host``): a web
  page that rebinds its DNS name to 127.0.0.1 cannot read the API;
* a write (POST...) whose ``Origin`` is present and is not the master's own (the origin of
  its ``Host``) gets 403 (reason ``origin``): another site or local web page cannot post;
* ``/metrics`` needs nothing more;
* ``POST /login`` (the dashboard's form) checks the token it is given itself and sets it as
  an HttpOnly, SameSite=Strict cookie;
* everything else, the dashboard (``/``, ``/api/v1/dashboard``) included, needs a token:
  ``Authorization: Bearer TOKEN`` or the dashboard's cookie. A loopback caller is no more
  trusted than any other (every local user's processes reach loopback); ``/`` without a
  token answers the login form.

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
import os
import socket
import threading
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from .users import OPERATOR_PRINCIPAL, Principal, UserDirectory

log = logging.getLogger("tiresias.auth")

COOKIE = "tiresias_token"
OPEN_PATHS = {"/metrics"}
DASHBOARD_PATHS = {"/", "/api/v1/dashboard"}
LOGIN_PATH = "/login"
REASONS = ("no_token", "bad_token", "role")
PRINCIPAL: web.RequestKey[Principal | None] = web.RequestKey("principal")
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class HostRule:
    """Which ``Host`` headers name this master. Bound to loopback: a loopback address or
    ``localhost``. Bound beyond loopback: also any IP literal (a DNS-rebinding page always
    sends its own name), the bind name, this machine's host name and FQDN, and the names in
    ``$TIRESIAS_ALLOWED_HOSTS`` (comma-separated, e.g. a proxy's public name)."""

    def __init__(self, public: bool = False, bind: str | None = None, extra: list[str] | None = None) -> None:
        self.public = public
        names = set(LOOPBACK_NAMES)
        if extra is None:
            extra = [h for h in os.environ.get("TIRESIAS_ALLOWED_HOSTS", "").split(",") if h.strip()]
        names.update(h.strip().lower().rstrip(".") for h in extra)
        if public:
            if bind:
                names.add(bind.strip("[]").lower())
            for name in (socket.gethostname(), socket.getfqdn()):
                if name:
                    names.add(name.lower().rstrip("."))
        self.names = names

    def allows(self, host_header: str) -> bool:
        host = _hostname(host_header)
        if not host:
            return False
        try:
            ip = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            return host in self.names
        return ip.is_loopback or self.public


def _hostname(host_header: str) -> str:
    """The name of a ``Host`` header (``name[:port]``, ``[v6][:port]``), lower case; '' if malformed."""
    h = (host_header or "").strip().lower()
    if h.startswith("["):
        end = h.find("]")
        if end < 0 or (h[end + 1:] and not (h[end + 1] == ":" and h[end + 2:].isdigit())):
            return ""
        return h[1:end]
    name, sep, port = h.rpartition(":") if ":" in h else (h, "", "")
    if sep and not port.isdigit():
        return ""
    if any(c in name for c in "/@\\ ") or not name:
        return ""
    return name.rstrip(".")


def same_origin(request: web.Request) -> bool:
    """``Origin`` (when present) names the master's own origin: the one its ``Host`` header gives."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    default = 80 if parts.scheme == "http" else 443
    origin_host = parts.hostname.lower().rstrip(".")
    origin_port = port or default
    host = _hostname(request.headers.get("Host", ""))
    raw = request.headers.get("Host", "").strip().lower()
    tail = raw.rsplit("]", 1)[-1] if raw.startswith("[") else raw
    host_port = int(tail.rpartition(":")[2]) if ":" in tail else default
    return origin_host == host and origin_port == host_port


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
    """Whose jobs the caller sees: None for all (operator, viewer), else its name."""
    principal = request.get(PRINCIPAL)
    if principal is None:
        raise Forbidden(f"a caller without a token may not {request.method} {request.path}")
    return None if principal.sees_all else principal.name


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


def middleware(auth: Authenticator, refusals: Refusals, public: bool,
               hosts: HostRule | None = None) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware described in the module docstring."""
    hosts = hosts or HostRule(public)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if not hosts.allows(request.headers.get("Host", "")):
            return refuse(request, refusals, "host", 403, "this Host is not the master's")
        if request.method not in SAFE_METHODS and not same_origin(request):
            return refuse(request, refusals, "origin", 403, "cross-origin request refused")
        if path in OPEN_PATHS or path == LOGIN_PATH:
            return await handler(request)
        token = given_token(request)
        principal = await _lookup(auth, token)
        if principal is None:
            reason = "bad_token" if token else "no_token"
            return refuse(request, refusals, reason, 401, "missing or wrong bearer token (see STATE/token, "
                          "or tiresias ... --state DIR / --token-file FILE)")
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
            "<button>Open</button></form>" + LOGIN_SCRIPT)


# ``/#token=TOKEN`` logs in without the form (the fragment never reaches the server or its
# logs): the page posts it to /login, which sets the cookie, and reloads.
LOGIN_SCRIPT = ("<script>const m = location.hash.match(/^#token=(.+)$/);"
                "if (m) { history.replaceState(null, '', location.pathname);"
                "fetch('/login', {method: 'POST', credentials: 'same-origin',"
                " body: new URLSearchParams({token: decodeURIComponent(m[1])})})"
                ".then(r => { if (r.ok) location.replace('/'); }); }</script>")
