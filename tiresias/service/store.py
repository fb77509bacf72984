"""The master's state in SQLite (WAL): the source of truth every executor reconciles to.

Tables: ``meta`` (schema version, master address), ``jobs`` (spec, status, attained service,
queue, current run and its placement and executor handle, checkpoint location, outcome),
``placements`` (one row per run: where it ran, when, how it ended), ``events`` (starts,
preemptions, resumes, finishes, refusals, report staleness; what the dashboard shows) and
``users`` (API users: name, role and a salted hash of their token, ``tiresias.service.users``).
A job row carries its ``owner`` (the user who submitted it, ``operator`` for the operator's
token) and its AutoPS ``secret``, which no view of a job ever shows.

The database file is created mode 0600 (it holds the jobs' secrets and the users' token
hashes; SQLite gives its WAL files the same mode).

The schema carries a version (``meta.schema_version``); ``MIGRATIONS[i]`` upgrades version
``i`` to ``i + 1``, so a master started on an older state dir upgrades it in place. Writes
happen in short transactions; WAL with ``synchronous=NORMAL`` survives a killed master
(not a power cut of the last transaction).
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from typing import Any, Iterable

SCHEMA_VERSION = 3

MIGRATIONS: list[list[str]] = [
    # 0 -> 1: the first schema
    ["""CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
     """CREATE TABLE jobs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            name TEXT NOT NULL,
            spec TEXT NOT NULL,
            gpus INTEGER NOT NULL,
            status TEXT NOT NULL,
            submitted REAL NOT NULL,
            started REAL,
            ended REAL,
            preemptions INTEGER NOT NULL DEFAULT 0,
            attained_service REAL NOT NULL DEFAULT 0,
            executed REAL NOT NULL DEFAULT 0,
            waited REAL NOT NULL DEFAULT 0,
            wait_since REAL NOT NULL DEFAULT 0,
            service_at REAL,
            run INTEGER NOT NULL DEFAULT 0,
            placement TEXT,
            handle TEXT,
            stop_requested REAL,
            checkpoint_dir TEXT,
            exit_code INTEGER,
            detail TEXT)""",
     """CREATE INDEX jobs_status ON jobs(status)""",
     """CREATE TABLE placements (
            job_id INTEGER NOT NULL,
            run INTEGER NOT NULL,
            nodes TEXT NOT NULL,
            started REAL NOT NULL,
            ended REAL,
            outcome TEXT,
            PRIMARY KEY (job_id, run))""",
     """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            time REAL NOT NULL,
            job_id INTEGER,
            kind TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT '')"""],
    # 1 -> 2: queue and measured skew kept with the job (shown and used after a restart)
    ["""ALTER TABLE jobs ADD COLUMN queue INTEGER NOT NULL DEFAULT 0""",
     """ALTER TABLE jobs ADD COLUMN skew REAL""",
     """CREATE INDEX events_job ON events(job_id)"""],
    # 2 -> 3: per-user tokens, job owners, per-job AutoPS secrets
    ["""ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT 'operator'""",
     """ALTER TABLE jobs ADD COLUMN secret TEXT""",
     """CREATE INDEX jobs_owner ON jobs(owner)""",
     """CREATE TABLE users (
            name TEXT PRIMARY KEY,
            role TEXT NOT NULL,
            salt TEXT NOT NULL,
            hash TEXT NOT NULL,
            created REAL NOT NULL,
            revoked REAL)"""],
]

ACTIVE = ("waiting", "running", "stopping", "preempted")
TERMINAL = ("finished", "failed", "cancelled")
STATUSES = ACTIVE + TERMINAL

_JSON_COLUMNS = ("spec", "placement", "handle")


class StateError(RuntimeError):
    """The state dir cannot be used (newer schema, corrupt database)."""


