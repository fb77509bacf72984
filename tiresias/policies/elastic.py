"""Allocation policies: every ``interval`` seconds they decide how many workers (GPUs) and
aggregators each active job runs with, instead of ordering jobs at fixed sizes.

* ``optimus``: Optimus's marginal-gain allocation (§4.1, eq. (9)) over models fitted online
  to what each job reports: its loss points (eq. (1), ``tiresias.optimus.convergence``) and
  its measured speeds (eq. (4), ``tiresias.optimus.speed``);
* ``optimus-oracle``: the same allocation given each job's true remaining steps and speeds
  (the paper's error-free case, Pollux's "Optimus+Oracle");
* ``drf`` and ``tetris``: the paper's baselines (§6.1), one aggregator per worker; Tetris
  reads the same fitted models as Optimus, as in the paper.

The driver (``Driver._schedule_allocations``) applies a round: a running job whose GPU count
changes is stopped by checkpoint and restarted at the new count; one whose aggregator count
alone changes keeps running (AutoPS moves its keys live); a job given nothing waits. Between
rounds nothing changes, so an arrival waits for the next round (§4). A job with a fixed GPU
count (no range) keeps it under every policy.

What the policies know of a job (``JobModel``) comes only from reports: ``describe`` (its
global batch and epoch cap in steps, known at submission), ``observe_loss`` and
``observe_speed`` (the simulator feeds them from the measured curves; live, the job's
``tiresias.job.report`` and AutoPS's iteration times). Until a job has reported three loss
points its remaining steps are taken to be what is left to its cap; until it has a measured
speed, a job gets its minimum (nothing says more would help). Live there are no pre-runs, so
a job's own runs are its samples: a job measured at one worker count only is taken to scale
linearly from it (optimism that gets it tried at more GPUs, where its next measurement
corrects the fit), and a learning policy gives a running job measured at one aggregator count
only one more from the CPUs a round left free (``_explore_aggregators``: a live change, no
restart). A job whose run the AutoPS pool refused asks for one aggregator fewer from then on
(``refused_aggregators``). In the simulator the pre-runs cover two worker and two aggregator
counts, so neither rule fires there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ..optimus.allocation import AllocJob, Demand, allocate_marginal_gain
from ..optimus.baselines import allocate_drf, allocate_tetris
from ..optimus.completion_rate import RateJob, allocate_completion_rate
from ..optimus.estimate_error import error_factor, error_signs
from ..optimus.convergence import fit_convergence
from ..optimus.speed import SpeedModel, fit_speed
from ..overheads import preemption_cost
from .base import INF, JobState, Policy

DEFAULT_INTERVAL = 600.0        # the paper's 10-minute scheduling interval
DEFAULT_DELTA = 0.05            # converged within 5% of the total improvement
YOUNG_FACTOR = 0.95             # §4.1: a job's gain while its models are young
YOUNG_POINTS = 3                # loss points before a job's models count as grown up
MAX_AGGREGATORS = 16
WORKER = Demand(workers={"gpu": 1.0}, aggregators={"cpu": 1.0})


@dataclass
class JobModel:
    """What a policy has learnt about one job from its reports."""
    batch: float | None = None            # global batch (eq. (4)'s M)
    cap_steps: float | None = None        # the epoch cap, in steps
    delta: float = DEFAULT_DELTA          # converged within this fraction of the total improvement
    max_aggregators: int | None = None    # live: fewer than the pool refused to give it
    step: float = 0.0                     # the last step reported
    losses: dict[float, float] = field(default_factory=dict)      # step -> loss
    speeds: dict[tuple[int, int], float] = field(default_factory=dict)   # (p, w) -> steps/s
    _speed_fit: tuple[int, SpeedModel | None] = (-1, None)

    @property
    def young(self) -> bool:
        return len(self.losses) < YOUNG_POINTS

    def remaining_steps(self, delta: float | None = None) -> float:
        """Q_j: steps to convergence (eq. (1)) or to the epoch cap, whichever comes first."""
        delta = self.delta if delta is None else delta
        cap = self.cap_steps
        fit = fit_convergence(sorted(self.losses.items())) if len(self.losses) >= YOUNG_POINTS else None
        if fit is not None:
            return fit.remaining_steps(self.step, delta, cap)
        if cap is not None:
            return max(0.0, cap - self.step)
        return max(1.0, self.step)          # nothing known: as much again as done so far

    def speed_model(self) -> SpeedModel | None:
        """eq. (4) fitted to the measured speeds (refitted when a sample is added)."""
        count, model = self._speed_fit
        if count != len(self.speeds):
            samples = [(p, w, f) for (p, w), f in sorted(self.speeds.items()) if f > 0]
            if len({w for _, w, _ in samples}) == 1:          # one worker count: linear from it
                model = LinearInWorkers(fit_speed(samples, sync=True, batch=self.batch), samples[0][1])
            else:
                model = fit_speed(samples, sync=True, batch=self.batch) if samples else None
            self._speed_fit = (len(self.speeds), model)
        return model

    def fitted(self) -> dict:
        """The model's state as plain data (the job's view): what was learnt, what it predicts."""
        model = self.speed_model()
        return {"loss_points": len(self.losses), "speed_samples": len(self.speeds), "young": self.young,
                "remaining_steps": self.remaining_steps(), "delta": self.delta,
                "speed_theta": list(model.theta) if model is not None else None}


class AllocationPolicy(Policy):
    """Rounds of GPU and aggregator counts; subclasses say how a round is decided."""

    allocates = True
    learns = False                  # reads fitted models (the simulator profiles its jobs)
    static_running_keys = False
    reads_running_progress = True

    def __init__(self, interval: float = DEFAULT_INTERVAL, max_aggregators: int = MAX_AGGREGATORS) -> None:
        super().__init__()
        if not interval > 0:
            raise ValueError(f"--interval must be > 0 seconds, got {interval}")
        self.interval = float(interval)
        self.max_aggregators = max_aggregators
        self.next_round = -INF
        self.models: dict[int, JobModel] = {}

    def key(self, job: JobState, now: float) -> tuple:
        return (job.submit_time, job.job_id)

    # --- reports ----------------------------------------------------------------------
    def model(self, job_id: int) -> JobModel:
        m = self.models.get(job_id)
        if m is None:
            m = self.models[job_id] = JobModel()
        return m

    def describe(self, job_id: int, batch: float | None = None, cap_steps: float | None = None,
                 delta: float | None = None) -> None:
        m = self.model(job_id)
        m.batch, m.cap_steps = batch, cap_steps
        if delta is not None:
            m.delta = float(delta)

    def observe_loss(self, job_id: int, step: float, loss: float) -> None:
        m = self.model(job_id)
        m.losses[float(step)] = float(loss)
        m.step = max(m.step, float(step))

    def observe_speed(self, job_id: int, aggregators: int, gpus: int, steps_per_s: float,
                      step: float | None = None) -> None:
        m = self.model(job_id)
        m.speeds[(int(aggregators), int(gpus))] = float(steps_per_s)
        if step is not None:
            m.step = max(m.step, float(step))

    def remove(self, job: JobState, now: float) -> None:
        super().remove(job, now)
        self.models.pop(job.job_id, None)

    # --- rounds -----------------------------------------------------------------------
    def next_change(self, running: Iterable[JobState], now: float) -> float:
        if not self.active:
            return INF
        return self.next_round if self.next_round > now else now

    def allocations(self, now: float, capacity: Mapping[str, float], per_node: int,
                    keep: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]] | None:
        """``{job id: (GPUs, aggregators)}`` for every active job at a round (a job left out
        gets nothing); None between rounds. ``keep``: jobs whose counts must stay (the
        progress guarantee), their resources already taken from ``capacity``."""
        if now < self.next_round:
            return None
        self.next_round = now + self.interval
        jobs = sorted((j for j in self.active.values() if j.job_id not in keep),
                      key=lambda j: (j.submit_time, j.job_id))
        out = self.decide([self._alloc_job(j, per_node) for j in jobs], dict(capacity))
        spare = capacity.get("cpu", 0.0) - sum(p for _, p in out.values())
        out.update(keep)
        if self.learns:
            self._explore_aggregators(out, spare)
        return out

    def _explore_aggregators(self, out: dict[int, tuple[int, int]], spare: float) -> None:
        """A running job measured at one aggregator count only (live: no pre-runs) gets one more
        from the ``spare`` CPUs the round left free, protected jobs too: an aggregator change is
        live and costs no restart, and its measurement tells the fit what they are worth."""
        for job_id in sorted(out):
            if spare < 1:
                return
            w, p = out[job_id]
            job, m = self.active.get(job_id), self.models.get(job_id)
            if job is None or m is None or not job.running or w != job.num_gpus or p != job.aggregators \
                    or (p, w) not in m.speeds or p >= self.aggregator_cap(job_id) or len({q for q, _ in m.speeds}) > 1:
                continue                  # measured where it runs now, and at no other aggregator count
            out[job_id] = (w, p + 1)
            spare -= 1

    def decide(self, jobs: list[AllocJob], capacity: dict[str, float]) -> dict[int, tuple[int, int]]:
        """``{job id: (GPUs, aggregators)}`` for ``jobs`` within ``capacity`` (what a policy defines)."""
        raise NotImplementedError(f"{type(self).__name__} does not define decide()")

    def _alloc_job(self, job: JobState, per_node: int) -> AllocJob:
        lo = job.min_gpus or job.num_gpus
        hi = job.max_gpus or job.num_gpus
        remaining, speed = self.estimate(job, per_node)
        return AllocJob(job.job_id, remaining, speed, WORKER, min_workers=lo, max_workers=hi,
                        max_aggregators=self.aggregator_cap(job.job_id), young=self.model(job.job_id).young)

    def aggregator_cap(self, job_id: int) -> int:
        cap = self.model(job_id).max_aggregators
        return self.max_aggregators if cap is None else min(cap, self.max_aggregators)

    def refused_aggregators(self, job_id: int, asked: int) -> None:
        """Live: the AutoPS pool would not give the job ``asked`` aggregators; ask for fewer."""
        if asked > 1:
            m = self.model(job_id)
            m.max_aggregators = min(m.max_aggregators or asked, asked - 1)

    def estimate(self, job: JobState, per_node: int):
        """(Q_j, f(p, w)) from the job's reports."""
        m = self.model(job.job_id)
        model = m.speed_model()
        speed = model.speed if model is not None else _flat
        return m.remaining_steps(), speed


