"""Reaching a Ray cluster as a driver: the address checked first, loopback kept as given.

``ray.init`` on an address where nothing listens waits minutes, retrying, before it fails;
``check_address`` answers at once with one line naming the address (a TCP connection to the
GCS port, as ``ray start --head`` printed it). Ray 2.60 resolves a loopback driver address to
the machine's IP, which a cluster bound to 127.0.0.1 (as in tests) does not listen on;
``loopback_kept`` keeps loopback addresses as given while ``ray.init`` runs. Ray's errors
run over many lines; ``error_line`` is the one a log or message shows. ``join`` does all of
that and joins the cluster as a driver. Used by Tiresias' Ray executor, AutoPS' Ray provider
and ``dlrt cluster``; imports Ray only inside ``loopback_kept`` and ``join``.
"""
from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Any, Iterator

from .endpoints import host_port

__all__ = ["LOOPBACK", "RayUnreachable", "check_address", "error_line", "loopback_kept", "join"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RayUnreachable(RuntimeError):
    """No Ray cluster answers at the address given (one line, naming it)."""


def check_address(address: str | None, timeout: float = 5.0) -> str | None:
    """The GCS address ``HOST:PORT`` to give ``ray.init`` (None or ``auto``: the cluster this
    machine runs, not checked). ``ValueError`` for an address that is not ``HOST:PORT``,
    ``RayUnreachable`` when nothing accepts a connection there within ``timeout`` seconds."""
    if address is None or address.strip() in ("", "auto"):
        return None
    if address.strip().startswith("ray://"):
        raise ValueError(f"bad Ray address {address!r}: give the cluster's GCS address HOST:PORT "
                         "(what `ray start --head` printed), not a Ray Client ray:// address")
    try:
        host, port = host_port(address)
    except ValueError:
        raise ValueError(f"bad Ray address {address!r}: expected HOST:PORT, the address "
                         "`ray start --head` printed (e.g. 10.0.0.1:6379)") from None
    host = host.strip("[]")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or ("timed out" if isinstance(exc, TimeoutError) else type(exc).__name__)
        raise RayUnreachable(f"no Ray cluster at {address}: {reason.lower()}; start one with "
                             "`ray start --head` or give the address it printed") from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@contextmanager
def loopback_kept(address: str | None) -> Iterator[dict[str, Any]]:
    """Let ``ray.init`` connect to a cluster bound to 127.0.0.1 (Ray would swap in the host's
    IP); yields the extra ``ray.init`` arguments that go with it."""
    host = (address or "").rsplit(":", 1)[0].strip("[]")
    if host not in LOOPBACK:
        yield {}
        return
    from ray._private import services
    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda h: h
    try:
        yield {"_node_ip_address": "127.0.0.1"}
    finally:
        services.resolve_ip_for_localhost = resolve


def join(address: str | None, namespace: str, needed_by: str, timeout: float = 5.0) -> Any:
    """Join the Ray cluster at ``address`` (``HOST:PORT``; None or ``auto``: the one this
    machine runs) as a driver in ``namespace``; returns the ``ray`` module. ``ValueError`` for
    a bad address, ``RayUnreachable`` when nothing answers there, ``RuntimeError`` without Ray
    installed (naming ``needed_by``): each one line."""
    address = check_address(address, timeout)
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"{needed_by} needs Ray on this machine and every node: pip install 'ray==2.60.0'") from None
    import logging
    with loopback_kept(address) as extra:
        try:
            ray.init(address=address or "auto", namespace=namespace, ignore_reinit_error=True,
                     log_to_driver=False, logging_level=logging.WARNING, **extra)
        except ConnectionError as exc:           # "auto" and no cluster on this machine, or it went away
            raise RayUnreachable(f"no Ray cluster at {address or 'auto'}: {error_line(exc)}") from None
    return ray


def error_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (Ray's errors carry tracebacks of other processes)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
