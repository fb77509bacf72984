"""``make demo``: two training jobs share one pool of two aggregators on this machine.

Starts pMaster and 2 aggregators, runs two ``examples/train_digits.py`` jobs at once (each
``torchrun --nproc-per-node 2``; one in sum mode with SGD, one with server-side Adam),
and prints per job its throughput, final test accuracy and the aggregators that served it.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from .local import LocalPool

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_digits.py"
JOBS = [("digits-sgd", ["--mode", "sum", "--optimizer", "sgd"]),
        ("digits-adam", ["--mode", "server", "--optimizer", "adam"])]


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def main() -> int:
    if not EXAMPLE.exists():
        print(f"demo: {EXAMPLE} not found (run from a source checkout)", file=sys.stderr)
        return 1
    print("AutoPS demo: 2 jobs x 2 workers sharing a pool of 2 aggregators on this machine", flush=True)
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="autops-demo-"))
    snapshots: list[dict] = []
    with LocalPool(2) as pool:
        print(f"pool up: pMaster {pool.master}, aggregators agg-0 and agg-1", flush=True)
        procs = []
        start = time.perf_counter()
        for job, extra in JOBS:
            env = dict(os.environ, AUTOPS_MASTER=pool.master, AUTOPS_JOB=job, OMP_NUM_THREADS="1")
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
                keys = sum(j["keys"] for j in status["jobs"])
                if keys > (sum(j["keys"] for j in snapshots[-1]["jobs"]) if snapshots else 0):
                    snapshots.append(status)

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
        print("\npMaster's view while both jobs trained (bytes of each job per aggregator):")
        for j in snapshots[-1]["jobs"]:
            spread = ", ".join(f"{a}: {b / 1024:.1f} KiB" for a, b in j["bytes_per_aggregator"].items())
            print(f"  {j['job']:<12} W={j['world_size']} tensors={j['tensors']} keys={j['keys']}  {spread}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
