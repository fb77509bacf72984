"""Two AutoPS training jobs on emulated hosts: workers and aggregators on different "machines".

Builds a testbed (``dlrt_bench.testbed``, root only) of four hosts joined by 1 Gbit/s links:
pMaster and aggregator agg-0 on h0, aggregator agg-1 on h1, and one training job per worker
host (``examples/train_digits.py`` under ``torchrun --nproc-per-node 2``: h2 runs a sum-mode
SGD job, h3 a server-side Adam job; each asks for one aggregator). Every process has its host's identity, so workers reach
the aggregators over TCP across the shaped links. Prints per job its throughput, accuracy and
aggregators, and the bytes each host sent and received over its link; then removes the
testbed. The cluster runs with a fresh key directory of its own, so every channel between
the hosts runs CURVE (docs/security.md).

    sudo python examples/autops_hosts_demo.py [--link 1gbit] [--epochs 2]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from autops.wire.jobauth import new_job_secret
from dlrt.keys import temporary_cluster
from dlrt_bench.testbed import Testbed, available
from dlrt_bench.autops_hosts import HostPool

EXAMPLE = pathlib.Path(__file__).resolve().parent / "train_digits.py"
JOBS = [("hosts-sgd", ["--mode", "sum", "--optimizer", "sgd"]),
        ("hosts-adam", ["--mode", "server", "--optimizer", "adam"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python examples/autops_hosts_demo.py", description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="1gbit", help="rate of every host's link (tc units; default 1gbit)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per job (default 2)")
    args = parser.parse_args(argv)
    why = available()
    if why:
        print(f"autops_hosts_demo: cannot build emulated hosts here: {why}", file=sys.stderr)
        return 1
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="autops-hosts-demo-"))
    try:
        # beyond loopback the cluster runs with its keys: a fresh key directory for this demo
        # (dlrt keys init makes the real one), so every channel runs CURVE
        with temporary_cluster() as keys, Testbed(2 + len(JOBS), link=args.link, prefix="apsdemo") as tb:
            agg_hosts, worker_hosts = tb.hosts[:2], tb.hosts[2:]
            print(f"testbed up: {len(tb.hosts)} hosts on {tb.subnet}, {args.link} links; "
                  f"CURVE keys in {keys}", flush=True)
            with HostPool(tb, agg_hosts) as pool:
                print(f"pool up: pMaster {pool.master} on {agg_hosts[0].name}; aggregators on "
                      f"{', '.join(h.name for h in agg_hosts)}", flush=True)
                before = {h.name: tb.counters(h) for h in tb.hosts}
                start = time.perf_counter()
                procs = []
                for (job, extra), host in zip(JOBS, worker_hosts):
                    env = host.env({"AUTOPS_MASTER": pool.master, "AUTOPS_JOB": job, "OMP_NUM_THREADS": "1",
                                    "AUTOPS_AGGREGATORS": "1", "AUTOPS_JOB_SECRET": new_job_secret()})
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLE), *extra, "--epochs", str(args.epochs),
                           "--json", str(out_dir / f"{job}.json")]
                    log = open(out_dir / f"{job}.log", "w")
                    procs.append((job, host, host.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
                    print(f"job {job}: 2 workers on {host.name} ({host.addr})", flush=True)
                failed = False
                for job, _, proc, log in procs:
                    rc = proc.wait()
                    log.close()
                    if rc != 0:
                        failed = True
                        print(f"job {job} failed (exit {rc}); its log:\n{(out_dir / f'{job}.log').read_text()}")
                elapsed = time.perf_counter() - start
                after = {h.name: tb.counters(h) for h in tb.hosts}
            if failed:
                return 1
            print(f"\nboth jobs finished in {elapsed:.1f} s\n")
            print(f"{'job':<11} {'host':<10} {'mode':<7} {'optimizer':<9} {'samples/s':>10} {'test acc':>9}  aggregators")
            for (job, _), host in zip(JOBS, worker_hosts):
                r = json.loads((out_dir / f"{job}.json").read_text())
                print(f"{job:<11} {host.name:<10} {r['mode']:<7} {r['optimizer']:<9} "
                      f"{r['samples_per_s'] * r['world_size']:>10.0f} {r['test_accuracy']:>9.4f}  "
                      f"{', '.join(r['aggregators'])}")
            print(f"\nbytes over each host's {args.link} link while the jobs trained:")
            for h in tb.hosts:
                sent = after[h.name].sent - before[h.name].sent
                received = after[h.name].received - before[h.name].received
                print(f"  {h.name:<10} {h.addr:<14} sent {sent / 2**20:8.1f} MiB  received {received / 2**20:8.1f} MiB")
        print("\ntestbed removed")
        return 0
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
