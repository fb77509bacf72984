"""The retransmission-timeout floor of the project's TCP data connections (``TCP_RTO_MIN_US``):
AutoPS's stream links and Infiniswap's device-to-daemon connections.

Linux never retransmits a lost segment by timer sooner than 200 ms after sending it, a floor
made for the wide area. Between the hosts of one cluster a round trip takes tens to hundreds
of microseconds, so a push or a pull reply whose last segments are lost -- nothing after them
to trigger a fast retransmission -- waits out the 200 ms while the job waits for it (measured
across emulated hosts: a migration's switch iteration with two timeouts paused its job 135 ms,
docs/results.md; a page read whose reply loses its tail waits as long). Since Linux 6.15 a
socket can lower its own floor. Each system reads its setting with ``rto_min_us_from_env``
(AutoPS ``$AUTOPS_TCP_RTO_MIN_US``, Infiniswap ``$INFINISWAP_TCP_RTO_MIN_US``; unset:
``RTO_MIN_US``; ``0`` leaves the kernel's): the timer then follows the measured round trip
(smoothed RTT + 4 x its variation) down to that floor. The kernel takes whole clock ticks, at least two
(8 ms at ``HZ=250``), so a request below that is raised to the least it accepts; an older
kernel refuses the option and the link keeps the kernel's floor. ``set_rto_min`` sets it on a
Python socket; Infiniswap's C core does the same on its own (``isw_tcp_set_rto_min``).
"""
from __future__ import annotations

import errno
import os
import socket
from typing import Mapping

__all__ = ["RTO_MIN_US", "KERNEL_RTO_MIN_US", "TCP_RTO_MIN_US", "rto_min_us_from_env", "set_rto_min", "unsupported"]

RTO_MIN_US = 10_000                 # asked for by default: 10 ms
KERNEL_RTO_MIN_US = 200_000         # the kernel's own floor, the most the option takes
TCP_RTO_MIN_US = getattr(socket, "TCP_RTO_MIN_US", 45)      # linux/tcp.h, 6.15+


def rto_min_us_from_env(env: str, strict: bool = True, environ: Mapping[str, str] | None = None) -> int:
    """``$env`` (microseconds, 0..``KERNEL_RTO_MIN_US``) in ``environ`` (default the
    process's environment), else ``RTO_MIN_US``. A value that is not one: ``ValueError``, or
    with ``strict`` off ``RTO_MIN_US``."""
    text = (os.environ if environ is None else environ).get(env, "").strip()
    if not text:
        return RTO_MIN_US
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= KERNEL_RTO_MIN_US:
        if not strict:
            return RTO_MIN_US
        raise ValueError(f"${env}={text!r}: not a whole number of microseconds from 0 to "
                         f"{KERNEL_RTO_MIN_US}")
    return value


def set_rto_min(sock: socket.socket, us: int) -> int | None:
    """Lower ``sock``'s retransmission-timeout floor to ``us`` microseconds, or as close above
    it as the kernel's clock allows (doubling the request until it is taken). Returns the
    floor in effect (read back), or None where ``us`` is 0 or the kernel has no such option."""
    if not us:
        return None
    ask = us
    while True:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, ask)
        except OSError as exc:
            if exc.errno != errno.EINVAL or ask >= KERNEL_RTO_MIN_US:
                return None               # no such option here (before 6.15), or not TCP
            ask = min(2 * ask, KERNEL_RTO_MIN_US)     # below the kernel's two ticks
            continue
        try:
            return sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US)
        except OSError:
            return ask


def unsupported() -> str | None:
    """Why this kernel offers no per-socket floor (``TCP_RTO_MIN_US``, Linux 6.15+), or None."""
    with socket.socket() as sock:
        try:
            sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US)
        except OSError as exc:
            return f"TCP_RTO_MIN_US not offered by this kernel: {exc}"
    return None