@dataclass(frozen=True)
class LinearInWorkers:
    """A job measured at one worker count ``w0``: eq. (4) fitted there (its dependence on the
    aggregators), taken to scale linearly in the workers from it."""
    base: SpeedModel
    w0: int

    @property
    def theta(self) -> tuple[float, ...]:
        return self.base.theta

    def speed(self, p: int, w: int) -> float:
        return self.base.speed(p, self.w0) * w / self.w0 if w > 0 else 0.0


def _flat(p: int, w: int) -> float:
    return 1.0


class Optimus(AllocationPolicy):
    name = "optimus"
    learns = True

    def __init__(self, interval: float = DEFAULT_INTERVAL, young_factor: float = YOUNG_FACTOR,
                 max_aggregators: int = MAX_AGGREGATORS) -> None:
        super().__init__(interval, max_aggregators)
        self.young_factor = young_factor

    def decide(self, jobs, capacity):
        return allocate_marginal_gain(jobs, capacity, self.young_factor)


class OptimusOracle(Optimus):
    """Optimus given each job's true remaining steps and speed (``JobState.duration``,
    ``executed`` and ``rate``), like SRTF reading the oracle duration."""

    name = "optimus-oracle"
    learns = False

    def __init__(self, interval: float = DEFAULT_INTERVAL, max_aggregators: int = MAX_AGGREGATORS) -> None:
        super().__init__(interval, 1.0, max_aggregators)

    def estimate(self, job: JobState, per_node: int):
        if job.rate is None or job.duration is None:
            return super().estimate(job, per_node)
        rate = job.rate
        return max(0.0, job.duration - job.executed), lambda p, w: rate(w, p, math.ceil(w / per_node))


