"""Running a master: the state dir's token and address files, the scheduling thread, HTTP.

``STATE/token`` (mode 0600) is the operator's token, generated at the first start and kept;
users' tokens live (hashed) in the state database (``tiresias master users``).
``STATE/master.json`` holds the URL the master listens on and its pid, so client commands
given ``--state DIR`` find it. The state dir is made 0711: others cannot list it or read
its database, token or run records, but a job running as its owner's OS user still reaches
its checkpoint dir under it. A master bound beyond loopback asks for a token on the
dashboard too, and every caller needs one (loopback is not trusted). ``httpguard`` bounds
slow and excess connections; a ``tiresias-retention`` thread prunes ended jobs past
``--retention`` (``Master.prune_loop``). SIGTERM or SIGINT stops the master cleanly: the HTTP server closes, the scheduling
thread finishes its pass, state is written. Jobs keep running — a restarted master
re-attaches them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import threading

from aiohttp import web

from dlrt.endpoints import is_loopback

from .api import build_app
from .auth import Authenticator, HostRule
from .httpguard import KEEPALIVE_TIMEOUT_S, ConnectionGuard, connection_cap, raise_nofile, rate_limited_accept_errors
from .master import Master
from .users import UserDirectory

log = logging.getLogger("tiresias.server")


def ensure_token(state_dir: str) -> str:
    """The master's bearer token: read from ``STATE/token``, created (0600) if missing."""
    path = os.path.join(state_dir, "token")
    try:
        with open(path) as f:
            token = f.read().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def write_address(state_dir: str, url: str) -> None:
    path = os.path.join(state_dir, "master.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"url": url, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def serve(master: Master, host: str, port: int, ready=None) -> int:
    """Serve ``master`` on ``host:port`` until SIGTERM/SIGINT; returns an exit status."""
    os.chmod(master.config.state_dir, 0o711)
    auth = Authenticator(ensure_token(master.config.state_dir), UserDirectory(master.store))
    master.reports.on_report = lambda topic: master.wake.set()
    master.reports.start()
    stop = threading.Event()
    loop_thread = threading.Thread(target=master.serve, args=(stop,), name="tiresias-scheduler", daemon=True)
    loop_thread.start()
    prune_thread = threading.Thread(target=master.prune_loop, args=(stop,), name="tiresias-retention", daemon=True)
    prune_thread.start()
    try:
        return asyncio.run(_http(master, auth, host, port, ready))
    finally:
        stop.set()
        master.wake.set()
        loop_thread.join(timeout=30)
        prune_thread.join(timeout=30)
        master.close()


async def _http(master: Master, auth: Authenticator, host: str, port: int, ready) -> int:
    public = not is_loopback(host)
    guard = ConnectionGuard(connection_cap(raise_nofile()))
    rate_limited_accept_errors(asyncio.get_running_loop(), guard)
    app = build_app(master, auth, public=public, hosts=HostRule(public, bind=host), guard=guard)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    guard.install(runner.server)
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}"
    write_address(master.config.state_dir, url)
    log.info("master listening on %s (state %s)", url, master.config.state_dir)
    print(f"tiresias master: listening on {url}, state {os.path.abspath(master.config.state_dir)}, "
          f"executor {master.executor.name}, policy {master.config.policy}", flush=True)
    if ready is not None:
        ready(url)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    log.info("master stopping")
    await runner.cleanup()
    return 0
