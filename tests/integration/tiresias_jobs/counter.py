"""A preemptible test job: counts to N, one step per SLEEP seconds, checkpointing on request.

``counter.py N SLEEP [--ignore-stop] [--fail-at K] [--record-env]``. Holds an exclusive lock in its
checkpoint dir while it runs: a second copy of the same job running at once exits 9 and
writes DOUBLE there, so a test can tell that no job ever ran twice. Launched on several
nodes (plain launcher), node rank 0 counts and the others wait for it or for a stop request.
With ``--record-env`` each run appends what it was started with to ``env.jsonl`` there: its
run, uid, HOME and the sha256 of its ``AUTOPS_JOB_SECRET`` (never the secret itself).
"""
import fcntl
import hashlib
import json
import os
import sys
import time

from tiresias import job

total, pause = int(sys.argv[1]), float(sys.argv[2])
ignore = "--ignore-stop" in sys.argv
fail_at = int(sys.argv[sys.argv.index("--fail-at") + 1]) if "--fail-at" in sys.argv else None
ckdir = job.checkpoint_dir()
if os.environ.get("TIRESIAS_NODE_RANK", "0") != "0":
    while not (ckdir / "done").exists():
        if job.should_stop() and not ignore:
            job.exit_stopped()
        time.sleep(0.05)
    sys.exit(0)
lock = open(ckdir / "lock", "w")
try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    (ckdir / "DOUBLE").write_text(f"pid {os.getpid()}\n")
    sys.exit(9)
if "--record-env" in sys.argv:
    secret = os.environ.get("AUTOPS_JOB_SECRET", "")
    with open(ckdir / "env.jsonl", "a") as f:
        f.write(json.dumps({"run": os.environ.get("TIRESIAS_RUN"), "uid": os.getuid(), "home": os.environ.get("HOME"),
                            "secret_sha256": hashlib.sha256(secret.encode()).hexdigest() if secret else None}) + "\n")
state = ckdir / "state.json"
step = json.loads(state.read_text())["step"] if state.exists() else 0
print(f"start at step {step} on {os.environ.get('TIRESIAS_NODE')} gpus {os.environ.get('CUDA_VISIBLE_DEVICES')}",
      flush=True)
while step < total:
    if job.should_stop() and not ignore:
        tmp = ckdir / "state.json.tmp"
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, state)
        print(f"stopped at step {step}", flush=True)
        job.exit_stopped()
    if fail_at is not None and step == fail_at:
        print("failing on purpose", flush=True)
        sys.exit(3)
    time.sleep(pause)
    step += 1
    with open(ckdir / "steps.log", "a") as f:
        f.write(f"{step}\n")
(ckdir / "done").touch()
print(f"done at step {step}", flush=True)
