"""What a running job reports of its training: the lines ``tiresias.job.report`` appends to
its progress file, parsed and kept bounded.

Each line is ``<unix time> <step> [<loss>]``. The master reads a job's file in chunks from
where it stopped (``feed``); a line cut at a chunk's end waits for the next chunk, a line
that does not parse, or is longer than ``MAX_LINE`` bytes, is counted and skipped (the file
is the job's: anything may be in it). ``JobProgress`` keeps the latest step and loss, the
loss points (at most ``max_points``: when full, every other one is dropped, so the whole
curve stays at half the resolution), and the training speed in steps per second over the
last ``window`` seconds of reports. The master hands the points and speeds to an
allocation policy (``observe_loss``, ``observe_speed``) and shows them in the job's view.
"""
from __future__ import annotations

import math
from collections import deque

MAX_LINE = 256
MAX_POINTS = 512
SPEED_WINDOW_S = 60.0


class JobProgress:
    """One job's reported steps and losses (see the module docstring)."""

    def __init__(self, max_points: int = MAX_POINTS, window: float = SPEED_WINDOW_S) -> None:
        self.max_points = max_points
        self.window = window
        self.offset = 0                      # bytes of the file consumed
        self.step: float | None = None
        self.loss: float | None = None
        self.time: float | None = None
        self.points: list[tuple[float, float]] = []     # (step, loss), steps increasing
        self.malformed = 0
        self._partial = b""
        self._recent: deque[tuple[float, float]] = deque()   # (time, step) within the window
        self._new: list[tuple[float, float]] = []

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the file (from ``offset``)."""
        self.offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:        # no newline for too long: not a report line
            self.malformed += 1
            self._partial = b""
        for line in lines:
            if line.strip():
                self._line(line)

    def _line(self, line: bytes) -> None:
        parts = line.split()
        try:
            if len(line) > MAX_LINE or not 2 <= len(parts) <= 3:
                raise ValueError
            t, step = float(parts[0]), float(parts[1])
            loss = float(parts[2]) if len(parts) == 3 else None
            if not (math.isfinite(t) and math.isfinite(step) and step >= 0) or \
                    (loss is not None and not math.isfinite(loss)):
                raise ValueError
        except ValueError:
            self.malformed += 1
            return
        if self.step is not None and step < self.step:      # a resumed run repeats steps
            self._recent.clear()
        self.step, self.time = step, t
        self._recent.append((t, step))
        while self._recent and t - self._recent[0][0] > self.window:
            self._recent.popleft()
        if loss is not None:
            self.loss = loss
            if not self.points or step > self.points[-1][0]:
                self.points.append((step, loss))
                self._new.append((step, loss))
                if len(self.points) > self.max_points:
                    self.points = self.points[::2]

    def steps_per_s(self, since: float | None = None) -> float | None:
        """Steps per second over the last reports (``since``: those at or after that time;
        None with fewer than two, or no time between)."""
        recent = self._recent if since is None else [p for p in self._recent if p[0] >= since]
        if len(recent) < 2:
            return None
        (t0, s0), (t1, s1) = recent[0], recent[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return (s1 - s0) / (t1 - t0)

    def new_run(self) -> None:
        """The job started again (maybe at another GPU count): speeds from its new run's reports only."""
        self._recent.clear()

    def take_new_points(self) -> list[tuple[float, float]]:
        """Loss points added since the last call (for the policy)."""
        new, self._new = self._new, []
        return new

    def view(self) -> dict:
        return {"step": self.step, "loss": self.loss, "steps_per_s": self.steps_per_s(),
                "loss_points": len(self.points), "malformed_lines": self.malformed}