class DRF(AllocationPolicy):
    name = "drf"

    def decide(self, jobs, capacity):
        return allocate_drf(jobs, capacity)


class Tetris(AllocationPolicy):
    name = "tetris"
    learns = True

    def decide(self, jobs, capacity):
        return allocate_tetris(jobs, capacity)


DEFAULT_HORIZON = 600.0        # seconds a resize is meant to last (elastic-srpt's churn guard)


class ElasticSRPT(AllocationPolicy):
    """Shortest remaining time first over elastic jobs: maximise the rate at which jobs finish.

    Design (``tiresias.optimus.completion_rate``), and why:

    * **Gain = Δf / Q.** A GPU (with its aggregator) goes to the job whose completion rate
      ``f(p, w) / Q`` it raises the most, ``Q`` its fitted remaining steps and ``f`` its fitted
      speed. For average JCT a speed-up is worth more on a job that is nearly done; eq. (9)'s
      gain, the time saved ``Q·Δ(1/f)``, grows with ``Q`` and so hands the spare GPUs to the
      longest jobs, which is why ``optimus`` loses to ``drf`` on average JCT here. The first GPU
      of a waiting job is worth ``f(1) / Q``: short jobs start first (SRPT), then the GPUs go
      where they scale best relative to what is left.
    * **Rounds at arrivals and completions** (``event_rounds``), not only every ``interval``: a
      job arriving or GPUs freed by a finished job wait for nothing (with a 10-minute interval an
      arrival waits 5 minutes on average, and freed GPUs idle as long).
    * **A resize must pay for its restart.** A running job's rate at any GPU count but its current
      one is charged the restart (``tiresias.overheads.preemption_cost``, what the runtime charges)
      over ``min(horizon, its remaining time)``: frequent rounds cause no churn for small gains.
      Aggregator changes are live and free.

    It reads only reports: ``JobModel``'s remaining steps and fitted speed, with Optimus's pre-runs
    (``learns``: their cost is in the JCT), never a job's true duration, progress or rate."""

    name = "elastic-srpt"
    learns = True

    def __init__(self, interval: float = DEFAULT_INTERVAL, max_aggregators: int = MAX_AGGREGATORS,
                 horizon: float = DEFAULT_HORIZON, event_rounds: bool = True) -> None:
        super().__init__(interval, max_aggregators)
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
        self.horizon = float(horizon)
        self.event_rounds = event_rounds

    def add(self, job: JobState, now: float) -> None:
        super().add(job, now)
        self._round_now(now)

    def remove(self, job: JobState, now: float) -> None:
        super().remove(job, now)
        self._round_now(now)

    def _round_now(self, now: float) -> None:
        if self.event_rounds:
            self.next_round = min(self.next_round, now)

    def decide(self, jobs, capacity):
        return allocate_completion_rate([self._rate_job(a) for a in jobs], capacity.get("gpu", 0.0),
                                        capacity.get("cpu", 0.0))

    def _rate_job(self, alloc: AllocJob) -> RateJob:
        job = self.active[alloc.job_id]
        current = job.num_gpus if job.running else 0
        fraction = 0.0
        if current > 0:
            speed = alloc.speed(max(1, job.aggregators), current)
            left = alloc.remaining / speed if speed > 0 else INF
            fraction = preemption_cost(job.model, current) / max(1.0, min(self.horizon, left))
        return RateJob(alloc.job_id, alloc.remaining, alloc.speed, alloc.min_workers, alloc.max_workers,
                       alloc.max_aggregators, current, fraction)


