"""The operator's client of pMaster: the pool's status and live migrations.

``AdminClient(master)`` holds one connection (a ZeroMQ DEALER in its own context) for any
number of calls: ``status()`` is pMaster's status report (``autops.master.report`` documents it),
``migrate(job, keys, to)`` asks pMaster to move a job's keys (all of them by default) to
other aggregators (any other by default) while the job trains, ``resize(job, count)`` spreads
a job's keys over ``count`` aggregators with few moves (the Tiresias master changing a job's
aggregator count). Used by ``autops status`` and
``autops migrate``, ``LocalPool``, the benchmarks and the tests. A master that does not
answer within ``timeout`` seconds, or answers with an error, raises ``AutoPSError``.

Operator commands (``migrate``) present the operator token: ``token``, else the one in
``token_file``, else the key directory's ``operator.token`` (``dlrt.keys``); pMaster refuses
them without it (``AuthRefused``). ``status()`` needs none.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from dlrt.curve import Security
from dlrt.keys import ensure_operator_token, read_secret_file

from .wire import protocol as wire
from .worker.agent import MasterClient
from .transport.zmq import make_context

__all__ = ["AdminClient", "query_status", "operator_token"]


def operator_token(token_file: str | os.PathLike | None = None) -> str:
    """The operator token in ``token_file``, else the key directory's (made there when missing)."""
    return read_secret_file(token_file) if token_file else ensure_operator_token()


class AdminClient:
    """One connection to the pMaster at ``master`` (``tcp://HOST:PORT`` or ``ipc://PATH``)."""

    def __init__(self, master: str, timeout: float = 5.0, token: str | None = None,
                 token_file: str | os.PathLike | None = None, security: Security | None = None) -> None:
        self.master = master
        self._token, self._token_file = token, token_file
        self._ctx = make_context()
        self._client = MasterClient(self._ctx, master, timeout, security)

    def status(self) -> dict[str, Any]:
        """pMaster's status: aggregators, clusters, jobs, migrations."""
        return self._client.call(wire.STATUS)["status"]

    def migrate(self, job: str, keys: Sequence[str] | None = None,
                to: Sequence[str] | None = None) -> dict[str, Any]:
        """Start moving ``keys`` of ``job`` (None: all) to the aggregators ``to`` (None: the
        others); returns ``{"keys": moved, "batches": batches}`` once pMaster has planned it
        (follow its progress in ``status()["migrations"]``)."""
        reply = self._client.call(wire.MIGRATE, job=job, keys=list(keys) if keys else None,
                                  to=list(to) if to else None, token=self._operator_token())
        return {"keys": reply.get("keys"), "batches": reply.get("batches")}

    def resize(self, job: str, count: int) -> dict[str, Any]:
        """Spread all keys of ``job`` over ``count`` aggregators (the ones it uses first; fewer
        when fewer are live); returns ``{"keys", "batches", "aggregators"}`` (how many it got)."""
        reply = self._client.call(wire.MIGRATE, job=job, count=int(count), token=self._operator_token())
        return {"keys": reply.get("keys"), "batches": reply.get("batches"), "aggregators": reply.get("aggregators")}

    def _operator_token(self) -> str:
        if self._token is None:
            self._token = operator_token(self._token_file)
        return self._token

    def close(self) -> None:
        self._client.close()
        self._ctx.term()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def query_status(master: str, timeout: float = 5.0, security: Security | None = None) -> dict[str, Any]:
    """One ``status()`` call on a connection of its own."""
    with AdminClient(master, timeout, security=security) as admin:
        return admin.status()
