"""Benchmark of the live Tiresias master (local executor), with the simulator as its peer.

    python bench/tiresias_live.py --json bench/results/tiresias_live.json

1. submit -> running: 100 short jobs submitted one after the other onto free GPUs; the
   latency is the master's own record (``started - submitted``: the run's processes were
   started), p50 and p99, and until the worker's first step (Python start-up included).
   Goal <= 1 s.
2. stop request -> GPUs free: a running job is preempted by a higher-priority arrival; from
   the ``stopping`` event to the ``preempted`` one (GPUs released), next to the time the job
   itself spent saving. Goal <= checkpoint time + 1 s.
3. one scheduling pass with 1k and 10k queued jobs, in process, durable writes included
   (each measured pass ends one running job and starts a waiting one). Goal <= 10 ms at 10k.
4. live vs simulator: a 30-job trace compressed in time (5-60 s jobs, 1-4 GPUs), run live on
   2x4 with workers that honour preemption, then simulated with the same policy and the
   overheads the live run measured (per-resume cost = mean stop time + mean restart time).
   Goal: average JCT within 10%.
5. elastic: ``--policy optimus`` on 1x4 with a pMaster pool, four ``train_digits.py
   --global-batch 64`` jobs submitted with ``--gpus 1-4 --autops-aggregators 1`` 15 s apart;
   counts the worker-count changes (``elastic_resizes``, by stop and restart) and the live
   aggregator changes, the lowest test accuracy (``elastic_min_test_acc``), and simulates the
   same trace with the same policy over what the jobs measured live (steps per second at each
   GPU count, loss points, start, end and restart costs; no pre-runs, as live; each step
   also sleeps ``--elastic-gpu`` / world s, an emulated GPU, so that speeds scale with GPUs):
   ``elastic_live_vs_sim`` is live over simulated average JCT (goal within 10%).

Prints one JSON object; ``--json FILE`` writes it too.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiresias.cluster import ClusterSpec  # noqa: E402
from tiresias.policies import make_policy  # noqa: E402
from tiresias.service.executor import NodeInfo, RunEnd  # noqa: E402
from tiresias.service.launch import LocalMaster  # noqa: E402
from tiresias.service.master import Master, MasterConfig  # noqa: E402
from tiresias.service.reports import ReportFeed  # noqa: E402
from tiresias.sim import SimConfig, simulate  # noqa: E402
from tiresias.apps.workload import WorkloadJob  # noqa: E402
from tiresias.sim.measured import simulate_workload  # noqa: E402

WORKER = ROOT / "bench" / "tiresias_worker.py"


def worker(work: float, *flags: str) -> list[str]:
    return [sys.executable, str(WORKER), f"{work:g}", *flags]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def wait(client, job_ids, statuses=("finished",), timeout=600.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = {j["id"]: j for j in client.get("/api/v1/jobs")}
        if all(jobs[i]["status"] in statuses for i in job_ids):
            return [jobs[i] for i in job_ids]
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not {statuses} after {timeout} s")
        time.sleep(0.2)


def submit(client, gpus: int, command: list[str], name: str) -> int:
    return client.post("/api/v1/jobs", {"gpus": gpus, "command": command, "name": name, "launcher": "plain"})["id"]


# --- 1 -------------------------------------------------------------------------------------------
def bench_submit(tmp: pathlib.Path, jobs: int, gap: float) -> dict:
    with LocalMaster(tmp / "submit", "--nodes", "8x8", "--interval", "5") as m:
        c = m.client
        ids = []
        for i in range(jobs):
            ids.append(submit(c, 1, worker(0.5), f"short{i}"))
            time.sleep(gap)                            # each start is two Python processes on 2 cores
        done = wait(c, ids)
        working = []
        for j in done:                                 # the worker's own record: when it began work
            record = json.loads((m.state / "checkpoints" / str(j["id"]) / "checkpoint" / "runs.jsonl")
                                .read_text().splitlines()[0])
            working.append(record["working"] - j["submitted"])
    lat = [j["started"] - j["submitted"] for j in done]
    return {"submit_to_running_p50_s": percentile(lat, 50), "submit_to_running_p99_s": percentile(lat, 99),
            "submit_to_first_step_p50_s": percentile(working, 50),
            "submit_to_first_step_p99_s": percentile(working, 99), "submit_jobs": jobs, "submit_gap_s": gap}


# --- 2 -------------------------------------------------------------------------------------------
def bench_stop(tmp: pathlib.Path, rounds: int, ckpt: float) -> dict:
    stops, saves = [], []
    with LocalMaster(tmp / "stop", "--nodes", "1x2", "--interval", "5", "--thresholds", "2",
                     "--stop-grace", "30") as m:
        c = m.client
        for i in range(rounds):
            long_ = submit(c, 2, worker(600, "--ckpt-seconds", str(ckpt)), f"long{i}")
            wait(c, [long_], ("running",))
            while c.get(f"/api/v1/jobs/{long_}")["queue"] < 1:     # past its threshold: lower priority
                time.sleep(0.1)
            short = submit(c, 2, worker(0.2), f"short{i}")
            wait(c, [short])
            events = c.get(f"/api/v1/events?job={long_}")
            asked = next(e["time"] for e in events if e["kind"] == "stopping")
            freed = next(e["time"] for e in events if e["kind"] == "preempted")
            stops.append(freed - asked)
            runs = [json.loads(x) for x in (m.state / "checkpoints" / str(long_) / "checkpoint" / "runs.jsonl")
                    .read_text().splitlines()]
            saves.append(runs[0]["saved"] - runs[0]["stop_seen"])
            c.post(f"/api/v1/jobs/{long_}/cancel")
            wait(c, [long_], ("cancelled",))
    return {"stop_to_free_p50_s": statistics.median(stops), "stop_to_free_max_s": max(stops),
            "checkpoint_s": statistics.median(saves), "stop_rounds": rounds}


# --- 3 -------------------------------------------------------------------------------------------
class NullExecutor:
    """Launches nothing; ``finish`` ends one run at the next poll."""
    name = "null"

    def __init__(self, nodes: int, gpus: int) -> None:
        self._nodes = [NodeInfo(f"node{i}", gpus) for i in range(nodes)]
        self.running: list[tuple[int, int]] = []
        self.ended: list[RunEnd] = []

    def nodes(self):
        return self._nodes

    def launch(self, spec):
        self.running.append((spec.job_id, spec.run))
        return {"null": True}

    def terminate(self, *a, **k):
        pass

    def finish_one(self) -> None:
        job_id, run = self.running.pop(0)
        self.ended.append(RunEnd(job_id, run, 0))

    def poll(self):
        out, self.ended = self.ended, []
        return out

    def reconcile(self, runs):
        return []

    def close(self):
        pass


def bench_pass(tmp: pathlib.Path, queued: int, passes: int = 30) -> float:
    ex = NullExecutor(2, 4)
    m = Master(MasterConfig(str(tmp / f"pass{queued}"), interval=3600), ex, reports=ReportFeed())
    rng = random.Random(queued)
    for i in range(queued + 8):
        m.submit({"gpus": rng.choice([1, 1, 2, 4]), "command": ["x"], "name": f"q{i}", "workdir": "/"})
    m.tick()                                           # fills the cluster
    times = []
    for _ in range(passes):
        ex.finish_one()
        t0 = time.perf_counter()
        m.tick()                                       # one job ends, the next starts: rows and events written
        times.append(time.perf_counter() - t0)
    m.close()
    return statistics.median(times) * 1e3


# --- 4 -------------------------------------------------------------------------------------------
def make_trace(n: int, seed: int, spread: float) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i in range(n):
        jobs.append(SimpleNamespace(job_id=i, submit_time=round(t, 1), num_gpus=rng.choice([1, 1, 2, 2, 4]),
                                    duration=float(rng.randint(5, 60))))
        t += rng.expovariate(n / spread)
    return jobs


def _record_of(records: list[dict], placement: dict) -> dict | None:
    """The worker's record of a run: the one that began working within the run's lifetime."""
    end = placement["ended"] if placement["ended"] is not None else float("inf")
    for record in records:
        if placement["started"] <= record["started"] <= end:
            return record
    return None


def bench_live_vs_sim(tmp: pathlib.Path, n: int, seed: int, threshold: float, ckpt: float) -> dict:
    trace = make_trace(n, seed, spread=90.0)
    args = ("--nodes", "2x4", "--interval", "1", "--thresholds", str(threshold), "--stop-grace", "20")
    with LocalMaster(tmp / "trace", *args) as m:
        c = m.client
        t0 = time.time()
        ids = {}
        for tj in trace:
            delay = t0 + tj.submit_time - time.time()
            if delay > 0:
                time.sleep(delay)
            ids[submit(c, tj.num_gpus, worker(tj.duration, "--ckpt-seconds", str(ckpt)), f"t{tj.job_id}")] = tj
        done = wait(c, list(ids), timeout=1800)
        stop_times, restart_times, starts = [], [], []
        for job in done:
            runs_file = m.state / "checkpoints" / str(job["id"]) / "checkpoint" / "runs.jsonl"
            records = [json.loads(x) for x in runs_file.read_text().splitlines()]
            for placement in c.get(f"/api/v1/jobs/{job['id']}")["runs"]:
                record = _record_of(records, placement)
                if record is None:
                    continue                           # a run killed before it could write its record
                (restart_times if placement["run"] > 1 else starts).append(record["working"] - placement["started"])
                if "stop_seen" in record:
                    stop_times.append(placement["ended"] - record["stop_seen"])
    live = [j["ended"] - j["submitted"] for j in done]
    start_cost = statistics.mean(starts)
    resume_cost = (statistics.mean(stop_times) if stop_times else 0.0) + \
                  (statistics.mean(restart_times) if restart_times else start_cost)
    sim_trace = [SimpleNamespace(job_id=t.job_id, submit_time=t.submit_time, num_gpus=t.num_gpus,
                                 duration=t.duration + start_cost) for t in trace]
    config = SimConfig("tiresias", overheads=True, slowdown=False, preemption_cost=resume_cost)
    result = simulate(sim_trace, ClusterSpec(2, 4), make_policy("las", thresholds=(threshold,)), config=config)
    sim = [j.end_time - j.submit_time for j in result.jobs]
    return {"live_avg_jct": statistics.mean(live), "sim_avg_jct": statistics.mean(sim),
            "live_vs_sim": statistics.mean(live) / statistics.mean(sim),
            "live_median_jct": statistics.median(live), "sim_median_jct": statistics.median(sim),
            "live_preemptions": sum(j["preemptions"] for j in done), "sim_preemptions": result.preemptions,
            "measured_start_s": start_cost, "measured_resume_cost_s": resume_cost, "trace_jobs": n,
            "threshold_gpu_s": threshold}


# --- 5 -------------------------------------------------------------------------------------------
DIGITS = ROOT / "examples" / "train_digits.py"
DIGITS_STEPS_PER_EPOCH = 1347 // 64          # 1347 training samples, global batch 64
# every run, first or resumed, at least this long before a round may resize it, live and simulated
# alike (the default guarantee protects by resume cost: measured in the simulator, modelled live)
ELASTIC_MIN_RUN = 20.0


class LiveApp:
    """What the elastic jobs measured live, in the shape the simulator's measured jobs read
    (``tiresias.apps.profiles.Application``): steps per second at each GPU count (linear from
    the nearest measured count elsewhere), the loss points reported, the steps to the end."""

    def __init__(self, speeds: dict[int, list[float]], losses: list[tuple[float, float]], steps: int,
                 max_gpus: int) -> None:
        self.speeds = {w: statistics.mean(v) for w, v in speeds.items() if v}
        self.losses, self.steps, self.top = sorted(losses), steps, max_gpus

    def total_steps(self, batch_size: int) -> int:
        return self.steps

    def max_gpus(self, batch_size: int) -> int:
        return self.top

    def loss_curve(self, batch_size: int) -> list[tuple[float, float]]:
        return self.losses

    def step_time(self, gpus: int, batch_size: int, nodes: int | None = None) -> float:
        if gpus in self.speeds:
            return 1.0 / self.speeds[gpus]
        near = min(self.speeds, key=lambda w: (abs(w - gpus), w))
        return near / (gpus * self.speeds[near])


def _progress_lines(state: pathlib.Path, job_id: int) -> list[tuple[float, float, float]]:
    path = state / "checkpoints" / str(job_id) / "control" / "progress"
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((float(parts[0]), float(parts[1]), float(parts[2])))
    return out


def _run_measures(lines, runs) -> tuple[dict[int, list[float]], list[float], list[float]]:
    """Per run: its training speed (steps/s between its first and last report) and the seconds
    from its start to its first report; for the job's last run, from its last report to its end
    (the final evaluation and the exit)."""
    speeds: dict[int, list[float]] = {}
    starts, ends = [], []
    for run in runs:
        end = run["ended"] if run["ended"] is not None else float("inf")
        mine = [(t, s) for t, s, _ in lines if run["started"] <= t <= end]
        if len(mine) >= 2 and mine[-1][0] > mine[0][0]:
            speeds.setdefault(run["gpus"], []).append((mine[-1][1] - mine[0][1]) / (mine[-1][0] - mine[0][0]))
        if mine:
            starts.append(mine[0][0] - run["started"])
            if run is runs[-1] and run["ended"] is not None:
                ends.append(run["ended"] - mine[-1][0])
    return speeds, starts, ends


def bench_elastic(tmp: pathlib.Path, jobs: int, epochs: int, gap: float, round_s: float, gpu_s: float) -> dict:
    from autops.local import LocalPool
    pool = LocalPool(4, master_args=["--static"])
    pool.start()
    try:
        args = ("--nodes", "1x4", "--interval", "0.5", "--policy", "optimus", "--round-interval", str(round_s),
                "--stop-grace", "60", "--autops-master", pool.master,
                "--min-run-factor", "0", "--min-run", str(ELASTIC_MIN_RUN))
        with LocalMaster(tmp / "elastic", *args, env={**os.environ, "OMP_NUM_THREADS": "1"}) as m:
            c = m.client
            t0 = time.time()
            ids = []
            for i in range(jobs):
                delay = t0 + i * gap - time.time()
                if delay > 0:
                    time.sleep(delay)
                ids.append(c.post("/api/v1/jobs", {
                    "gpus": 4, "min_gpus": 1, "autops_aggregators": 1, "name": f"digits{i}", "launcher": "torchrun",
                    "command": [sys.executable, str(DIGITS), "--global-batch", "64", "--epochs", str(epochs),
                                "--emulate-gpu", str(gpu_s)]})["id"])
            done = wait(c, ids, timeout=1500)
            views = [c.get(f"/api/v1/jobs/{j}") for j in ids]
            events = [e for j in ids for e in c.get(f"/api/v1/events?job={j}&limit=1000")]
            accuracies = []
            for j in ids:
                text = (m.state / "jobs" / str(j) / "job.log").read_text()
                found = [float(x.split()[2]) for x in text.splitlines() if x.startswith("test accuracy ")]
                accuracies.append(found[-1] if found else 0.0)
            measured = [(_progress_lines(m.state, j), v["runs"]) for j, v in zip(ids, views)]
    finally:
        pool.stop()
    resizes = sum(1 for v in views for a, b in zip(v["runs"], v["runs"][1:]) if a["gpus"] != b["gpus"])
    live = [j["ended"] - j["submitted"] for j in done]
    speeds: dict[int, list[float]] = {}
    starts: list[float] = []
    ends: list[float] = []
    for lines, runs in measured:
        sp, st, en = _run_measures(lines, runs)
        for w, v in sp.items():
            speeds.setdefault(w, []).extend(v)
        starts += st
        ends += en
    stop_costs = [e2["time"] - e1["time"] for e1, e2 in zip(events, events[1:])
                  if e1["kind"] == "stopping" and e2["kind"] == "preempted" and e1["job_id"] == e2["job_id"]]
    start_cost = statistics.mean(starts)
    resume_cost = start_cost + (statistics.mean(stop_costs) if stop_costs else 0.0)
    end_cost = statistics.mean(ends) if ends else 0.0
    losses = [(s, l) for s, l in {s: l for _, s, l in measured[0][0]}.items()][::20]
    app = LiveApp(speeds, losses, epochs * DIGITS_STEPS_PER_EPOCH, 4)
    workload = [WorkloadJob(i, f"digits{i}", (v["submitted"] - views[0]["submitted"]), "digits", 1, 64)
                for i, v in enumerate(views)]
    config = SimConfig("tiresias", overheads=True, slowdown=False, preemption_cost=resume_cost,
                       start_cost=start_cost + end_cost,      # a job's one-time costs: starting and ending
                       min_run_factor=0.0, min_run=ELASTIC_MIN_RUN)    # the live master's guarantee
    result = simulate_workload(workload, {"digits": app}, ClusterSpec(1, 4), make_policy("optimus", interval=round_s),
                               config=config, sync="measured", profile=False)
    sim = [j.end_time - j.submit_time for j in result.jobs]
    return {"elastic_jobs": jobs, "elastic_epochs": epochs, "elastic_round_s": round_s, "elastic_emulated_gpu_s": gpu_s,
            "elastic_resizes": resizes, "elastic_aggregator_changes": sum(e["kind"] == "aggregators" for e in events),
            "elastic_runs_gpus": [[r["gpus"] for r in v["runs"]] for v in views],
            "elastic_runs_aggregators": [[r["aggregators"] for r in v["runs"]] for v in views],
            "elastic_min_test_acc": min(accuracies), "elastic_live_avg_jct": statistics.mean(live),
            "elastic_sim_avg_jct": statistics.mean(sim), "elastic_live_vs_sim": statistics.mean(live) / statistics.mean(sim),
            "elastic_sim_resizes": result.preemptions, "elastic_live_jct": live, "elastic_sim_jct": sim,
            "elastic_live_wait_s": [v["runs"][0]["started"] - v["submitted"] for v in views],
            "elastic_sim_wait_s": [j.first_start - j.submit_time for j in result.jobs], "elastic_steps_per_s_by_gpus": app.speeds,
            "elastic_start_s": start_cost, "elastic_end_s": end_cost, "elastic_resume_cost_s": resume_cost}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--jobs", type=int, default=100, help="short jobs for the submit latency")
    ap.add_argument("--submit-gap", type=float, default=0.25, help="seconds between the short jobs' submissions")
    ap.add_argument("--stop-rounds", type=int, default=5)
    ap.add_argument("--ckpt-seconds", type=float, default=0.5, help="what the workers spend saving")
    ap.add_argument("--trace-jobs", type=int, default=30)
    ap.add_argument("--threshold", type=float, default=60.0, help="2D-LAS queue threshold (GPU-s) of the trace run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--elastic-jobs", type=int, default=4)
    ap.add_argument("--elastic-epochs", type=int, default=40)
    ap.add_argument("--elastic-gap", type=float, default=15.0, help="seconds between the elastic jobs' submits")
    ap.add_argument("--elastic-round", type=float, default=5.0, help="optimus's round interval in the elastic part")
    ap.add_argument("--elastic-gpu", type=float, default=0.05,
                    help="train_digits --emulate-gpu: seconds a step's batch takes on one emulated GPU")
    ap.add_argument("--only-elastic", action="store_true", help="run part 5 alone")
    args = ap.parse_args()
    # stopped by a timeout: unwind, so that the masters, pools and jobs it started are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out: dict = {"machine_cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="tiresias-bench-") as d:
        tmp = pathlib.Path(d)
        if args.only_elastic:
            out.update(bench_elastic(tmp, args.elastic_jobs, args.elastic_epochs, args.elastic_gap, args.elastic_round,
                                  args.elastic_gpu))
        else:
            _all_parts(tmp, args, out)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    return 0


def _all_parts(tmp: pathlib.Path, args, out: dict) -> None:
    """Parts 1-5, each printed as it ends."""
    out.update(bench_submit(tmp, args.jobs, args.submit_gap))
    print(json.dumps(out), flush=True)
    out.update(bench_stop(tmp, args.stop_rounds, args.ckpt_seconds))
    print(json.dumps(out), flush=True)
    out["pass_ms_1k"] = bench_pass(tmp, 1000)
    out["pass_ms_10k"] = bench_pass(tmp, 10000)
    print(json.dumps(out), flush=True)
    if not args.skip_trace:
        out.update(bench_live_vs_sim(tmp, args.trace_jobs, args.seed, args.threshold, args.ckpt_seconds))
        print(json.dumps(out), flush=True)
    out.update(bench_elastic(tmp, args.elastic_jobs, args.elastic_epochs, args.elastic_gap, args.elastic_round,
                                  args.elastic_gpu))


if __name__ == "__main__":
    sys.exit(main())
