"""``make demo``'s Tiresias stage: four training jobs scheduled, preempted and resumed for real.

A Tiresias master runs on the local executor (2 emulated nodes x 2 GPUs, 2D-LAS with a small
queue threshold so that preemption shows within a minute), an AutoPS pool serves the jobs'
aggregation, and two Infiniswap daemons (emulated 512 MiB memory hosts, one per node)
report memory. Four ``examples/train_digits.py`` jobs of 1-4 GPUs arrive in a burst, each on
the shared AutoPS pool. The master preempts jobs by checkpoint (the job saves and exits when
asked) and resumes them, possibly on other GPUs. Prints the timeline as it happens, then per
job its JCT, preemptions and final test accuracy, and what the reports said.

    python examples/tiresias_demo.py [--threshold GPU_SECONDS] [--epochs N]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import socket
import sys
import tempfile
import time

from autops.local import LocalPool
from infiniswap.local import DaemonProcess
from tiresias.service.launch import LocalMaster

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_digits.py"
MiB = 1 << 20
# (name, GPUs, AutoPS mode, optimizer)
JOBS = [("digits-1g", 1, "sum", "sgd"), ("digits-2g", 2, "server", "adam"),
        ("digits-3g", 3, "sum", "sgd"), ("digits-4g", 4, "server", "adam")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follow(client, job_names: dict[int, str], t0: float, since: int) -> int:
    """Print new events as timeline lines; returns the last event id."""
    for e in client.get(f"/api/v1/events?since={since}&limit=500"):
        since = e["id"]
        if e["job_id"] is None or e["kind"] == "submitted":
            continue
        what = {"started": "started", "resumed": "resumed", "stopping": "asked to stop (checkpoint)",
                "preempted": "preempted", "finished": "finished", "failed": "FAILED", "sigterm": "SIGTERM",
                "sigkill": "SIGKILL", "lost": "lost"}.get(e["kind"], e["kind"])
        detail = e["detail"] if e["kind"] not in ("finished",) else ""
        print(f"{e['time'] - t0:7.1f} s  job {e['job_id']} {job_names.get(e['job_id'], ''):<10} {what:<27} {detail}",
              flush=True)
    return since


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threshold", type=float, default=25.0, help="2D-LAS queue threshold in GPU-seconds")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=420.0)
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="tiresias-demo-"))
    print(f"Tiresias demo: 4 train_digits.py jobs (1-4 GPUs) on 2 nodes x 2 GPUs, 2D-LAS with a "
          f"{args.threshold:g} GPU-s threshold, an AutoPS pool, 2 Infiniswap daemons", flush=True)
    reports = f"tcp://127.0.0.1:{free_port()}"
    pool = LocalPool(0, master_args=["--provider", "local", "--max-aggregators", "4", "--warmup-iters", "3",
                                     "--profile-iters", "10", "--period", "2", "--report-bind", reports,
                                     "--report-period", "0.5"])
    daemon_ports = [free_port(), free_port()]
    daemons = [DaemonProcess(slab_size=16 * MiB, capacity=512 * MiB, headroom=64 * MiB, period=0.2,
                             extra=["--reports", f"tcp://127.0.0.1:{p}", "--report-interval", "0.5",
                                    "--report-host", f"node{i}"]) for i, p in enumerate(daemon_ports)]
    master = LocalMaster(work / "state", "--nodes", "2x2", "--policy", "las", "--thresholds", str(args.threshold),
                         "--interval", "1", "--stop-grace", "30", "--autops-master", pool.master,
                         "--autops-reports", reports, "--infiniswap-reports",
                         *[f"tcp://127.0.0.1:{p}" for p in daemon_ports])
    failed = False
    try:
        pool.start()
        for d in daemons:
            d.start()
        master.start()
        client = master.client
        print(f"master {client.url} (dashboard: {client.url}/), pMaster {pool.master}\n", flush=True)
        names, ids = {}, []
        t0 = time.time()
        for name, gpus, mode, opt in JOBS:
            out = work / f"{name}.json"
            spec = {"gpus": gpus, "name": name, "launcher": "torchrun", "autops_aggregators": min(gpus, 2),
                    "command": [str(EXAMPLE), "--epochs", str(args.epochs), "--mode", mode, "--optimizer", opt,
                                "--json", str(out)], "env": {"OMP_NUM_THREADS": "1"}}
            job = client.post("/api/v1/jobs", spec)
            names[job["id"]] = name
            ids.append(job["id"])
        since = 0
        deadline = time.monotonic() + args.timeout
        while True:
            since = follow(client, names, t0, since)
            jobs = {j["id"]: j for j in client.get("/api/v1/jobs")}
            if all(jobs[i]["status"] in ("finished", "failed", "cancelled") for i in ids):
                break
            if time.monotonic() > deadline:
                print(f"demo: jobs still running after {args.timeout:g} s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        follow(client, names, t0, since)
        views = {i: client.get(f"/api/v1/jobs/{i}") for i in ids}
        nodes = client.get("/api/v1/nodes")
        print(f"\nall jobs done in {time.time() - t0:.1f} s\n")
        print(f"{'job':<10} {'gpus':>4} {'mode':<7} {'optimizer':<9} {'JCT (s)':>8} {'preempt':>7} "
              f"{'runs':>4} {'test acc':>9} {'skew':>6}  source")
        for i in ids:
            v = views[i]
            name, gpus, mode, opt = next(j for j in JOBS if j[0] == v["name"])
            result = work / f"{name}.json"
            acc = json.loads(result.read_text())["test_accuracy"] if result.exists() else float("nan")
            if v["status"] != "finished" or not acc >= 0.95:
                failed = True
            print(f"{name:<10} {gpus:>4} {mode:<7} {opt:<9} {v['jct'] or float('nan'):>8.1f} {v['preemptions']:>7} "
                  f"{len(v['runs']):>4} {acc:>9.4f} {v['skew']:>6.3f}  "
                  f"{'measured by AutoPS' if v['skew_measured'] else 'not reported'}")
        print("\nmemory the Infiniswap daemons reported, per node:")
        for n in nodes:
            mib = lambda v: "-" if v is None else f"{v / MiB:.0f} MiB"  # noqa: E731
            print(f"  {n['name']}: total {mib(n['memory_total_bytes'])}, free {mib(n['memory_free_bytes'])}, "
                  f"lent {mib(n['memory_lent_bytes'])}, lendable {mib(n['memory_lendable_bytes'])}")
        for i in ids:
            if views[i]["status"] != "finished":
                print(f"\njob {i} {views[i]['status']}: {views[i]['detail']}")
        return 1 if failed else 0
    finally:
        master.stop()
        for d in daemons:
            d.stop()
        pool.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
