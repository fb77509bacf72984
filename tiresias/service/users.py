"""The master's API users: roles, token issue and check, kept in the state database.

Three roles (``ROLES``):

* ``operator`` — the token in ``STATE/token`` (created at the master's first start); sees and
  does everything, drains nodes, sees every job. Its jobs are owned by ``operator``.
* ``user`` — submits jobs and sees, cancels and reads the logs and events of its own jobs
  only (another user's job is "no such job").
* ``viewer`` — read-only over every job (list, get, events, nodes, summary, the dashboard),
  no logs, no submit or cancel: a monitoring or team-lead view. A viewer owns no job, so
  "its own jobs only" would show nothing.

A user's token is 32 random bytes (``secrets.token_urlsafe``), shown once when the user is
added. The database keeps only ``sha256(salt || token)`` with a 16-byte random salt per user:
a random 256-bit token cannot be guessed from its hash, so a slow hash (scrypt) would only
cost every request time. Checking a token hashes it with every active user's salt and
compares in constant time (``hmac.compare_digest``). Revoking marks the row; adding the name
again gives a new token and the same jobs (rotation = revoke + add).
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from .store import Store

OPERATOR = "operator"
USER = "user"
VIEWER = "viewer"
ROLES = (OPERATOR, USER, VIEWER)
USER_ROLES = (USER, VIEWER)                      # what ``users add`` can give
NAME_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")   # also usable as an OS user name (--run-as-owner)


class UserError(RuntimeError):
    """A user change the directory refuses: an active user of that name, none to revoke."""


@dataclass(frozen=True)
class Principal:
    """Who made a request: a name (a job's owner) and a role."""
    name: str
    role: str

    @property
    def sees_all(self) -> bool:
        return self.role in (OPERATOR, VIEWER)


OPERATOR_PRINCIPAL = Principal(OPERATOR, OPERATOR)


def token_digest(salt: str, token: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + token.encode()).hexdigest()


class UserDirectory:
    """Users in the state database (the master and ``tiresias master users`` share it)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, name: str, role: str = USER) -> str:
        """Add ``name`` with ``role``; returns the new token (not kept anywhere). ``ValueError``
        for a bad name or role, ``UserError`` when an active user has the name."""
        if not NAME_RE.match(name or ""):
            raise ValueError(f"user name {name!r}: lower-case letters, digits, '_', '.', '-' (at most 32, "
                            "not starting with a digit, '.' or '-')")
        if name == OPERATOR:
            raise ValueError("'operator' is the name of the operator token (STATE/token)")
        if role not in USER_ROLES:
            raise ValueError(f"role {role!r}: one of {', '.join(USER_ROLES)}")
        token = secrets.token_urlsafe(32)
        salt = secrets.token_hex(16)
        if not self.store.add_user(name, role, salt, token_digest(salt, token), time.time()):
            raise UserError(f"user {name!r} exists (revoke it first to give it a new token)")
        return token

    def revoke(self, name: str) -> None:
        if not self.store.revoke_user(name, time.time()):
            raise UserError(f"no active user {name!r}")

    def list(self) -> list[dict[str, Any]]:
        """Every user, revoked ones too: name, role, created, revoked (never the hash)."""
        return [{k: u[k] for k in ("name", "role", "created", "revoked")} for u in self.store.users()]

    def authenticate(self, token: str) -> Principal | None:
        """The active user holding ``token``, or None."""
        found = None
        for user in self.store.users(active_only=True):
            if hmac.compare_digest(token_digest(user["salt"], token), user["hash"]) and found is None:
                found = Principal(user["name"], user["role"])
        return found