class Store:
    """Thread-safe access to the state database (one connection, one lock)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        try:
            _private_file(path)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self.upgraded_from = self._upgrade()
        except sqlite3.DatabaseError as exc:
            raise StateError(f"state database {path}: {exc}") from None

    # --- schema ------------------------------------------------------------------------------
    def version(self) -> int:
        try:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.OperationalError:
            return 0
        return int(row[0]) if row else 0

    def _upgrade(self) -> int | None:
        with self._lock:
            start = self.version()
            if start > SCHEMA_VERSION:
                raise StateError(f"state database {self.path} has schema version {start}; this master knows "
                                 f"up to {SCHEMA_VERSION} (upgrade the software)")
            if start == SCHEMA_VERSION:
                return None
            migrate_to(self._db, SCHEMA_VERSION, start)
            return start

    # --- meta ------------------------------------------------------------------------------
    def set_meta(self, key: str, value: str) -> None:
        self._write([("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))])

    # --- jobs ------------------------------------------------------------------------------
    def add_job(self, name: str, spec: dict[str, Any], gpus: int, submitted: float, owner: str = "operator",
                secret: str | None = None) -> int:
        with self._lock, self._tx() as db:
            cur = db.execute("INSERT INTO jobs(name, spec, gpus, status, submitted, wait_since, owner, secret) "
                             "VALUES (?, ?, ?, 'waiting', ?, ?, ?, ?)",
                             (name, json.dumps(spec), gpus, submitted, submitted, owner, secret))
            job_id = int(cur.lastrowid)
            db.execute("INSERT INTO events(time, job_id, kind, detail) VALUES (?, ?, 'submitted', ?)",
                       (submitted, job_id, f"{gpus} GPU(s)"))
            return job_id

    def update_job(self, job_id: int, **fields: Any) -> None:
        self.update_jobs([(job_id, fields)])

    def update_jobs(self, changes: Iterable[tuple[int, dict[str, Any]]], events: Iterable[tuple] = ()) -> None:
        """Several job updates (and events ``(time, job_id, kind, detail)``) in one transaction."""
        stmts = []
        for job_id, fields in changes:
            if not fields:
                continue
            cols = ", ".join(f"{k} = ?" for k in fields)
            vals = [json.dumps(v) if k in _JSON_COLUMNS and v is not None else v for k, v in fields.items()]
            stmts.append((f"UPDATE jobs SET {cols} WHERE id = ?", (*vals, job_id)))
        stmts += [("INSERT INTO events(time, job_id, kind, detail) VALUES (?, ?, ?, ?)", e) for e in events]
        self._write(stmts)

    def job(self, job_id: int) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _row(rows[0]) if rows else None

    def jobs(self, statuses: Iterable[str] | None = None, limit: int | None = None,
             owner: str | None = None) -> list[dict[str, Any]]:
        """Jobs in id order (``owner``: only that user's)."""
        sql, args, where = "SELECT * FROM jobs", [], []
        if statuses is not None:
            statuses = list(statuses)
            where.append(f"status IN ({', '.join('?' * len(statuses))})")
            args += statuses
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        return [_row(r) for r in self._query(sql, args)]

    # --- runs and events -----------------------------------------------------------------------
    def add_placement(self, job_id: int, run: int, nodes: Any, started: float) -> None:
        self._write([("INSERT OR REPLACE INTO placements(job_id, run, nodes, started) VALUES (?, ?, ?, ?)",
                      (job_id, run, json.dumps(nodes), started))])

    def end_placement(self, job_id: int, run: int, ended: float, outcome: str) -> None:
        self._write([("UPDATE placements SET ended = ?, outcome = ? WHERE job_id = ? AND run = ?",
                      (ended, outcome, job_id, run))])

    def placements(self, job_id: int) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM placements WHERE job_id = ? ORDER BY run", (job_id,))
        return [{**dict(r), "nodes": json.loads(r["nodes"])} for r in rows]

    def event(self, kind: str, job_id: int | None = None, detail: str = "", when: float | None = None) -> None:
        self._write([("INSERT INTO events(time, job_id, kind, detail) VALUES (?, ?, ?, ?)",
                      (time.time() if when is None else when, job_id, kind, detail))])

    def events(self, since: int = 0, job_id: int | None = None, limit: int = 200,
               owner: str | None = None) -> list[dict[str, Any]]:
        """Recent events, oldest first (``owner``: only events of that user's jobs)."""
        sql, args = "SELECT * FROM events WHERE id > ?", [since]
        if job_id is not None:
            sql += " AND job_id = ?"
            args.append(job_id)
        if owner is not None:
            sql += " AND job_id IN (SELECT id FROM jobs WHERE owner = ?)"
            args.append(owner)
        sql += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        return [dict(r) for r in reversed(self._query(sql, args))]

    # --- users ------------------------------------------------------------------------------
    def add_user(self, name: str, role: str, salt: str, digest: str, created: float) -> bool:
        """Store a user (replacing a revoked one of that name); False when an active one exists."""
        with self._lock, self._tx() as db:
            row = db.execute("SELECT revoked FROM users WHERE name = ?", (name,)).fetchone()
            if row is not None and row["revoked"] is None:
                return False
            db.execute("INSERT OR REPLACE INTO users(name, role, salt, hash, created, revoked) "
                       "VALUES (?, ?, ?, ?, ?, NULL)", (name, role, salt, digest, created))
            return True

    def revoke_user(self, name: str, when: float) -> bool:
        """Revoke an active user's token; False when there is none of that name."""
        with self._lock, self._tx() as db:
            cur = db.execute("UPDATE users SET revoked = ? WHERE name = ? AND revoked IS NULL", (when, name))
            return cur.rowcount > 0

    def users(self, active_only: bool = False) -> list[dict[str, Any]]:
        sql = "SELECT * FROM users" + (" WHERE revoked IS NULL" if active_only else "") + " ORDER BY name"
        return [dict(r) for r in self._query(sql)]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- plumbing ------------------------------------------------------------------------------
    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def _write(self, stmts: list[tuple[str, tuple]]) -> None:
        if not stmts:
            return
        with self._lock, self._tx() as db:
            for sql, args in stmts:
                db.execute(sql, args)

    def _tx(self):
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, *_: Any) -> None:
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def migrate_to(db: sqlite3.Connection, target: int, start: int = 0) -> None:
    """Apply ``MIGRATIONS[start:target]`` in one transaction and record the version."""
    with _Transaction(db):
        for version in range(start, target):
            for sql in MIGRATIONS[version]:
                db.execute(sql)
        db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", (str(target),))


def _private_file(path: str) -> None:
    """Create ``path`` mode 0600 if missing; make an existing one 0600."""
    if path == ":memory:":
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _row(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    for k in _JSON_COLUMNS:
        if d.get(k) is not None:
            d[k] = json.loads(d[k])
    return d
