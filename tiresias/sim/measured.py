"""Measured jobs in the simulator: a Pollux workload's jobs run at their applications' measured
speeds and report their applications' measured loss curves (``tiresias.apps``).

A job's work is its application's steps to the epoch cap at the batch size its submitter
asked for (it completes there, as in Pollux's simulator); its speed at ``w`` GPUs, ``p``
aggregators and ``n`` nodes is the application's (``sync="pushpull"``: measured compute time
plus AutoPS's push/pull cost at ``p``; ``"measured"``: the measured step time, ``p`` ignored).
Under an allocation policy a job is elastic from 1 GPU to the most its data allows; under the
others it runs at the GPU count it asked for, with one aggregator per GPU.

The policies never read these tables: before every pass ``MeasuredWorkload.observe`` reports,
for each running job, the loss points its progress has passed and its speed where it runs
(what a live job reports through ``tiresias.job.report`` and AutoPS). A learning policy
(``learns``) also gets, when a job arrives, its speeds at a few short pre-runs
(``tiresias.optimus.speed.profile_configs``, Optimus §3.2), whose time is charged to the job
as a stall before its first run (in its JCT). The samples reach the policy at arrival, before
the pre-runs would have ended: a small head start the live system does not have.
``profile=False`` leaves the pre-runs out, as the live master does (a job is measured where it
runs; see ``tiresias.policies.elastic``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..apps.profiles import Application
from ..apps.workload import WorkloadJob
from ..cluster import ClusterSpec
from ..optimus.speed import profile_configs
from ..policies.base import JobState, Policy
from .engine import SimConfig, simulate
from .result import SimResult

PROFILE_RUNS = 5            # pre-runs per job (§6.1: 5 combinations of (p, w))
PROFILE_STEPS = 20          # steps each
PROFILE_SETUP_S = 5.0       # starting and stopping a pre-run
MAX_PROFILE_AGGREGATORS = 16


@dataclass(frozen=True)
class MeasuredTraceJob:
    """A workload job as the simulator's trace: its work in steps and its application."""
    job_id: int
    submit_time: float
    num_gpus: int                 # what its submitter asked for
    duration: float               # steps to the epoch cap
    application: str
    batch_size: int
    max_gpus: int


class MeasuredWorkload:
    """The jobs of a workload over measured applications, and their reports."""

    def __init__(self, workload: Sequence[WorkloadJob], apps: Mapping[str, Application], elastic: bool,
                 sync: str = "pushpull", gpus_per_node: int = 4, profile: bool = True) -> None:
        if sync not in ("pushpull", "measured"):
            raise ValueError(f"--sync must be 'pushpull' or 'measured', not {sync!r}")
        self.apps = apps
        self.elastic = elastic
        self.sync = sync
        self.per_node = gpus_per_node
        self.profile = profile
        self.trace: list[MeasuredTraceJob] = []
        for w in workload:
            app = apps.get(w.application)
            if app is None:
                raise ValueError(f"job {w.name}: no application {w.application!r} "
                                 f"(have {', '.join(sorted(apps))})")
            self.trace.append(MeasuredTraceJob(w.job_id, float(w.submit_time), int(w.num_replicas),
                                               float(app.total_steps(w.batch_size)), w.application,
                                               int(w.batch_size), app.max_gpus(w.batch_size)))
        self._by_id = {t.job_id: t for t in self.trace}
        self._curves = {t.job_id: apps[t.application].loss_curve(t.batch_size) for t in self.trace}
        self._reported: dict[int, int] = {}        # job id -> loss points reported so far

    def make_job(self, t: MeasuredTraceJob) -> JobState:
        app, batch, sync = self.apps[t.application], t.batch_size, self.sync

        def rate(gpus: int, aggregators: int, nodes: int) -> float:
            if sync == "measured":
                return 1.0 / app.step_time(gpus, batch, nodes)
            return app.speed(aggregators, gpus, batch, sync)

        job = JobState(t.job_id, t.num_gpus, t.submit_time, t.duration, wait_since=t.submit_time,
                       model=t.application, rate=rate, aggregators=t.num_gpus)
        if self.elastic:
            job.min_gpus, job.max_gpus = 1, t.max_gpus
        return job

    def true_speed(self, job: JobState, aggregators: int, gpus: int) -> float:
        return job.rate(gpus, aggregators, math.ceil(gpus / self.per_node))

    def observe(self, drv) -> None:
        """Before a pass: arrivals are described (and profiled, for a learning policy);
        running jobs report the loss points they passed and their speed."""
        policy = drv.policy
        if not getattr(policy, "allocates", False):
            return
        for job in policy.active.values():
            if job.job_id not in self._reported:
                self._arrived(policy, job)
        drv.settle_all()
        for job in drv.running.values():
            curve, done = self._curves[job.job_id], self._reported[job.job_id]
            while done < len(curve) and curve[done][0] <= job.executed + 1e-9:
                policy.observe_loss(job.job_id, *curve[done])
                done += 1
            self._reported[job.job_id] = done
            if job.stall <= 0.0:
                policy.observe_speed(job.job_id, job.aggregators, job.num_gpus, job.speed, step=job.executed)

    def _arrived(self, policy, job: JobState) -> None:
        t = self._by_id[job.job_id]
        self._reported[job.job_id] = 0
        policy.describe(job.job_id, batch=t.batch_size, cap_steps=t.duration)
        if not getattr(policy, "learns", False) or not self.profile:
            return
        top = (job.max_gpus or job.num_gpus)
        cost = 0.0
        for p, w in profile_configs(MAX_PROFILE_AGGREGATORS, top, PROFILE_RUNS, seed=job.job_id):
            f = self.true_speed(job, p, w)
            policy.observe_speed(job.job_id, p, w, f)
            cost += PROFILE_SETUP_S + PROFILE_STEPS / f
        job.stall += cost               # the pre-runs, before its first run
        job.overhead += cost


def simulate_workload(workload: Sequence[WorkloadJob], apps: Mapping[str, Application],
                      cluster: ClusterSpec | int, policy: Policy, config: SimConfig | None = None,
                      sync: str = "pushpull", profile: bool = True, **options) -> SimResult:
    """Simulate ``workload``'s measured jobs under ``policy`` (elastic under an allocation
    policy, at their asked GPU counts otherwise); ``options`` go to ``simulate``."""
    per_node = cluster.gpus_per_node if isinstance(cluster, ClusterSpec) else cluster
    measured = MeasuredWorkload(workload, apps, elastic=policy.allocates, sync=sync, gpus_per_node=per_node,
                                profile=profile)
    return simulate(measured.trace, cluster, policy, config=config, make_job=measured.make_job,
                    observe=measured.observe, **options)
