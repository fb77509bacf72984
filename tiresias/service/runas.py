"""Jobs as their owners' OS users (``tiresias master --run-as-owner``, local executor, as root).

* ``account(name)``: the OS user a job runs as (it must exist: ``useradd`` is the
  operator's business, not the master's).
* ``hand_over(...)``: the job's checkpoint dir (and its control dir) become the user's, mode
  0700; its log file the user's, 0600, in a job dir the master keeps (0711: the user reaches
  its log, never the run dirs where the supervisor keeps its records). The operator's jobs,
  which run as the master's own user, get the same modes.
* ``dropper(account, first, workdir)``: a ``preexec_fn`` for the job's processes that runs
  ``first`` (joining a memory cgroup needs root), gives up root for good (supplementary groups,
  gid, uid) and only then enters the job's ``workdir``: no path of the job is looked at as root.
* ``can_enter(account, path)``: whether ``account`` can enter ``path``, tried in a child process
  that is already that user (the caller learns nothing a root check would tell: a path that
  does not exist and one the user may not reach answer the same); ``cannot_enter`` is the
  message for both.
* ``touch_control`` / ``remove_control(s)`` / ``read_control``: the master's stop-request files
  live in a dir the job's user owns, so they are created, removed and read relative to
  directory descriptors opened with ``O_NOFOLLOW``: a symlink the job plants there cannot make
  root touch, remove or read a file elsewhere.
"""
from __future__ import annotations

import os
import pwd
import stat
import subprocess
from dataclasses import dataclass
from typing import Callable


class NoAccount(LookupError):
    """The OS user a job should run as does not exist."""


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str


def account(name: str) -> Account:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise NoAccount(f"no OS user {name!r} on this machine (create it, or map the owner with "
                        f"--user-map OWNER=OSUSER)") from None
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def account_env(acct: Account) -> dict[str, str]:
    """What a login of ``acct`` would set: HOME, USER, LOGNAME."""
    return {"HOME": acct.home, "USER": acct.name, "LOGNAME": acct.name}


def hand_over(uid: int, gid: int, checkpoint_job_dir: str, control_dir: str, job_dir: str, log_path: str) -> None:
    """Give the job's checkpoint and control dirs and its log to ``uid:gid`` (the dirs exist)."""
    for d in (checkpoint_job_dir, control_dir):
        os.chown(d, uid, gid, follow_symlinks=False)
        _chmod_dir(d, 0o700)
    os.chmod(job_dir, 0o711)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _chmod_dir(path: str, mode: int) -> None:
    """chmod a directory, refusing a symlink in its place."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def dropper(acct: Account, first: Callable[[], None] | None = None,
            workdir: str | None = None) -> Callable[[], None]:
    """A ``preexec_fn``: ``first()`` (as root), then become ``acct`` (groups, gid, uid), then
    enter ``workdir`` as ``acct`` (give ``Popen`` no ``cwd``: it enters it before this runs)."""
    def drop() -> None:
        if first is not None:
            first()
        os.initgroups(acct.name, acct.gid)
        os.setgid(acct.gid)
        os.setuid(acct.uid)
        if workdir is not None:
            os.chdir(workdir)
    return drop


def cannot_enter(acct: Account, path: str) -> str:
    """The one answer for a workdir ``acct`` cannot enter, whether or not it exists."""
    return f"workdir {path!r} is not a directory that OS user {acct.name!r} can enter"


def can_enter(acct: Account, path: str, timeout: float = 30.0) -> bool:
    """Whether ``acct`` can enter the directory ``path`` (an absolute path): ``cd`` in a child
    that became ``acct`` before it looks at the path (root never does)."""
    if not os.path.isabs(path):
        return False
    try:
        r = subprocess.run(["/bin/sh", "-c", 'cd -- "$1"', "sh", path], cwd="/", env={"PATH": "/usr/bin:/bin"},
                           user=acct.uid, group=acct.gid, extra_groups=os.getgrouplist(acct.name, acct.gid),
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _open_dir(parent: str, name: str) -> int:
    return os.open(os.path.join(parent, name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _in_control(checkpoint_job_dir: str, action: Callable[[int], None]) -> None:
    """``action(fd of CHECKPOINT_JOB_DIR/control)``, neither dir reached through a symlink."""
    top = _open_dir(os.path.dirname(checkpoint_job_dir), os.path.basename(checkpoint_job_dir))
    try:
        control = os.open("control", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
        try:
            action(control)
        finally:
            os.close(control)
    finally:
        os.close(top)


def touch_control(checkpoint_job_dir: str, name: str) -> None:
    """Create ``CHECKPOINT_JOB_DIR/control/NAME`` (never through a symlink)."""
    def touch(control: int) -> None:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=control))
    _in_control(checkpoint_job_dir, touch)


def read_control(checkpoint_job_dir: str, name: str, limit: int = 4096, offset: int = 0) -> str | None:
    """``limit`` bytes from ``offset`` of ``CHECKPOINT_JOB_DIR/control/NAME`` as text, or None
    when it is not there or not a regular file (never read through a symlink, never blocking
    on a FIFO)."""
    found = read_control_bytes(checkpoint_job_dir, name, limit, offset)
    return None if found is None else found.decode("utf-8", "replace")


def read_control_bytes(checkpoint_job_dir: str, name: str, limit: int = 4096, offset: int = 0) -> bytes | None:
    """``read_control`` without decoding (a caller that keeps an offset counts bytes)."""
    found: list[bytes] = []

    def read(control: int) -> None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=control)
        except OSError:
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                found.append(os.pread(fd, limit, offset))
        finally:
            os.close(fd)
    try:
        _in_control(checkpoint_job_dir, read)
    except OSError:
        return None
    return found[0] if found else None


def remove_controls(checkpoint_job_dir: str, prefix: str) -> None:
    """Remove every ``CHECKPOINT_JOB_DIR/control/PREFIX*`` (symlinks removed, not followed)."""
    def remove(control: int) -> None:
        for name in os.listdir(control):
            if name.startswith(prefix):
                try:
                    os.unlink(name, dir_fd=control)
                except (FileNotFoundError, IsADirectoryError, PermissionError):
                    pass
    _in_control(checkpoint_job_dir, remove)


def remove_control(checkpoint_job_dir: str, name: str) -> None:
    """Remove ``CHECKPOINT_JOB_DIR/control/NAME`` if it is there (a symlink is removed, not followed)."""
    def remove(control: int) -> None:
        try:
            os.unlink(name, dir_fd=control)
        except FileNotFoundError:
            pass
    _in_control(checkpoint_job_dir, remove)
