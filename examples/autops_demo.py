"""``make demo``'s AutoPS stage: two training jobs share an elastic pool of aggregators on this machine.

Starts pMaster with the local provider (it starts aggregator processes on demand, at most 4),
runs two ``examples/train_digits.py`` jobs at once (each ``torchrun --nproc-per-node 2``, each
asking for 2 aggregators as a "2s-2w" job would; one in sum mode with SGD, one with
server-side Adam). pMaster profiles each job on temporary aggregators, packs both onto as few
aggregators as keep them within LossLimit, migrates their tensors live and releases the rest.
Prints per job its throughput, final test accuracy and where it ran, and pMaster's view.

    python examples/autops_demo.py
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from autops.wire.jobauth import new_job_secret
from autops.local import LocalPool
from autops.master.report import format_status

EXAMPLE = pathlib.Path(__file__).resolve().parent / "train_digits.py"
JOBS = [("digits-sgd", ["--mode", "sum", "--optimizer", "sgd"]),
        ("digits-adam", ["--mode", "server", "--optimizer", "adam"])]


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python examples/autops_demo.py", description=__doc__.splitlines()[0]).parse_args(argv)
    print("AutoPS demo: 2 jobs x 2 workers, each asking for 2 aggregators, on an elastic pool", flush=True)
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="autops-demo-"))
    snapshots: list[dict] = []
    master_args = ["--provider", "local", "--max-aggregators", "4", "--warmup-iters", "3",
                   "--profile-iters", "10", "--period", "2"]
    with LocalPool(0, master_args=master_args) as pool:
        print(f"pool up: pMaster {pool.master}; it starts aggregator processes when jobs need them", flush=True)
        procs = []
        start = time.perf_counter()
        for job, extra in JOBS:
            env = dict(os.environ, AUTOPS_MASTER=pool.master, AUTOPS_JOB=job, OMP_NUM_THREADS="1",
                       AUTOPS_AGGREGATORS="2", AUTOPS_JOB_SECRET=new_job_secret())   # one per job, every rank
            cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2", str(EXAMPLE), *extra,
                   "--json", str(out_dir / f"{job}.json")]
            log = open(out_dir / f"{job}.log", "w")
            procs.append((job, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        stop = threading.Event()

        def watch() -> None:           # what pMaster reports while both jobs run
            while not stop.wait(0.5):
                try:
                    status = pool.status()
                except Exception:
                    continue
                if len(status["jobs"]) == len(JOBS):
                    snapshots.append(status)
                    del snapshots[:-1]

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        failed = False
        for job, proc, log in procs:
            rc = proc.wait()
            log.close()
            if rc != 0:
                failed = True
                print(f"job {job} failed (exit {rc}); its log:\n{(out_dir / f'{job}.log').read_text()}")
        stop.set()
        watcher.join()
        elapsed = time.perf_counter() - start
    if failed:
        return 1
    print(f"\nboth jobs finished in {elapsed:.1f} s\n")
    print(f"{'job':<12} {'mode':<7} {'optimizer':<9} {'samples/s':>10} {'test acc':>9}  aggregators")
    for job, _ in JOBS:
        r = json.loads((out_dir / f"{job}.json").read_text())
        total = r["samples_per_s"] * r["world_size"]
        print(f"{job:<12} {r['mode']:<7} {r['optimizer']:<9} {total:>10.0f} {r['test_accuracy']:>9.4f}  "
              f"{', '.join(r['aggregators'])}")
    if snapshots:
        last = snapshots[-1]
        used = sum(a["state"] != "idle" and a["alive"] for a in last["aggregators"])
        asked = sum(j["requested_aggregators"] for j in last["jobs"])
        print(f"\npMaster's view at the end (both jobs running): {used} aggregator(s) served what the jobs "
              f"asked {asked} for; {last['migrations']['completed']} tensor keys migrated live\n")
        print(format_status(last))
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