class OptimusNoisy(OptimusOracle):
    """``optimus-oracle`` with errors in its estimates (§6.3, Fig. 15): the remaining steps and
    the speeds are the truth times ``1 ± error × (the job's remaining fraction)``, one sign per
    job and estimate drawn from ``seed`` (``tiresias.optimus.estimate_error``)."""

    name = "optimus-noisy"

    def __init__(self, interval: float = DEFAULT_INTERVAL, error: float = 0.1, seed: int = 0,
                 max_aggregators: int = MAX_AGGREGATORS) -> None:
        super().__init__(interval, max_aggregators)
        if error < 0:
            raise ValueError(f"error must be >= 0, got {error}")
        self.error, self.seed = float(error), int(seed)

    def estimate(self, job: JobState, per_node: int):
        remaining, speed = super().estimate(job, per_node)
        if job.rate is None or not job.duration:
            return remaining, speed
        fraction = remaining / job.duration
        steps_sign, speed_sign = error_signs(self.seed, job.job_id)
        scale = error_factor(self.error, speed_sign, fraction)
        return remaining * error_factor(self.error, steps_sign, fraction), lambda p, w: speed(p, w) * scale


class OptimusDRFAllocation(Optimus):
    """Ablation (§6.4, Fig. 18): Optimus with DRF's allocation in place of eq. (9), everything
    else kept (the same pre-runs and their cost, rounds, driver and placement)."""

    name = "optimus-drf-alloc"

    def decide(self, jobs, capacity):
        return allocate_drf(jobs, capacity)


ALLOCATION_POLICIES = {"optimus": Optimus, "optimus-oracle": OptimusOracle, "drf": DRF, "tetris": Tetris,
                       "elastic-srpt": ElasticSRPT, "optimus-noisy": OptimusNoisy,
                       "optimus-drf-alloc": OptimusDRFAllocation}
