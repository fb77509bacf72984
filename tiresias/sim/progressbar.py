"""The simulators' progress: a tqdm bar (a terminal), lines (``ProgressLines``: a log or a
pipe, where a bar's carriage returns pile up), or a callback."""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

LINE_EVERY_S = 10.0          # ProgressLines: seconds between lines while a run goes on


class ProgressLines:
    """Progress as whole lines on ``out`` (default: stderr): ``LABEL: D/T jobs done, day X
    simulated, R running (S s)`` every ``every`` seconds and one line when the run ends."""

    def __init__(self, label: str, every: float = LINE_EVERY_S, out: TextIO | None = None) -> None:
        self.label = label
        self.every = every
        self.out = out

    def reporter(self, total: int) -> Callable[..., None]:
        """The ``(done, running, now, final=False)`` callable of one run of ``total`` jobs."""
        start = time.perf_counter()
        last = [start]

        def report(done: int, run: int, now: float, final: bool = False) -> None:
            t = time.perf_counter()
            if not final and t - last[0] < self.every:
                return
            last[0] = t
            state = f"finished in {t - start:.1f} s" if final else f"{run} running ({t - start:.0f} s)"
            print(f"{self.label}: {done}/{total} jobs done, day {now / 86400:.1f} simulated, {state}",
                  file=self.out or sys.stderr, flush=True)
        return report


def progress_reporter(progress, total: int):
    """A callable ``(done, running, now, final=False)``: for ``True`` a tqdm bar, for a
    ``ProgressLines`` its lines, for another callable ``progress(done, total, now)``; or None."""
    if not progress:
        return None
    if isinstance(progress, ProgressLines):
        return progress.reporter(total)
    if callable(progress):
        return lambda done, run, now, final=False: progress(done, total, now)
    from tqdm import tqdm
    bar = tqdm(total=total, unit="job", desc="simulating", mininterval=0.5, leave=True)
    state = {"done": 0, "last": 0.0}

    def report(done: int, run: int, now: float, final: bool = False) -> None:
        t = time.perf_counter()
        if final or t - state["last"] > 0.5:
            bar.update(done - state["done"])
            state["done"] = done
            state["last"] = t
            bar.set_postfix_str(f"day {now / 86400:.1f}, running {run}", refresh=False)
            if final:
                bar.close()
    return report
