"""Whether a service of ``dlrt cluster`` answers at its endpoint, and what it says.

pMaster: a STATUS call (aggregators and jobs); an Infiniswap daemon: its STATUS (free and
lent memory); the Tiresias master: any HTTP answer from its API (a 401 without a token is
an answer). Each returns ``(answers, one line)`` within ``timeout`` and never raises.
"""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Callable

from dlrt.cli import one_line
from dlrt.sizes import format_size

from .plan import AUTOPS, INFINISWAP, TIRESIAS


def autops(endpoint: str, timeout: float) -> tuple[bool, str]:
    from autops.admin import query_status
    try:
        status = query_status(endpoint, timeout=timeout)
    except Exception as exc:                     # TimeoutError, a refusal: it does not answer as it should
        return False, one_line(exc)
    return True, f"{len(status.get('aggregators') or [])} aggregators, {len(status.get('jobs') or [])} jobs"


def infiniswap(endpoint: str, timeout: float) -> tuple[bool, str]:
    from infiniswap import protocol as p
    from infiniswap.channel import ask
    try:
        msg = ask(endpoint, p.STATUS, timeout=timeout)
    except Exception as exc:                     # TimeoutError, ProtocolError
        return False, one_line(exc)
    if msg.op != p.REPORT:
        return False, f"answered {msg.op}: {msg.get('reason', '')}"
    report = msg["report"]
    lent = (report.get("slabs_mapped") or 0) * (report.get("slab_size") or 0)
    return True, f"{format_size(report.get('giveable_bytes'))} lendable, {format_size(lent)} lent"


def tiresias(endpoint: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"{endpoint}/api/v1/summary", timeout=timeout) as reply:
            return True, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:        # an answer all the same (401: no token given)
        return True, f"HTTP {exc.code}"
    except Exception as exc:                     # URLError, timeout
        return False, one_line(getattr(exc, "reason", exc))


PROBES = {AUTOPS: autops, INFINISWAP: infiniswap, TIRESIAS: tiresias}


def probe(kind: str, endpoint: str, timeout: float = 2.0) -> tuple[bool, str]:
    """Whether the ``kind`` service at ``endpoint`` answers, and a line on what it said."""
    return PROBES[kind](endpoint, timeout)


def wait_until_answers(kind: str, endpoint: str, gone: Callable[[], str | None], timeout: float,
                       every: float = 0.3) -> str:
    """Wait until the ``kind`` service at ``endpoint`` answers; returns what it said.
    ``gone()`` says why the service can no longer answer (exited, its actor died), None while
    it still can. ``RuntimeError`` (one line) when it is gone or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    said = "no answer yet"
    while True:
        answers, said = probe(kind, endpoint, timeout=min(2.0, max(0.2, deadline - time.monotonic())))
        if answers:
            return said
        why = gone()
        if why:
            raise RuntimeError(why)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no answer at {endpoint} within {timeout:g} s ({said})")
        time.sleep(every)
