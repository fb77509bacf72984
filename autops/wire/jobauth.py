"""Job secrets: where a job's secret comes from, and what pMaster keeps of it.

A job's secret is made by its launcher (``autops local``, the Tiresias master, the
benchmarks; ``autops secret`` for a torchrun launch) and given to every rank, usually as
``$AUTOPS_JOB_SECRET`` (``autops.config.AgentConfig.secret``). The first registration of a job id with pMaster sets it;
every later request of that job (registration of any rank, declare, table, profile, done,
and every push, pull and broadcast at the aggregators) must present the same one. pMaster
never sends it back.

``JobSecrets`` is pMaster's record of the live jobs' secrets: per job id a salted hash
(``dlrt.proof.secret_digest``), kept in a small SQLite file in pMaster's state directory,
so that after a pMaster restart nobody can claim a running job's id while its ranks and
aggregators come back (they present the secret again; it is checked against the hash). A
job's entry goes when the job is released. Without a state directory it is kept in memory.
"""
from __future__ import annotations

import os
import secrets
import sqlite3
import time
from pathlib import Path

from dlrt.proof import digest_matches, secret_digest

from ..config import SECRET_ENV

__all__ = ["MIN_SECRET_CHARS", "new_job_secret", "SecretRefused", "JobSecrets"]

MIN_SECRET_CHARS = 16      # a secret shorter than this is refused (guessable)
DB_NAME = "jobs.sqlite"


def new_job_secret() -> str:
    """A fresh job secret (256 random bits, hex): what a launcher gives every rank of a job."""
    return secrets.token_hex(32)


class SecretRefused(ValueError):
    """A request whose secret does not match its job's; ``reason`` names why (for metrics)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_secret_shape(job: str, secret: object) -> str:
    """``secret`` when it is a usable secret, else ``SecretRefused`` (``no_secret``/``weak_secret``)."""
    if not isinstance(secret, str) or not secret:
        raise SecretRefused(f"no secret presented for job {job}: give every rank the job's secret "
                            f"(${SECRET_ENV}; `autops local` and the Tiresias master set it, "
                            f"`export {SECRET_ENV}=$(autops secret)` for torchrun)", "no_secret")
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretRefused(f"the secret of job {job} is too short ({len(secret)} characters, at least "
                            f"{MIN_SECRET_CHARS}); make one with `autops secret`", "weak_secret")
    return secret


class JobSecrets:
    """Salted hashes of the live jobs' secrets, by job id, persisted in ``state_dir`` (or in
    memory when None). Used by one thread at a time: pMaster's loop, which may run on
    another thread than the one that built it (``check_same_thread=False``)."""

    def __init__(self, state_dir: str | os.PathLike | None = None) -> None:
        if state_dir is None:
            self.path = None
            self._db = sqlite3.connect(":memory:", check_same_thread=False)
        else:
            directory = Path(state_dir)
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(directory, 0o700)
            self.path = directory / DB_NAME
            self._db = sqlite3.connect(self.path, check_same_thread=False)
            os.chmod(self.path, 0o600)
        self._db.execute("CREATE TABLE IF NOT EXISTS jobs (job TEXT PRIMARY KEY, salt BLOB NOT NULL, "
                         "digest BLOB NOT NULL, since REAL NOT NULL)")
        self._db.commit()

    def jobs(self) -> list[str]:
        """The job ids with a recorded secret."""
        return [row[0] for row in self._db.execute("SELECT job FROM jobs ORDER BY job")]

    def known(self, job: str) -> bool:
        return self._row(job) is not None

    def _row(self, job: str) -> tuple[bytes, bytes] | None:
        return self._db.execute("SELECT salt, digest FROM jobs WHERE job = ?", (job,)).fetchone()

    def matches(self, job: str, secret: object) -> bool | None:
        """Whether ``secret`` is ``job``'s recorded secret; None when none is recorded."""
        row = self._row(job)
        if row is None:
            return None
        return digest_matches(secret, row[0], row[1])

    def claim(self, job: str, secret: object) -> None:
        """Record ``secret`` as ``job``'s when none is recorded; else it must match
        (``SecretRefused`` ``wrong_secret``)."""
        secret = check_secret_shape(job, secret)
        known = self.matches(job, secret)
        if known is False:
            raise SecretRefused(f"wrong secret for job {job}", "wrong_secret")
        if known is None:
            salt, digest = secret_digest(secret)
            self._db.execute("INSERT INTO jobs (job, salt, digest, since) VALUES (?, ?, ?, ?)",
                             (job, salt, digest, time.time()))
            self._db.commit()

    def forget(self, job: str) -> None:
        """``job`` was released: its id is free again."""
        self._db.execute("DELETE FROM jobs WHERE job = ?", (job,))
        self._db.commit()

    def close(self) -> None:
        self._db.close()
