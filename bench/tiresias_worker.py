"""A benchmark job for the live Tiresias master: WORK seconds of steps, preemptible.

``tiresias_worker.py WORK [--step S] [--ckpt-seconds C]``: runs WORK seconds of work in
steps of S seconds, polls ``tiresias.job.should_stop()`` between steps, and on a request
spends C seconds "saving" (a stand-in for writing a checkpoint), records the progress and
exits. A resumed run continues from the recorded progress. Each run appends one line of
JSON to ``CHECKPOINT_DIR/runs.jsonl``: when it started doing work and how long its stop took.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from tiresias import job


def main() -> None:
    t0 = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=float)
    ap.add_argument("--step", type=float, default=0.1)
    ap.add_argument("--ckpt-seconds", type=float, default=0.0)
    args = ap.parse_args()
    ckdir = job.checkpoint_dir()
    state = ckdir / "progress.json" if ckdir else None
    done = json.loads(state.read_text())["done"] if state and state.exists() else 0.0
    record = {"pid": os.getpid(), "started": t0, "working": time.time(), "from": done}
    while done < args.work - 1e-9:
        if job.should_stop():
            asked = time.time()
            time.sleep(args.ckpt_seconds)
            tmp = state.with_suffix(".tmp")
            tmp.write_text(json.dumps({"done": done}))
            os.replace(tmp, state)
            record.update(stop_seen=asked, saved=time.time(), to=done)
            _append(ckdir, record)
            job.exit_stopped()
        step = min(args.step, args.work - done)
        time.sleep(step)
        done += step
    record.update(to=done, finished=time.time())
    if ckdir:
        _append(ckdir, record)


def _append(ckdir, record: dict) -> None:
    with open(ckdir / "runs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
