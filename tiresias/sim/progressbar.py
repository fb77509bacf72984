"""The simulators' progress bar (tqdm) or progress callback."""
from __future__ import annotations

import time


def progress_reporter(progress, total: int):
    """A callable ``(done, running, now, final=False)`` drawing a tqdm bar, or None."""
    if not progress:
        return None
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
