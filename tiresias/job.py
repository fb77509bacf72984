"""What a training job sees of the Tiresias master: its id, its checkpoint dir, stop requests.

A job launched by the master gets these environment variables (every executor sets them):

* ``TIRESIAS_JOB_ID``          the job's id;
* ``TIRESIAS_CHECKPOINT_DIR``  where to save and find checkpoints; the same directory on
  every run of the job, so a resumed job (possibly on other nodes) finds what it saved;
* ``TIRESIAS_STOP_FILE``       a path that exists while the master asks the job to stop;
* ``TIRESIAS_STOPPED_FILE``    a path the job creates when it exits because it was asked
  (``mark_stopped``), so the master tells "preempted" from "finished anyway".

A training loop polls ``should_stop()`` between iterations (a ``stat``, cheap enough for
every step); when it turns true the job saves a checkpoint to ``checkpoint_dir()``, calls
``mark_stopped()`` and exits 0. The master resumes it later with the same checkpoint dir.
When the job ignores the request, the master sends SIGTERM and then SIGKILL after its
``--stop-grace``. Outside Tiresias every call is harmless: ``should_stop()`` is False and
``checkpoint_dir()`` is None.
"""
from __future__ import annotations

import os
import pathlib
import sys
from typing import NoReturn

__all__ = ["job_id", "checkpoint_dir", "should_stop", "mark_stopped", "exit_stopped", "under_tiresias"]

ENV_JOB_ID = "TIRESIAS_JOB_ID"
ENV_CHECKPOINT_DIR = "TIRESIAS_CHECKPOINT_DIR"
ENV_STOP_FILE = "TIRESIAS_STOP_FILE"
ENV_STOPPED_FILE = "TIRESIAS_STOPPED_FILE"


def under_tiresias() -> bool:
    """True when this process was launched by a Tiresias master."""
    return bool(os.environ.get(ENV_JOB_ID))


def job_id() -> str | None:
    return os.environ.get(ENV_JOB_ID) or None


def checkpoint_dir() -> pathlib.Path | None:
    """The job's checkpoint directory (created if missing), or None outside Tiresias."""
    path = os.environ.get(ENV_CHECKPOINT_DIR)
    if not path:
        return None
    p = pathlib.Path(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


def should_stop() -> bool:
    """Has the master asked this job to stop (checkpoint and exit)?"""
    path = os.environ.get(ENV_STOP_FILE)
    return bool(path) and os.path.exists(path)


def mark_stopped() -> None:
    """Record that this job is exiting because it was asked to (call after saving)."""
    path = os.environ.get(ENV_STOPPED_FILE)
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).touch()


def exit_stopped() -> NoReturn:
    """``mark_stopped()`` then exit 0."""
    mark_stopped()
    sys.stdout.flush()
    sys.exit(0)
