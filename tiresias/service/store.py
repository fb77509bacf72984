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

A damaged database is refused, never run on nor silently replaced: opening one runs
``PRAGMA quick_check`` and decodes every job row; an existing empty (0-byte) file is refused
too (a missing one is a fresh start). Each refusal is one ``StateError`` line naming the file
and how to restore ``STATE/state.db.bak``, the copy the master keeps with SQLite's online
backup API (``Store.start_backups``: at start, every interval and at a clean stop, each
written to a temporary file and renamed over the last, and only from a database that passes
its check).

A full disk (SQLite's ``database or disk is full``, ``ENOSPC``) never loses a state change:
a write that fails for lack of space is kept, in order, in memory (``pending_writes``) and
applied before any later write and on every ``flush_pending`` (the master's passes), so the
database catches up as soon as space returns; the master's in-memory view stays the truth
meanwhile, and a master killed before then re-learns how its runs ended from the executor.
A new job or user is not queued: ``add_job``/``add_user`` raise ``StorageFull`` (a 507).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Iterable

SCHEMA_VERSION = 5

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
    # 3 -> 4: the dashboard's latest finished jobs and retention's expired ones, by index
    ["""CREATE INDEX jobs_ended ON jobs(ended)""",
     """CREATE INDEX jobs_owner_ended ON jobs(owner, ended)"""],
    # 4 -> 5: each run's AutoPS aggregator count (an allocation policy changes it; NULL: the spec's)
    ["""ALTER TABLE placements ADD COLUMN aggregators INTEGER"""],
]

ACTIVE = ("waiting", "running", "stopping", "preempted")
TERMINAL = ("finished", "failed", "cancelled")
STATUSES = ACTIVE + TERMINAL

_JSON_COLUMNS = ("spec", "placement", "handle")
_JSON_TYPES = {"spec": dict, "placement": list, "handle": dict}

MAX_PENDING = 100_000         # queued statements on a full disk before events (never job updates) are dropped

BACKUP_SUFFIX = ".bak"
DEFAULT_BACKUP_INTERVAL = 600.0

log = logging.getLogger("tiresias.store")


class StateError(RuntimeError):
    """The state dir cannot be used (newer schema, corrupt database)."""


class StorageFull(sqlite3.OperationalError):
    """A write failed because the state disk is full (nothing of it was stored)."""


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the database's size limit) is full."""
    if isinstance(exc, StorageFull):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and code & 0xFF == 13:           # SQLITE_FULL
            return True
        return "database or disk is full" in str(exc)
    return False


class Store:
    """Thread-safe access to the state database (one connection, one lock)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.backup_path = path + BACKUP_SUFFIX
        self._lock = threading.RLock()
        self._pending: list[list[tuple[str, tuple]]] = []     # writes a full disk refused, in order
        self._backup_stop: threading.Event | None = None
        self._backup_thread: threading.Thread | None = None
        if path != ":memory:" and os.path.exists(path) and os.path.getsize(path) == 0:
            raise StateError(self._damaged("is an empty file (0 bytes)"))
        try:
            _private_file(path)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        except sqlite3.DatabaseError as exc:
            raise StateError(f"state database {path}: {exc}") from None
        try:
            self._db.row_factory = sqlite3.Row
            problem = self._check()
            if problem:
                raise StateError(self._damaged(f"is corrupt ({problem})"))
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self.upgraded_from = self._upgrade()
            self._check_rows()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            if _corrupt(exc):
                raise StateError(self._damaged(f"cannot be read ({exc})")) from None
            raise StateError(f"state database {path}: {exc}") from None
        except StateError:
            self._db.close()
            raise

    def _check(self) -> str | None:
        """``PRAGMA quick_check``'s first complaint, or None when the database is sound."""
        with self._lock:
            try:
                rows = self._db.execute("PRAGMA quick_check(5)").fetchall()
            except sqlite3.DatabaseError as exc:
                if _corrupt(exc):
                    return " ".join(str(exc).split())
                raise
        found = [" ".join(str(r[0]).split()) for r in rows]
        return None if found == ["ok"] else "; ".join(found)[:300]

    def _damaged(self, what: str) -> str:
        """The one-line refusal of a damaged database: what is wrong and how to restore it."""
        path = os.path.abspath(self.path)
        bak = path + BACKUP_SUFFIX
        if os.path.isfile(bak) and os.path.getsize(bak) > 0:
            how = (f"restore the master's backup {bak} with: rm -f {path}-wal {path}-shm && cp {bak} {path} "
                   f"(keep a copy of the damaged file first if you want to inspect it)")
        else:
            how = (f"there is no backup {bak}; move the damaged file aside to start fresh "
                   f"(every job and user in it is lost)")
        return f"state database {path} {what}; {how}"

    def _check_rows(self) -> None:
        """Decode every job and placement row: a malformed one is named (job id and file)."""
        for row in self._query("SELECT id, spec, placement, handle FROM jobs"):
            _row(row, self)
        for row in self._query("SELECT job_id, run, nodes FROM placements"):
            try:
                json.loads(row["nodes"])
            except (TypeError, ValueError) as exc:
                raise StateError(self._damaged(f"has a malformed run {row['run']} of job {row['job_id']} "
                                               f"(nodes: {exc})")) from None

    # --- backups -----------------------------------------------------------------------------
    def backup(self) -> bool:
        """Copy the database to ``PATH.bak`` (online backup API, temporary file renamed over the
        last backup); False, keeping the last backup, when the database fails its check."""
        if self.path == ":memory:":
            return False
        tmp = f"{self.backup_path}.tmp{os.getpid()}"
        with self._lock:
            problem = self._check()
            if problem:
                log.error("%s fails its check (%s): backup %s not replaced", self.path, problem, self.backup_path)
                return False
            try:
                _private_file(tmp)
                dst = sqlite3.connect(tmp)
                try:
                    self._db.backup(dst)
                finally:
                    dst.close()
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.backup_path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        return True

    def start_backups(self, interval: float = DEFAULT_BACKUP_INTERVAL) -> None:
        """Back up now, then every ``interval`` seconds (0: only now) and at ``close``."""
        self.backup()
        self._backup_stop = threading.Event()
        if interval and interval > 0:
            self._backup_thread = threading.Thread(target=self._backups, args=(interval,),
                                                   name="tiresias-backup", daemon=True)
            self._backup_thread.start()

    def _backups(self, interval: float) -> None:
        assert self._backup_stop is not None
        while not self._backup_stop.wait(interval):
            try:
                self.backup()
            except (OSError, sqlite3.Error) as exc:
                log.error("backup of %s to %s failed: %s", self.path, self.backup_path, exc)

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
        """Store a new job; ``StorageFull`` (nothing stored) when the disk is full."""
        with self._lock:
            self._require_flushed()
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
        return _row(rows[0], self) if rows else None

    def jobs(self, statuses: Iterable[str] | None = None, limit: int | None = None,
             owner: str | None = None) -> list[dict[str, Any]]:
        """Jobs in id order (``owner``: only that user's)."""
        sql, args = _jobs_query(statuses, owner)
        sql += " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        return [_row(r, self) for r in self._query(sql, args)]

    def board_jobs(self, recent: int, owner: str | None = None) -> list[dict[str, Any]]:
        """Active jobs plus the ``recent`` latest-ended ones, in id order (by index: never the
        whole history)."""
        own, args = ("AND owner = ?", [owner]) if owner is not None else ("", [])
        marks = ", ".join("?" * len(ACTIVE))
        rows = self._query(f"SELECT * FROM jobs WHERE status IN ({marks}) {own}", [*ACTIVE, *args])
        rows += self._query(f"SELECT * FROM jobs WHERE ended IS NOT NULL {own} AND status NOT IN ({marks}) "
                            f"ORDER BY ended DESC LIMIT ?", [*args, *ACTIVE, int(recent)])
        return sorted((_row(r, self) for r in rows), key=lambda r: r["id"])

    def latest_jobs(self, limit: int, statuses: Iterable[str] | None = None,
                    owner: str | None = None) -> list[dict[str, Any]]:
        """The ``limit`` newest jobs (highest ids) of ``statuses``/``owner``, in id order."""
        sql, args = _jobs_query(statuses, owner)
        rows = self._query(sql + " ORDER BY id DESC LIMIT ?", [*args, int(limit)])
        return [_row(r, self) for r in reversed(rows)]

    def status_counts(self) -> dict[str, int]:
        """Jobs per status (an aggregate over the status index)."""
        return {r[0]: r[1] for r in self._query("SELECT status, COUNT(*) FROM jobs GROUP BY status")}

    def finished_jct(self) -> tuple[int, float | None]:
        """(finished jobs, their mean JCT in seconds) by SQL aggregate."""
        row = self._query("SELECT COUNT(*), AVG(ended - submitted) FROM jobs WHERE status = 'finished'")[0]
        return int(row[0]), row[1]

    # --- retention ---------------------------------------------------------------------------
    def expired(self, cutoff: float, limit: int) -> list[int]:
        """Up to ``limit`` ended jobs (terminal statuses) that ended before ``cutoff``, oldest first."""
        marks = ", ".join("?" * len(TERMINAL))
        rows = self._query(f"SELECT id FROM jobs WHERE ended IS NOT NULL AND ended < ? AND status IN ({marks}) "
                           f"ORDER BY ended LIMIT ?", [cutoff, *TERMINAL, int(limit)])
        return [int(r[0]) for r in rows]

    def delete_jobs(self, ids: list[int], cutoff: float | None = None, events_limit: int = 1000) -> bool:
        """Delete these jobs with their runs and events (and up to ``events_limit`` cluster events
        older than ``cutoff``) in one transaction; False (nothing deleted) on a full disk."""
        marks = ", ".join("?" * len(ids))
        stmts = []
        if ids:
            stmts = [(f"DELETE FROM events WHERE job_id IN ({marks})", tuple(ids)),
                     (f"DELETE FROM placements WHERE job_id IN ({marks})", tuple(ids)),
                     (f"DELETE FROM jobs WHERE id IN ({marks}) AND ended IS NOT NULL", tuple(ids))]
        if cutoff is not None:
            stmts.append(("DELETE FROM events WHERE id IN (SELECT id FROM events WHERE job_id IS NULL "
                          "AND time < ? ORDER BY id LIMIT ?)", (cutoff, int(events_limit))))
        with self._lock:
            try:
                self._require_flushed()
                self._apply(stmts)
            except StorageFull:
                return False
        return True

    # --- runs and events -----------------------------------------------------------------------
    def add_placement(self, job_id: int, run: int, nodes: Any, started: float,
                      aggregators: int | None = None) -> None:
        self._write([("INSERT OR REPLACE INTO placements(job_id, run, nodes, started, aggregators) "
                      "VALUES (?, ?, ?, ?, ?)", (job_id, run, json.dumps(nodes), started, aggregators))])

    def set_placement_aggregators(self, job_id: int, run: int, aggregators: int) -> None:
        """A run's aggregator count changed while it ran (its keys spread or packed live)."""
        self._write([("UPDATE placements SET aggregators = ? WHERE job_id = ? AND run = ?",
                      (aggregators, job_id, run))])

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
        with self._lock:
            self._require_flushed()
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
        if self._backup_stop is not None:
            self._backup_stop.set()
            if self._backup_thread is not None:
                self._backup_thread.join(timeout=60)
            try:
                self.backup()
            except (OSError, sqlite3.Error) as exc:
                log.error("backup of %s to %s failed: %s", self.path, self.backup_path, exc)
            self._backup_stop = None
        with self._lock:
            self._db.close()

    # --- plumbing ------------------------------------------------------------------------------
    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def _write(self, stmts: list[tuple[str, tuple]]) -> None:
        """Apply ``stmts`` in one transaction, after any pending ones; on a full disk keep them
        pending (in order) instead: a state change is never dropped."""
        if not stmts:
            return
        with self._lock:
            if self._pending and not self._flush_locked():
                self._queue(stmts)
                return
            try:
                self._apply(stmts)
            except StorageFull as exc:
                log.error("state database %s: %s; keeping the write in memory until space returns", self.path, exc)
                self._queue(stmts)

    def _apply(self, stmts: list[tuple[str, tuple]]) -> None:
        with self._tx() as db:
            for sql, args in stmts:
                db.execute(sql, args)

    def _queue(self, stmts: list[tuple[str, tuple]]) -> None:
        self._pending.append(list(stmts))
        if self.pending_writes() > MAX_PENDING:         # bounded: events go first, job updates never
            dropped = 0
            for batch in self._pending:
                keep = [st for st in batch if not st[0].startswith("INSERT INTO events")]
                dropped += len(batch) - len(keep)
                batch[:] = keep
            self._pending = [b for b in self._pending if b]
            log.error("state database %s: disk still full; dropped %d queued events", self.path, dropped)

    def _flush_locked(self) -> bool:
        while self._pending:
            try:
                self._apply(self._pending[0])
            except StorageFull:
                return False
            self._pending.pop(0)
        return True

    def _require_flushed(self) -> None:
        if self._pending and not self._flush_locked():
            raise StorageFull("database or disk is full (earlier writes still wait for space)")

    def flush_pending(self) -> bool:
        """Apply the writes a full disk refused; True when none is left."""
        with self._lock:
            if self._pending and self._flush_locked():
                log.warning("state database %s: space is back; queued writes applied", self.path)
            return not self._pending

    def pending_writes(self) -> int:
        """Statements waiting for disk space."""
        with self._lock:
            return sum(len(b) for b in self._pending)

    def _tx(self):
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if is_full(exc):
                raise StorageFull(str(exc)) from exc
            raise
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error as commit_exc:       # never leave the transaction open
                self._rollback()
                if is_full(commit_exc):
                    raise StorageFull(str(commit_exc)) from commit_exc
                raise
        self._rollback()
        if exc is not None and not isinstance(exc, StorageFull) and is_full(exc):
            raise StorageFull(str(exc)) from exc

    def _rollback(self) -> None:
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass


def _jobs_query(statuses: Iterable[str] | None, owner: str | None) -> tuple[str, list[Any]]:
    """``SELECT * FROM jobs`` restricted to ``statuses`` and ``owner`` (None: any), and its args."""
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
    return sql, args


def migrate_to(db: sqlite3.Connection, target: int, start: int = 0) -> None:
    """Apply ``MIGRATIONS[start:target]`` in one transaction and record the version."""
    with _Transaction(db):
        for version in range(start, target):
            for sql in MIGRATIONS[version]:
                db.execute(sql)
        db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", (str(target),))


def _corrupt(exc: sqlite3.Error) -> bool:
    """Whether SQLite's error says the file is damaged (SQLITE_CORRUPT, SQLITE_NOTADB)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (11, 26)
    text = str(exc)
    return "malformed" in text or "not a database" in text


def _private_file(path: str) -> None:
    """Create ``path`` mode 0600 if missing; make an existing one 0600."""
    if path == ":memory:":
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _row(row: sqlite3.Row, store: Store | None = None) -> dict[str, Any]:
    d = dict(row)
    for k in _JSON_COLUMNS:
        if d.get(k) is not None:
            try:
                d[k] = json.loads(d[k])
                if not isinstance(d[k], _JSON_TYPES[k]):
                    raise ValueError(f"a JSON {type(d[k]).__name__}, not a {_JSON_TYPES[k].__name__}")
            except (TypeError, ValueError) as exc:
                what = f"has a malformed row for job {d.get('id')} ({k}: {exc})"
                raise StateError(store._damaged(what) if store is not None else f"state database {what}") from None
    return d
