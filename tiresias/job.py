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

Several workers (``WORLD_SIZE`` > 1, as torchrun sets it) must stop after the same
iteration, or the ones still training wait for the others' gradients. Every rank calls
``should_stop()`` at the same points (once per iteration), and it turns true on every rank
at the same call: the first rank that sees the request writes down the call at which all
stop (``AGREE_AHEAD`` calls later) in a file next to the stop file and named after it (so
one left from an earlier request is never read), and the others read it. This
holds for data-parallel training that exchanges every iteration's gradients (AutoPS,
all-reduce): no rank can then be more than one iteration ahead of another, so each rank
reads the decision before it reaches that call.

A run that cannot start for a reason that passes (``exit_requeue``; AutoPS does this itself
when its pool refuses the job for now) is queued again by the master instead of failed.

``report(step, loss)`` tells the master how training goes (``TIRESIAS_PROGRESS_FILE``): rank
0's calls are buffered and appended to the file at most once a second (and at exit), so a
call per iteration costs a list append. The master shows the latest step, loss and speed
(``tiresias job``) and an allocation policy (Optimus) fits its models to them. Reporting
never fails the job: a full disk or a missing directory drops the reports.
"""
from __future__ import annotations

import atexit
import math
import os
import pathlib
import sys
import time
from typing import NoReturn

from dlrt import requeue

__all__ = ["job_id", "checkpoint_dir", "should_stop", "mark_stopped", "exit_stopped", "exit_requeue",
           "under_tiresias", "report", "StopPoll", "ProgressWriter"]

ENV_JOB_ID = "TIRESIAS_JOB_ID"
ENV_CHECKPOINT_DIR = "TIRESIAS_CHECKPOINT_DIR"
ENV_STOP_FILE = "TIRESIAS_STOP_FILE"
ENV_STOPPED_FILE = "TIRESIAS_STOPPED_FILE"
ENV_PROGRESS_FILE = "TIRESIAS_PROGRESS_FILE"
REPORT_EVERY_S = 1.0      # report() appends to the progress file at most this often
MAX_PROGRESS_BYTES = 16 << 20    # past this size the file takes no more reports
AGREE_AHEAD = 2           # ranks stop this many should_stop() calls after the first saw the request
EXIT_REQUEUE = 75         # exit status of exit_requeue (EX_TEMPFAIL)


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


class StopPoll:
    """``should_stop`` of one rank: the stop file, and with ``world_size`` > 1 the call at
    which all ranks agreed to stop (the file ``STOP_FILE-at-...``, written by the first rank
    that saw the stop file, read by the others)."""

    def __init__(self, stop_file: str | None, world_size: int = 1) -> None:
        self.stop_file = stop_file
        self.world_size = world_size
        self.calls = 0
        self._target: int | None = None          # the agreed call, once known

    def __call__(self) -> bool:
        self.calls += 1
        if not self.stop_file or not os.path.exists(self.stop_file):
            return False
        if self.world_size <= 1:
            return True
        if self._target is None:
            self._target = self._agreed()
        return self.calls >= self._target

    def _agreed(self) -> int:
        """The call at which every rank stops: the one written down, or this rank's proposal."""
        proposal = self.calls + AGREE_AHEAD
        at = self._decision_file()
        if at is None:
            return proposal
        try:
            fd = os.open(at, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return _read_call(at, proposal)
        except OSError:
            return proposal                      # cannot write there: stop on its own count
        try:
            os.write(fd, f"{proposal}\n".encode())
        finally:
            os.close(fd)
        return proposal

    def _decision_file(self) -> str | None:
        """``STOP_FILE-at-INODE-MTIME``: named after this stop request, so that one left by an
        earlier request (the master removes them at each launch) is never read."""
        try:
            st = os.stat(self.stop_file)
        except OSError:
            return None
        return f"{self.stop_file}-at-{st.st_ino:x}-{st.st_mtime_ns:x}"


def _read_call(path: str, fallback: int, wait: float = 2.0) -> int:
    """The call number in ``path``; another rank may be writing it (empty for a moment)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read()
            if text.endswith("\n"):
                return int(text)
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return fallback
        time.sleep(0.001)


_poll: StopPoll | None = None


def should_stop() -> bool:
    """Has the master asked this job to stop (checkpoint and exit)? With several workers,
    call it at the same points on every rank: it turns true on all of them at the same call."""
    global _poll
    if _poll is None:
        _poll = StopPoll(os.environ.get(ENV_STOP_FILE), int(os.environ.get("WORLD_SIZE") or 1))
    return _poll()


def mark_stopped() -> None:
    """Record that this job is exiting because it was asked to (call after saving)."""
    path = os.environ.get(ENV_STOPPED_FILE)
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).touch()


def exit_stopped() -> NoReturn:
    """``mark_stopped()`` then exit 0. An AutoPS worker left open leaves its job on the way
    out (``autops.worker.agent``), so the resumed run finds the job's aggregators free."""
    mark_stopped()
    sys.stdout.flush()
    sys.exit(0)


def exit_requeue(reason: str) -> NoReturn:
    """Exit ``EXIT_REQUEUE`` asking the master to queue the job again, for ``reason`` (shown
    in ``tiresias jobs`` and the job's events) -- e.g. a service it needs is busy. Outside
    Tiresias it only exits."""
    requeue.request(reason)
    sys.stdout.flush()
    sys.exit(EXIT_REQUEUE)


class ProgressWriter:
    """Buffered appends of ``<time> <step> [<loss>]`` lines to ``path`` (``report``)."""

    def __init__(self, path: str | None, every: float = REPORT_EVERY_S, limit: int = MAX_PROGRESS_BYTES) -> None:
        self.path = path
        self.every = every
        self.limit = limit
        self._lines: list[str] = []
        self._last = time.monotonic()

    def add(self, step: float, loss: float | None = None) -> None:
        if not self.path:
            return
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step < 0:
            raise ValueError(f"report: step must be a finite number >= 0, got {step!r}")
        if loss is not None:
            loss = float(loss)
            if not math.isfinite(loss):
                return                           # a diverged step: nothing to fit to
        step_text = str(step) if isinstance(step, int) else repr(float(step))
        self._lines.append(f"{time.time():.3f} {step_text}" + ("" if loss is None else f" {loss!r}") + "\n")
        if time.monotonic() - self._last >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self._lines or not self.path:
            return
        data = "".join(self._lines).encode()
        self._lines.clear()
        self._last = time.monotonic()
        try:
            with open(self.path, "ab") as f:
                if f.tell() + len(data) <= self.limit:
                    f.write(data)
        except OSError:
            pass                                 # never fail training over a report


_progress: ProgressWriter | None = None


def report(step: float, loss: float | None = None) -> None:
    """Tell the master this job reached ``step`` (optimizer steps since it began, across
    runs), with its training ``loss`` there if known. Cheap enough for every iteration; only
    rank 0 writes; outside Tiresias it does nothing."""
    global _progress
    if _progress is None:
        rank = os.environ.get("RANK", "0")
        _progress = ProgressWriter(os.environ.get(ENV_PROGRESS_FILE) if rank in ("", "0") else None)
        atexit.register(_progress.flush)
    _progress.add(step, loss)
