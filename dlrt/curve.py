"""CURVE on the runtime's ZeroMQ sockets, and the guard that decides who may connect.

``Security`` is what a process applies to its sockets: ``server(sock, address)`` before a
bind and ``client(sock, address)`` before a connect. With CURVE on (``dlrt.keys.Keys.curve``:
the key directory holds the cluster's server key) every tcp socket runs ZeroMQ's CURVE
(encryption and authentication of both ends); ipc and inproc sockets stay plaintext (they
never leave the host, and what travels on them is checked by the services' own secrets).
With CURVE off nothing changes, and a service bound beyond loopback says so once
(``warn_if_exposed``).

Each ZeroMQ context that serves CURVE gets one ``Guard``: a thread that answers ZeroMQ's
authentication requests (ZAP, through ``zmq.auth.Authenticator``: a client's key must be
one of ``curve/authorized/*.key``, re-read when that directory changes, so revoking needs no
restart) and watches the server sockets' handshake events, so that a client with a key that
is not authorized, a wrong server key, another mechanism (plaintext) or a broken, truncated
or replayed handshake is refused, logged and counted (``refusal_counts``; the services put
the counts in their metrics). A client it admits is known by its authorized key's name (the
file name in ``curve/authorized/``: ``member`` for the cluster's own key, a tenant's name for
``dlrt keys tenant NAME``'s): ZeroMQ gives it as each received message's ``User-Id``, which
``peer_name`` reads.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import Counter
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from .endpoints import is_loopback
from .keys import Keys, key_dir

__all__ = ["Security", "Guard", "default_security", "refusal_counts", "warn_if_exposed", "peer_name"]

log = logging.getLogger("dlrt.curve")

ZAP_DOMAIN = "dlrt"
_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "curve_not_authorized",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "curve_bad_handshake",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "curve_handshake_failed",
}
_MONITORED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

_refusals: Counter = Counter()
_refusals_lock = threading.Lock()


def _refused(reason: str) -> None:
    with _refusals_lock:
        _refusals[reason] += 1


def refusal_counts(since: dict[str, int] | None = None) -> dict[str, int]:
    """Connections this process's guards refused, by reason; with ``since`` (an earlier
    result), only those refused after it (a service counts its own, not those of an earlier
    one in the same process)."""
    with _refusals_lock:
        now = dict(_refusals)
    if since:
        now = {reason: n - since.get(reason, 0) for reason, n in now.items() if n > since.get(reason, 0)}
    return now


def _is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


class _AuthorizedKeys:
    """``zmq.auth``'s credentials provider: the keys in ``directory``, re-read when it changes,
    and the name each is authorized under (its file name without ``.key``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stamp: tuple | None = None
        self._keys: dict[bytes, str] = {}       # z85 public key -> name

    def _reload(self) -> None:
        try:
            files = sorted(self.directory.glob("*.key"))
            stamp = tuple((f.name, f.stat().st_mtime_ns) for f in files)
        except OSError:
            files, stamp = [], ()
        if stamp == self._stamp:
            return
        keys = {}
        for f in files:
            try:
                keys[zmq.auth.load_certificate(f)[0]] = f.stem
            except (OSError, ValueError) as exc:
                log.warning("ignoring authorized key %s: %s", f, exc)
        self._keys, self._stamp = keys, stamp

    def callback(self, domain: str, key: bytes) -> bool:
        self._reload()
        ok = key in self._keys
        if not ok:
            log.warning("refused a CURVE client whose key %s... is not authorized", key[:8].decode(errors="replace"))
        return ok

    def user_id(self, client_public_key: bytes) -> str:
        """The ``User-Id`` of an admitted client (``zmq.auth``'s ``curve_user_id``, called right
        after ``callback`` admitted it): the name its key is authorized under."""
        z85_key = z85.encode(client_public_key)
        return self._keys.get(z85_key) or z85_key.decode("ascii")


def peer_name(frame: object) -> str | None:
    """The authorized key's name of the client that sent ``frame`` (a ``zmq.Frame`` received
    with ``copy=False`` on a CURVE server socket): ``member``, a tenant's name; None where
    the connection is not CURVE (ipc, plaintext) or ``frame`` is not a ZeroMQ frame."""
    get = getattr(frame, "get", None)
    if get is None:
        return None
    try:
        name = get("User-Id")
    except (zmq.ZMQError, TypeError, ValueError):
        return None
    return name or None


class Guard:
    """One context's ZAP handler and handshake watcher, on a daemon thread."""

    def __init__(self, ctx: zmq.Context, authorized: Path) -> None:
        self.ctx = ctx
        self._auth = zmq.auth.Authenticator(ctx, log=logging.getLogger("dlrt.curve.zap"))
        self._auth.start()
        provider = _AuthorizedKeys(authorized)
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=provider)
        self._auth.curve_user_id = provider.user_id     # User-Id: the key's name, not the key
        self._lock = threading.Lock()
        self._new_monitors: list[zmq.Socket] = []
        self._wake = ctx.socket(zmq.PAIR)
        self._wake_addr = f"inproc://dlrt-curve-guard-{id(self)}"
        self._wake.bind(self._wake_addr)
        self._kick = ctx.socket(zmq.PAIR)
        self._kick.connect(self._wake_addr)
        self._kick_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dlrt-curve-guard", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        """Count ``sock``'s failed handshakes (call from the thread that owns ``sock``)."""
        monitor = sock.get_monitor_socket(_MONITORED)
        with self._lock:
            self._new_monitors.append(monitor)
        self._nudge()

    def _nudge(self) -> None:
        with self._kick_lock:
            try:
                self._kick.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _run(self) -> None:
        loop = asyncio.new_event_loop()       # zmq.auth's handler is a coroutine
        try:
            self._serve(loop)
        finally:
            loop.close()

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        poller = zmq.Poller()
        poller.register(self._auth.zap_socket, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        try:
            while True:
                with self._lock:
                    fresh, self._new_monitors = self._new_monitors, []
                for monitor in fresh:
                    poller.register(monitor, zmq.POLLIN)
                for sock, _ in poller.poll(1000):
                    if sock is self._auth.zap_socket:
                        loop.run_until_complete(self._auth.handle_zap_message(sock.recv_multipart()))
                    elif sock is self._wake:
                        sock.recv()
                    else:
                        self._event(sock, poller)
        except zmq.ContextTerminated:     # the context is ending: let its term() finish
            for sock in (self._auth.zap_socket, self._wake, self._kick, *(item[0] for item in poller.sockets)):
                if hasattr(sock, "close"):
                    sock.close(0)

    def _event(self, monitor: zmq.Socket, poller: zmq.Poller) -> None:
        try:
            event = recv_monitor_message(monitor)
        except zmq.ZMQError:
            poller.unregister(monitor)
            return
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            poller.unregister(monitor)
            monitor.close(0)
            return
        reason = _FAILED.get(event["event"])
        if reason is not None:
            _refused(reason)
            log.warning("refused a connection on %s: %s (%s)", event.get("endpoint", b"").decode(errors="replace"),
                        reason, event.get("value"))


_guards: "weakref.WeakKeyDictionary[zmq.Context, Guard]" = weakref.WeakKeyDictionary()
_guards_lock = threading.Lock()


def _guard(ctx: zmq.Context, authorized: Path) -> Guard:
    with _guards_lock:
        guard = _guards.get(ctx)
        if guard is None:
            guard = _guards[ctx] = Guard(ctx, authorized)
        return guard


class Security:
    """The keys a process applies to its ZeroMQ sockets (``Keys.load()`` by default)."""

    def __init__(self, keys: Keys | None = None) -> None:
        self.keys = keys if keys is not None else Keys.load()

    @property
    def curve(self) -> bool:
        return self.keys.curve

    def server(self, sock: zmq.Socket, address: str) -> None:
        """Before ``sock.bind(address)``: serve CURVE on a tcp address when CURVE is on."""
        if not (self.curve and _is_tcp(address)):
            _plain(sock)
            return
        self.keys.require_server()
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True
        _guard(sock.context, self.keys.authorized_dir).watch(sock)

    def client(self, sock: zmq.Socket, address: str) -> None:
        """Before ``sock.connect(address)``: a CURVE client on a tcp address when CURVE is on."""
        if not (self.curve and _is_tcp(address)):
            _plain(sock)
            return
        sock.curve_serverkey = self.keys.server_public
        sock.curve_publickey = self.keys.client_public
        sock.curve_secretkey = self.keys.client_secret


def _plain(sock: zmq.Socket) -> None:
    """No CURVE for the next bind or connect of ``sock`` (options apply per endpoint, so a
    socket may reach a tcp peer with CURVE and an ipc one without)."""
    if sock.mechanism != zmq.NULL:
        sock.curve_server = False         # ZMQ_CURVE_SERVER 0 resets the mechanism to NULL


_defaults: dict[tuple, Security] = {}
_default_lock = threading.Lock()


def default_security() -> Security:
    """This process's ``Security`` from the key directory (``$DLRT_KEYS``), loaded once per
    directory (a test that points ``DLRT_KEYS`` elsewhere gets that directory's keys)."""
    which = (str(key_dir()), os.environ.get("DLRT_CURVE", "1"))
    with _default_lock:
        security = _defaults.get(which)
        if security is None:
            security = _defaults[which] = Security(Keys.load(which[0]))
        return security


_warned: set[str] = set()


def warn_if_exposed(service: str, bind_address: str, security: Security) -> bool:
    """Warn (once per address) when ``service`` binds beyond loopback without CURVE; whether it did."""
    if is_loopback(bind_address) or security.curve:
        return False
    if bind_address not in _warned:
        _warned.add(bind_address)
        log.warning("%s binds %s beyond loopback WITHOUT CURVE: anyone on the network can read and inject "
                    "its traffic; run `dlrt keys init` and copy the key directory to every host "
                    "(docs/security.md)", service, bind_address)
    return True
