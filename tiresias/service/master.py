"""The live master: the driver on a real clock, SQLite as the source of truth, an executor.

``Master`` is the mechanism around ``tiresias.driver.Driver`` (the same one the simulator
drives): it validates and stores submissions, runs a scheduling pass on every submission,
completion and report and every ``interval`` seconds, starts the jobs the pass admits
(``executor.launch``), stops the ones it preempts (a stop request the job polls, then SIGTERM
after ``stop_grace``, then SIGKILL), and records every transition, placement and event.

Restart: a new ``Master`` on the same state dir rebuilds the driver from SQLite, re-attaches
runs the executor still has (``reconcile``), learns how the others ended (the local
executor's supervisors write it down), and credits re-attached jobs with the service they
gained while it was down, so attained service stays within one interval of the truth.

Placement inputs from reports (``ReportFeed``): the skew pMaster measures for a job's tensors
replaces the declared one from the job's next (re)start on; a job that declares its memory
runs only on a node whose free memory plus the memory the cluster's Infiniswap daemons can
lend covers it (and in a memory cgroup of that size).

Owners and secrets: every job records its owner (the API user who submitted it; the
operator's jobs: ``operator``); the views, cancel and logs take an ``owner`` and answer a job
of another owner as they answer a missing one. Every job gets a fresh AutoPS secret at
submission (``AUTOPS_JOB_SECRET`` in its processes' environment), kept in SQLite so every
run of the job presents the same one; no view shows it. With ``run_as_owner`` (local
executor, master as root) a job's processes run as the OS user named like its owner
(``user_map`` renames), with its checkpoint dir and log handed to that user
(``tiresias.service.runas``).

Limits (each an option of ``tiresias master``): a job's log is rotated at ``max_log_bytes``
(``joblog``; offsets of ``read_log`` are absolute byte counts of the job's output, and one that
was rotated away reads from the oldest byte kept); a submit is refused with ``NoSpace`` (507)
while the state disk has less than ``min_free_bytes`` free (``diskspace``), and with
``Throttled`` (429) past a user's queued-jobs cap or submit rate (``quota``; the operator is
exempt); ended jobs older than ``retention_s`` are pruned, rows and dirs, in batches
(``prune_step``, ``retention``). A full disk never loses a run's end: the supervisor retries
its exit record, the store keeps refused writes in order until space returns
(``Store.flush_pending``, every pass), and a launch that fails for lack of space is retried
without counting against the job. The dashboard reads active jobs plus the latest
``dashboard_recent`` ended ones and SQL aggregates, never the whole history, and list reads
take at most ``limit`` rows; the SQL runs outside the master's lock.

Every public method takes the master's lock; the HTTP API and the scheduling thread share it.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dlrt import requeue

from ..cluster import ClusterSpec, skew_of
from ..driver import Driver, DriverConfig
from ..packing.learning import SpeedLearner
from ..packing.learning import observe as observe_pair
from ..packing.rounds import ROUND_SECONDS, SHARING_POLICIES
from ..placement import DEFAULT_PACKLIMIT
from ..policies import POLICIES, SIMULATOR_ONLY, make_policy
from ..policies.elastic import ALLOCATION_POLICIES, DEFAULT_INTERVAL as DEFAULT_ROUND_INTERVAL
from ..progress import DEFAULT_MIN_RUN, DEFAULT_MIN_RUN_FACTOR
from ..policies.base import JobState
from .aggregators import AggregatorResizer
from .executor import Executor, LaunchSpec, RunEnd, default_launcher
from . import diskspace, joblog, runas
from .jobprogress import JobProgress
from .quota import QuotaConfig, SubmitQuota
from .reports import ReportFeed
from .retention import RetentionConfig, cutoff as retention_cutoff
from .store import ACTIVE, TERMINAL, Store, is_full

log = logging.getLogger("tiresias.master")

LIVE_POLICIES = tuple(p for p in POLICIES if p not in SIMULATOR_ONLY) + tuple(SHARING_POLICIES)
KILL_AFTER_S = 5.0           # SIGTERM -> SIGKILL
MAX_LAUNCH_FAILURES = 3      # consecutive failed launches before a job is failed
REQUEUE_MAX_DELAY_S = 60.0   # a run that asked to be requeued waits interval x 2^(n-1), at most this
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
LOG_TAIL_BYTES = 2000
PROGRESS_FILE = "progress"       # control/progress: tiresias.job.report's lines
PROGRESS_READ_BYTES = 64 << 10  # read of a job's progress file per pass, at most
OPERATOR_OWNER = "operator"
SECRET_ENV = "AUTOPS_JOB_SECRET"
DEFAULT_MAX_LOG_BYTES = 64 << 20    # per job log file (about twice this with its one rotated file)
DEFAULT_DASHBOARD_RECENT = 200      # ended jobs the dashboard shows besides the active ones
PRUNE_FIRST_S = 2.0                 # the first retention round, after the master's start


SPEC_LIMITS = {"memory": 1 << 50, "autops_aggregators": 4096}   # bytes (1 PiB); aggregators
MAX_DURATION = 10 * 365 * 86400.0                                 # seconds (also refuses NaN, inf)


class Refused(ValueError):
    """A request the master refuses (bad input); nothing was stored."""


class NotFound(KeyError):
    pass


class Throttled(Refused):
    """A user's submit past a quota (HTTP 429): ``retry_after`` seconds until it may succeed."""

    def __init__(self, message: str, retry_after: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoSpace(Refused):
    """The state disk is below its free-space floor or full (HTTP 507); nothing was stored."""


@dataclass
class MasterConfig:
    state_dir: str
    policy: str = "las"
    thresholds: tuple[float, ...] = (3200.0,)
    promote_knob: float | None = None
    distribution: str | None = None
    packlimit: float = DEFAULT_PACKLIMIT
    interval: float = 5.0
    stop_grace: float = 30.0
    checkpoint_root: str | None = None
    autops_master: str | None = None          # given to jobs that ask for AutoPS aggregators
    node_hosts: dict[str, str] = field(default_factory=dict)   # node -> host in Infiniswap reports
    min_run_factor: float = DEFAULT_MIN_RUN_FACTOR   # progress guarantee (tiresias.progress)
    min_run: float = DEFAULT_MIN_RUN
    run_as_owner: bool = False               # jobs run as their owner's OS user (root, local executor)
    user_map: dict[str, str] = field(default_factory=dict)     # owner -> OS user (default: the same name)
    max_lost_runs: int = 3                   # runs lost in a row (node gone, master restarted) before it fails
    max_log_bytes: int = DEFAULT_MAX_LOG_BYTES   # a job log's rotation cap (0: none)
    min_free_bytes: int | None = None        # state disk floor for submits (None: min(256 MiB, 5%); 0: off)
    max_queued_per_user: int = 1000          # a user's not-yet-ended jobs (0: no cap; the operator: none)
    submit_rate_per_user: float = 600.0      # a user's submits per minute (0: no limit)
    submit_burst: int = 100                  # submits at once before the rate applies
    retention_s: float = 30 * 86400.0        # ended jobs older than this are pruned (0: kept forever)
    dashboard_recent: int = DEFAULT_DASHBOARD_RECENT
    round_interval: float | None = None      # rounds: allocation policies' (600 s), GPU sharing's (360 s)
    colocation: str | None = None            # GPU sharing: the co-location table (default Tesserae's)
    gpu_type: str | None = None              # ... a Gavel-format table's GPU type
    profile_settle_s: float = 60.0           # ... a pairing holds this long before its speed counts

    def __post_init__(self) -> None:
        if self.policy not in LIVE_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (one of {', '.join(LIVE_POLICIES)})")
        if self.round_interval is None:
            self.round_interval = DEFAULT_ROUND_INTERVAL if _base(self.policy) in ALLOCATION_POLICIES else \
                ROUND_SECONDS if self.policy in SHARING_POLICIES else DEFAULT_ROUND_INTERVAL
        if self.interval <= 0 or self.stop_grace < 0 or not self.round_interval > 0:
            raise ValueError("--interval and --round-interval must be > 0 and --stop-grace >= 0")
        if self.max_lost_runs < 1:
            raise ValueError("--max-lost-runs must be >= 1")
        if not 0 <= self.profile_settle_s < float("inf"):
            raise ValueError("--profile-settle must be a finite number of seconds >= 0")
        if self.max_log_bytes < 0 or (self.min_free_bytes is not None and self.min_free_bytes < 0):
            raise ValueError("--max-log-bytes and --min-free-bytes must be >= 0")
        if self.dashboard_recent < 0:
            raise ValueError("the dashboard's recent-jobs count must be >= 0")
        QuotaConfig(self.max_queued_per_user, self.submit_rate_per_user, self.submit_burst)   # checks them
        RetentionConfig(self.retention_s)


@dataclass
class _Run:
    """What the master knows of an active job beyond its ``JobState``."""
    name: str
    spec: dict[str, Any]
    status: str
    submitted: float
    run: int = 0
    started: float | None = None
    placement: list[tuple[str, list[int]]] | None = None
    handle: dict[str, Any] | None = None
    stop_requested: float | None = None
    stop_reason: str = ""
    term_sent: float | None = None
    skew_measured: float | None = None
    launch_failures: int = 0
    owner: str = OPERATOR_OWNER
    secret: str | None = None                # the job's AutoPS secret (every run presents it)
    requeues: int = 0                        # runs in a row that asked to be requeued (dlrt.requeue)
    retry_at: float | None = None            # not started again before this (after a requeue)
    requeue_reason: str = ""


class Master:
    def __init__(self, config: MasterConfig, executor: Executor, store: Store | None = None,
                 reports: ReportFeed | None = None, clock: Callable[[], float] = time.time,
                 resizer: AggregatorResizer | None = None) -> None:
        self.config = config
        self.executor = executor
        self.clock = clock
        self.reports = reports or ReportFeed(clock=clock)
        self.resizer = resizer or (AggregatorResizer(config.autops_master) if config.autops_master else None)
        os.makedirs(config.state_dir, exist_ok=True)
        self.store = store or Store(os.path.join(config.state_dir, "state.db"))
        self.ckpt_root = os.path.abspath(config.checkpoint_root or os.path.join(config.state_dir, "checkpoints"))
        self.jobs_dir = os.path.abspath(os.path.join(config.state_dir, "jobs"))
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.node_infos = executor.nodes()
        if not self.node_infos:
            raise ValueError(f"executor {executor.name} has no nodes")
        per = min(n.gpus for n in self.node_infos)
        self.cluster = ClusterSpec(len(self.node_infos), per)
        self.node_index = {n.name: i for i, n in enumerate(self.node_infos)}
        self.drained: set[str] = set()
        self.runs: dict[int, _Run] = {}
        self.progress: dict[int, JobProgress] = {}     # what active jobs reported (tiresias.job.report)
        self.learner = SpeedLearner(config.profile_settle_s)   # GPU sharing: measured speeds -> the profile
        self.states: dict[int, JobState] = {}
        self.gpus_busy: dict[str, set[int]] = {n.name: set() for n in self.node_infos}
        self.pass_seconds: list[float] = []
        self.last_persist = 0.0
        self.quota = SubmitQuota(QuotaConfig(config.max_queued_per_user, config.submit_rate_per_user,
                                             config.submit_burst))
        self.retention = RetentionConfig(config.retention_s)
        packing = SHARING_POLICIES.get(config.policy, (None, ""))[0]
        self.driver = Driver(self._policy(), self.cluster,
                             DriverConfig("tiresias", packlimit=config.packlimit, defer_release=True,
                                          min_run_factor=config.min_run_factor, min_run=config.min_run,
                                          packing=packing, decide_every=config.round_interval if packing else None),
                             start=clock(), eligible=self._eligible, sharing=self._sharing(packing))
        self._recover()

    # --- construction --------------------------------------------------------------------------
    def _sharing(self, packing: str | None):
        """GPU sharing's profile lookups (None without a sharing policy)."""
        if packing is None:
            return None
        from ..packing.profiles import DEFAULT_COLOCATION, load_profiles
        from ..packing.slots import ProfileSharing
        return ProfileSharing(load_profiles(self.config.colocation or DEFAULT_COLOCATION, self.config.gpu_type))

    def _policy(self):
        history = None
        name = _base(self.config.policy)
        if name == "gittins" and not self.config.distribution:
            history = [r["attained_service"] for r in self.store.jobs(["finished"]) if r["attained_service"] > 0]
            if len(history) < 2:
                raise ValueError("gittins needs a service distribution: --distribution CSV (GPU-seconds of past "
                                 "jobs), or at least two finished jobs in the state dir")
        return make_policy(name, thresholds=self.config.thresholds,
                           promote_knob=self.config.promote_knob, distribution=self.config.distribution,
                           history=history, interval=self.config.round_interval
                           if name in ALLOCATION_POLICIES else None)

    def _recover(self) -> None:
        """Rebuild the driver from SQLite and reconcile the executor's runs with it."""
        now = self.clock()
        rows = self.store.jobs(ACTIVE)
        live: dict[tuple[int, int], dict[str, Any]] = {}
        shared: dict[str, int] = {}
        for row in rows:
            job = self._job_state(row)
            run = _Run(row["name"], row["spec"], row["status"], row["submitted"], row["run"], row["started"],
                       [(n, list(g)) for n, g in row["placement"]] if row["placement"] else None, row["handle"],
                       row["stop_requested"], skew_measured=row["skew"], owner=row["owner"], secret=row["secret"])
            self.runs[job.job_id] = run
            self.states[job.job_id] = job
            self._describe(job.job_id, row["spec"])
            alloc = self._alloc_of(run.placement) if run.placement else None
            if row["status"] in ("running", "stopping") and run.handle is not None:
                key = repr(run.placement)               # two runs on the same GPUs: a guest and its host
                host = shared.get(key) if self.driver.policy.allocates and self.driver.slots is not None else None
                shared.setdefault(key, job.job_id)
                if row["status"] == "running" and row["service_at"] is not None:
                    gained = max(0.0, now - row["service_at"])
                    job.service += job.num_gpus * gained
                    job.executed += gained
                self.driver.restore(job, alloc, draining=row["status"] == "stopping", host=host,
                                    gpus=[(self.node_index[n], g) for n, g in run.placement if n in self.node_index])
                self._take_gpus(run.placement)
                live[(job.job_id, run.run)] = run.handle
            else:
                if row["status"] in ("running", "stopping"):
                    run.status = "preempted"
                self.driver.submit(job)
        ended = self.executor.reconcile(live)           # also stops what SQLite does not know
        if rows:
            self.store.event("recovered", detail=f"{len(rows)} active job(s), {len(live)} run(s) to re-attach, "
                                                 f"{len(ended)} ended while the master was down")
        for end in ended:
            self._on_end(end)
        self._persist(force=True)

    def _describe(self, job_id: int, spec: dict[str, Any]) -> None:
        """What an allocation policy knows of a job at submission: its convergence threshold."""
        policy = self.driver.policy
        if policy.allocates:
            policy.describe(job_id, delta=spec.get("converge"))

    def _job_state(self, row: dict[str, Any]) -> JobState:
        spec = row["spec"]
        skew = row["skew"] if row["skew"] is not None else skew_of(spec.get("model"), spec.get("skew"))
        return JobState(row["id"], row["gpus"], row["submitted"], duration=spec.get("duration"),
                        executed=row["executed"], service=row["attained_service"], first_start=row["started"],
                        running=False, wait_since=row["wait_since"], waited=row["waited"],
                        preemptions=row["preemptions"], skew=skew, model=spec.get("model"),
                        **_gpu_range(spec), **_sharing_fields(spec))

    # --- requests ----------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any], owner: str = OPERATOR_OWNER) -> dict[str, Any]:
        """Validate and store ``owner``'s job; it is scheduled at the next pass (woken now)."""
        clean = self._validate(spec)
        low = diskspace.check(self.config.state_dir, self.config.min_free_bytes)
        if low:
            raise NoSpace(low)
        acct = None
        if self.config.run_as_owner:
            try:
                acct = self.os_account(owner)
            except runas.NoAccount as exc:
                raise Refused(f"jobs run as their owner's OS user here: {exc}") from None
        self._check_workdir(clean, acct)
        with self.lock:
            now = self.clock()
            if owner != OPERATOR_OWNER:
                queued = sum(1 for r in self.runs.values() if r.owner == owner)
                limit = self.quota.check(owner, queued, now)
                if limit is not None:
                    raise Throttled(limit.reason, limit.retry_after_header)
            self.driver.advance(now)
            secret = secrets.token_hex(32)
            try:
                job_id = self.store.add_job(clean["name"], clean, clean["gpus"], now, owner=owner, secret=secret)
            except Exception as exc:
                if not is_full(exc):
                    raise
                raise NoSpace(f"the state disk {self.config.state_dir} is full ({exc}); submits are refused "
                              f"until space is freed (--min-free-bytes)") from None
            job = JobState(job_id, clean["gpus"], now, duration=clean.get("duration"), wait_since=now,
                           skew=skew_of(clean.get("model"), clean.get("skew")), model=clean.get("model"),
                           **_gpu_range(clean), **_sharing_fields(clean))
            self.states[job_id] = job
            self.runs[job_id] = _Run(clean["name"], clean, "waiting", now, owner=owner, secret=secret)
            self._describe(job_id, clean)
            self.driver.submit(job)
        self.wake.set()
        return self.job(job_id)

    def os_account(self, owner: str) -> runas.Account | None:
        """The OS user ``owner``'s jobs run as (None: the master's own user)."""
        if not self.config.run_as_owner:
            return None
        name = self.config.user_map.get(owner)
        if name is None and owner == OPERATOR_OWNER:
            return None                          # the operator's jobs: the master's user, unless mapped
        return runas.account(name or owner)

    def _check_workdir(self, clean: dict[str, Any], acct: runas.Account | None) -> None:
        """The job's workdir must be a directory its user can enter. A job of another OS user is
        checked as that user (never as root: the answer would tell whether any path exists),
        one answer for a path that is not there and one the user may not reach; without a
        workdir it starts in / (not in the master's)."""
        workdir = clean.pop("workdir_given", None)
        if acct is None:
            workdir = workdir or os.getcwd()
            if not os.path.isdir(workdir):
                raise Refused(f"workdir {workdir!r} is not a directory on the master")
        else:
            workdir = workdir or "/"
            if not runas.can_enter(acct, workdir):
                raise Refused(runas.cannot_enter(acct, workdir))
        clean["workdir"] = workdir

    def _validate(self, spec: Any) -> dict[str, Any]:
        if not isinstance(spec, dict):
            raise Refused("a job is a JSON object")
        known = {"name", "gpus", "min_gpus", "command", "memory", "autops_aggregators", "duration", "launcher",
                 "env", "workdir", "model", "skew", "converge", "batch_size", "share"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise Refused(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        gpus = spec.get("gpus")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise Refused(f"gpus must be an integer >= 1, got {gpus!r}")
        total = sum(n.gpus for n in self.node_infos)
        if gpus > total:
            raise Refused(f"the job asks for {gpus} GPUs; the cluster has {total} "
                          f"({len(self.node_infos)} nodes x {self.cluster.gpus_per_node})")
        min_gpus = spec.get("min_gpus")
        if min_gpus is not None and (isinstance(min_gpus, bool) or not isinstance(min_gpus, int)
                                     or not 1 <= min_gpus <= gpus):
            raise Refused(f"min_gpus must be an integer from 1 to gpus ({gpus}), got {min_gpus!r}")
        command = spec.get("command")
        if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
            raise Refused("command must be a non-empty list of strings (everything after '--')")
        name = spec.get("name") or os.path.basename(command[0])
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise Refused(f"name {name!r}: letters, digits, '.', '_' and '-' (at most 64)")
        clean: dict[str, Any] = {"name": name, "gpus": gpus, "command": command,
                                 "min_gpus": min_gpus if min_gpus is not None and min_gpus < gpus else None}
        launcher = spec.get("launcher") or default_launcher(command)
        if launcher not in ("torchrun", "plain"):
            raise Refused(f"launcher must be torchrun or plain, got {launcher!r}")
        clean["launcher"] = launcher
        for key in ("memory", "autops_aggregators"):
            v = spec.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise Refused(f"{key} must be a positive integer, got {v!r}")
            if v is not None and v > SPEC_LIMITS[key]:
                raise Refused(f"{key} must be at most {SPEC_LIMITS[key]}, got {v}")
            clean[key] = v
        if clean["memory"] is not None:
            from .cgroup import unavailable
            why = unavailable() if self.executor.name == "local" else None
            if why:
                raise Refused(f"cannot enforce --memory here: {why}")
        if clean["autops_aggregators"] and not self.config.autops_master:
            raise Refused("the job asks for AutoPS aggregators but the master has no --autops-master")
        duration = spec.get("duration")
        if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                     or not 0 < duration <= MAX_DURATION):
            raise Refused(f"duration must be a positive number of seconds (at most {MAX_DURATION:g}), "
                          f"got {duration!r}")
        if duration is None and self.config.policy in ("srtf", "srsf"):
            raise Refused(f"policy {self.config.policy} needs each job's --duration")
        clean["duration"] = float(duration) if duration is not None else None
        env = spec.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise Refused("env must map strings to strings")
        clean["env"] = env
        workdir = spec.get("workdir")
        if workdir is not None and (not isinstance(workdir, str) or "\0" in workdir
                                    or not os.path.isabs(workdir)):
            raise Refused(f"workdir must be an absolute path, got {workdir!r}")
        clean["workdir_given"] = workdir or None        # checked by ``_check_workdir``, as the job's user
        model = spec.get("model")
        if model is not None and not isinstance(model, str):
            raise Refused("model must be a string")
        clean["model"] = model
        batch = spec.get("batch_size")
        if batch is not None and not (isinstance(batch, str) and 0 < len(batch) <= 64 and batch.isprintable()):
            raise Refused(f"batch_size must be a short string (as the co-location table writes it), got {batch!r}")
        clean["batch_size"] = batch
        share = spec.get("share", True)
        if not isinstance(share, bool):
            raise Refused(f"share must be true or false, got {share!r}")
        clean["share"] = share
        skew = spec.get("skew")
        if skew is not None:
            try:
                skew_of(None, skew)
            except (TypeError, ValueError):
                raise Refused(f"skew must be a number in [0, 1], got {skew!r}") from None
        clean["skew"] = skew
        converge = spec.get("converge")
        if converge is not None and (isinstance(converge, bool) or not isinstance(converge, (int, float))
                                     or not 0 < converge < 1):
            raise Refused(f"converge must be a fraction of the loss's total improvement in (0, 1), got {converge!r}")
        clean["converge"] = float(converge) if converge is not None else None
        return clean

    def cancel(self, job_id: int, owner: str | None = None) -> dict[str, Any]:
        """Cancel a job (``owner``: only one of theirs; another's is "no job")."""
        with self.lock:
            run, job = self._active(job_id, owner)
            now = self.clock()
            self.driver.advance(now)
            if run.status in ("running", "stopping"):
                self.driver.withdraw(job)
                if run.status == "running":
                    self._request_stop(job_id, run, now, "cancel")
                run.stop_reason = "cancel"
                self._persist_job(job_id, events=[(now, job_id, "cancelling", "stop requested")])
            else:
                self.driver.withdraw(job)
                self._close(job_id, "cancelled", now, detail="cancelled while waiting")
        self.wake.set()
        return self.job(job_id, owner)

    def drain(self, node: str, online: bool = False) -> dict[str, Any]:
        """Take ``node`` out of service (its jobs are preempted and resume elsewhere) or back."""
        with self.lock:
            if node not in self.node_index:
                raise NotFound(f"no node {node!r} (nodes: {', '.join(self.node_index)})")
            now = self.clock()
            self.driver.advance(now)
            hit = self.driver.set_online(self.node_index[node], online)
            (self.drained.discard if online else self.drained.add)(node)
            events = [(now, None, "node-undrained" if online else "node-drained", node)]
            for job in hit:
                self._request_stop(job.job_id, self.runs[job.job_id], now, f"node {node} drained")
            self.store.update_jobs([], events)
        self.wake.set()
        return {"node": node, "online": online, "preempted": [j.job_id for j in hit]}

    def _active(self, job_id: int, owner: str | None = None) -> tuple[_Run, JobState]:
        row = self._row(job_id, owner)
        if job_id not in self.runs:
            raise Refused(f"job {job_id} is already {row['status']}")
        return self.runs[job_id], self.states[job_id]

    def _row(self, job_id: int, owner: str | None) -> dict[str, Any]:
        """The job's row; ``NotFound`` when there is none, or it is not ``owner``'s (the same answer)."""
        row = self.store.job(job_id)
        if row is None or (owner is not None and row["owner"] != owner):
            raise NotFound(f"no job {job_id}")
        return row

    # --- the loop ------------------------------------------------------------------------------
    def tick(self) -> None:
        """Learn what ended, escalate stops, take reports, run one pass, start and stop jobs."""
        with self.lock:
            self.store.flush_pending()                # writes a full disk refused, before any new one
            now = self.clock()
            self.driver.advance(now)
            for end in self.executor.poll():
                self._on_end(end)
            self._check_nodes(now)
            self._escalate(now)
            self._take_reports()
            self._take_progress()
            self._take_resizes(now)
            t0 = time.perf_counter()
            decision = self.driver.schedule()
            for job in decision.stopped:
                self._request_stop(job.job_id, self.runs[job.job_id], now, "preempted by the policy")
            for job in decision.started:
                self._launch(job, now)
            for job in decision.moved:
                if self.driver.policy.allocates:
                    self._resize_aggregators(job, now)
            self.pass_seconds.append(time.perf_counter() - t0)
            del self.pass_seconds[:-1000]
            self._persist(force=bool(decision.started or decision.stopped))

    def serve(self, stop: threading.Event, poll: float = 0.2) -> None:
        """Run ``tick`` on every wake-up, every ``poll`` s for ended runs, every ``interval``."""
        last = 0.0
        while not stop.is_set():
            woken = self.wake.wait(poll)
            self.wake.clear()
            try:
                ended = woken or self._any_ended() or time.monotonic() - last >= self.config.interval
                if ended:
                    last = time.monotonic()
                    self.tick()
            except Exception:
                log.exception("scheduling pass failed")

    def _any_ended(self) -> bool:
        """Cheap check between passes: did a run end, or is a stop due to escalate?"""
        with self.lock:
            ends = self.executor.poll()
            for end in ends:
                self._on_end(end)
            now = self.clock()
            if self.driver.next_change() <= now:
                return True                      # a queue threshold crossed, a promotion due
            due = any(r.stop_requested is not None and now - r.stop_requested >= self.config.stop_grace
                      and (r.term_sent is None or now - r.term_sent >= KILL_AFTER_S) for r in self.runs.values())
            return bool(ends) or due

    # --- transitions -----------------------------------------------------------------------------
    def _launch(self, job: JobState, now: float) -> None:
        run = self.runs[job.job_id]
        planned = self.driver.gpu_ids(job.job_id)      # GPU sharing: the round's very GPUs
        host = self.driver.host_of(job.job_id)         # ... or, under an allocation policy, its host's
        if host is not None:
            placement = [(n, list(g)) for n, g in self.runs[host].placement]
        elif planned is not None:
            placement = [(self.node_infos[node].name, gpus) for node, gpus in planned]
            self._take_gpus(placement)
        else:
            placement = self._pick_gpus(self.driver.allocation(job.job_id))
        run.run += 1
        run.placement = placement
        run.stop_requested = run.term_sent = None
        run.stop_reason = ""
        first = run.started is None
        try:
            run.handle = self.executor.launch(self._launch_spec(job.job_id, run))
        except Exception as exc:                      # the executor could not start it (yet)
            log.warning("job %d: launch failed: %s", job.job_id, exc)
            self._release_gpus(placement)
            if is_full(exc):                          # the master's disk, not the job: retried, not counted
                self.driver.abort_start(job)
                self._persist_job(job.job_id, events=[(now, job.job_id, "launch-deferred", f"no space: {exc}")])
                return
            run.launch_failures += 1
            if run.launch_failures >= MAX_LAUNCH_FAILURES:
                self.driver.finish(job)
                self._close(job.job_id, "failed", now, detail=f"launch failed {run.launch_failures} times: {exc}")
            else:                                     # back to the queue; the next pass retries
                self.driver.abort_start(job)
                self._persist_job(job.job_id, events=[(now, job.job_id, "launch-failed", str(exc))])
            return
        run.launch_failures = 0
        run.status = "running"
        if first:
            run.started = now
        if job.job_id in self.progress:           # the last run's final lines first, then
            self._read_progress(job.job_id, run, speed=False)
            self.progress[job.job_id].new_run()    # speeds of this run only (its GPU count may differ)
        self.store.add_placement(job.job_id, run.run, placement, now, aggregators=self._aggregators(job.job_id))
        where = ", ".join(f"{n}[{','.join(map(str, g))}]" for n, g in placement)
        self._persist_job(job.job_id, events=[(now, job.job_id, "started" if first else "resumed",
                                               f"run {run.run} on {where}")])

    def _launch_spec(self, job_id: int, run: _Run) -> LaunchSpec:
        spec = run.spec
        job_dir = os.path.join(self.jobs_dir, str(job_id))
        job_ckpt = os.path.join(self.ckpt_root, str(job_id))
        control = os.path.join(job_ckpt, "control")
        for d in (job_dir, control):
            os.makedirs(d, exist_ok=True)
        acct = self.os_account(run.owner)
        if self.config.run_as_owner:                 # the owner's, or the master's own (the operator's jobs)
            uid, gid = (acct.uid, acct.gid) if acct is not None else (os.geteuid(), os.getegid())
            runas.hand_over(uid, gid, job_ckpt, control, job_dir, self.log_path(job_id))
        for name in ("stop", "stopped", "requeue"):
            runas.remove_control(job_ckpt, name)
        runas.remove_controls(job_ckpt, "stop-at-")       # the ranks' stop decisions (tiresias.job)
        if run.secret is None:                        # a job from before per-job secrets
            run.secret = secrets.token_hex(32)
            self.store.update_job(job_id, secret=run.secret)
        env = dict(spec.get("env") or {})
        env.update({"TIRESIAS_JOB_ID": str(job_id), "TIRESIAS_JOB_NAME": run.name,
                    "TIRESIAS_CHECKPOINT_DIR": self.checkpoint_dir(job_id),
                    "TIRESIAS_STOP_FILE": os.path.join(control, "stop"),
                    "TIRESIAS_STOPPED_FILE": os.path.join(control, "stopped"), SECRET_ENV: run.secret,
                    "TIRESIAS_PROGRESS_FILE": os.path.join(control, PROGRESS_FILE),
                    requeue.ENV: os.path.join(control, "requeue")})
        if acct is not None:
            env.update(runas.account_env(acct))
        if spec.get("autops_aggregators"):
            env.update({"AUTOPS_MASTER": self.config.autops_master, "AUTOPS_JOB": autops_job_name(job_id, run.run, run.secret),
                        "AUTOPS_AGGREGATORS": str(self._aggregators(job_id))})
        memory = spec.get("memory")
        launcher = spec.get("launcher") or default_launcher(spec["command"])     # older specs lack it
        return LaunchSpec(job_id, run.run, run.name, list(spec["command"]), launcher, run.placement,
                          env=env, workdir=spec.get("workdir") or "/", log_path=self.log_path(job_id),
                          max_log_bytes=self.config.max_log_bytes,
                          run_dir=os.path.join(job_dir, f"run{run.run}"), memory_bytes=memory,
                          run_as=acct.name if acct is not None else None)

    def _aggregators(self, job_id: int) -> int | None:
        """The AutoPS aggregators the job's run has: an allocation policy's count, else what
        it was submitted with (None: it uses none)."""
        asked = self.runs[job_id].spec.get("autops_aggregators")
        if asked and self.driver.policy.allocates and self.states[job_id].aggregators > 0:
            return self.states[job_id].aggregators
        return asked

    def _resize_aggregators(self, job: JobState, now: float) -> None:
        """An allocation round changed a running job's aggregator count: pMaster spreads or packs
        its keys over that many aggregators while it trains (no restart); the answer comes back
        at a later pass (``_take_resizes``)."""
        run = self.runs[job.job_id]
        if not run.spec.get("autops_aggregators") or run.status != "running" or run.secret is None \
                or self.resizer is None:
            return                                     # a job without AutoPS: nothing to move
        before = self._placement_aggregators(job.job_id, run.run)
        if before == job.aggregators:
            return                                     # a new speed only (GPU sharing)
        self.resizer.ask((job.job_id, run.run, before), autops_job_name(job.job_id, run.run, run.secret),
                         job.aggregators)

    def _placement_aggregators(self, job_id: int, number: int) -> int | None:
        for placement in reversed(self.store.placements(job_id)):
            if placement["run"] == number:
                return placement.get("aggregators")
        return None

    def _take_resizes(self, now: float) -> None:
        """pMaster's answers: the run's aggregator count is what it got (on a failure, what it
        had: the policy's speed samples must name the count the job really runs with)."""
        for done in self.resizer.poll() if self.resizer is not None else []:
            job_id, number, before = done.key
            run, job = self.runs.get(job_id), self.states.get(job_id)
            current = run is not None and run.run == number and job.running
            if done.got is None:
                self.store.event("aggregators-failed", job_id, f"run {number}: to {done.asked}: {done.error}", now)
                if current and before:
                    job.aggregators = before
                continue
            if current:
                job.aggregators = done.got
            self.store.set_placement_aggregators(job_id, number, done.got)
            self.store.event("aggregators", job_id, f"run {number}: keys spread over {done.got} aggregator(s) "
                                                    f"(asked for {done.asked})", now)

    def _request_stop(self, job_id: int, run: _Run, now: float, why: str) -> None:
        """Ask the job to checkpoint and exit (the stop file); escalation follows the grace."""
        run.status = "stopping"
        run.stop_requested = now
        run.term_sent = None
        run.stop_reason = run.stop_reason or why
        job_ckpt = os.path.join(self.ckpt_root, str(job_id))
        try:
            os.makedirs(os.path.join(job_ckpt, "control"), exist_ok=True)
            runas.touch_control(job_ckpt, "stop")
        except OSError as exc:                         # its control dir tampered with: the grace still runs
            log.warning("job %d: cannot write its stop request: %s", job_id, exc)
        self._persist_job(job_id, events=[(now, job_id, "stopping", why)])

    def _escalate(self, now: float) -> None:
        grace = self.config.stop_grace
        for job_id, run in self.runs.items():
            if run.status != "stopping" or run.stop_requested is None or run.handle is None:
                continue
            if run.term_sent is None and now - run.stop_requested >= grace:
                self.executor.terminate(job_id, run.run, run.handle)
                run.term_sent = now
                self.store.event("sigterm", job_id, f"no exit {grace:g} s after the stop request", now)
            elif run.term_sent is not None and now - run.term_sent >= KILL_AFTER_S:
                self.executor.terminate(job_id, run.run, run.handle, force=True)
                run.term_sent = now
                self.store.event("sigkill", job_id, f"still running {KILL_AFTER_S:g} s after SIGTERM", now)

    def _on_end(self, end: RunEnd) -> None:
        run = self.runs.get(end.job_id)
        if run is None or end.run != run.run:
            return                                   # an old run, already accounted
        now = self.clock()
        job = self.states[end.job_id]
        self._release_gpus(run.placement)
        outcome = "lost" if end.lost else f"exit {end.exit_code}"
        asked = self._requeue_asked(end)
        self.store.end_placement(end.job_id, end.run, now, outcome + (" (stopped)" if end.stopped else "") +
                                 (" (asked to be requeued)" if asked else ""))
        run.handle = None
        if not asked:
            run.requeues, run.retry_at, run.requeue_reason = 0, None, ""
        if run.status == "stopping":
            if run.stop_reason == "cancel":
                self.driver.released(job)
                self._close(end.job_id, "cancelled", now, detail="cancelled while running", code=end.exit_code)
            elif end.exit_code == 0 and not end.stopped and not end.lost:
                self.driver.released(job)        # it finished before it saw the request
                self.driver.remove(job)
                self._close(end.job_id, "finished", now, code=0)
            else:
                self.driver.released(job)
                how = "checkpointed and exited" if end.stopped else (
                    "lost" if end.lost else f"asked to be requeued: {asked}" if asked else
                    f"exit {end.exit_code} (signalled after the grace period)")
                run.status = "preempted"
                run.stop_requested = run.term_sent = None
                self._persist_job(end.job_id, events=[(now, end.job_id, "preempted", f"run {end.run}: {how}; "
                                                       f"{run.stop_reason}")])
                run.stop_reason = ""
            return
        if end.lost and self._lost_in_a_row(end.job_id) >= self.config.max_lost_runs:
            self.driver.finish(job)                    # bounded: a run that is lost every time fails
            self._close(end.job_id, "failed", now, detail=f"{self.config.max_lost_runs} runs in a row were lost "
                        f"({end.detail or 'node or master gone'}); not retried again (--max-lost-runs)")
            return
        if end.lost:                                   # node gone: requeue from its checkpoint
            self.driver.preempt(job)
            self.driver.released(job)
            run.status = "preempted"
            self._persist_job(end.job_id, events=[(now, end.job_id, "lost", end.detail or "run lost")])
            return
        if asked:                                      # e.g. the AutoPS pool refused it for now
            self._requeue(job, run, end.run, asked, now)
            return
        self.driver.finish(job)
        if end.exit_code == 0:
            self._close(end.job_id, "finished", now, code=0)
        else:
            tail = self.log_tail(end.job_id)
            self._close(end.job_id, "failed", now, code=end.exit_code,
                        detail=f"exit code {end.exit_code}" + (f"; {end.detail}" if end.detail else "") +
                        (f"\n{tail}" if tail else ""))

    def _lost_in_a_row(self, job_id: int) -> int:
        """How many of the job's last runs, up to the one just ended, were lost (from SQLite, so
        that runs lost across master restarts count too)."""
        count = 0
        for placement in reversed(self.store.placements(job_id)):
            if not str(placement.get("outcome") or "").startswith("lost"):
                break
            count += 1
        return count

    def _requeue_asked(self, end: RunEnd) -> str:
        """The reason a run that failed gave for being run again later (``dlrt.requeue``), or ''."""
        if end.exit_code in (0, None) or end.lost:
            return ""
        text = runas.read_control(os.path.join(self.ckpt_root, str(end.job_id)), "requeue", 4 * requeue.MAX_REASON)
        return requeue.clean(text) if text and text.strip() else ""

    def _requeue(self, job: JobState, run: _Run, number: int, reason: str, now: float) -> None:
        """Back to the queue (not failed), started again no sooner than interval x 2^(n-1)
        seconds (at most ``REQUEUE_MAX_DELAY_S``) after the n-th such run in a row."""
        run.requeues += 1
        policy = self.driver.policy
        if policy.allocates and run.spec.get("autops_aggregators"):   # e.g. the pool is short: ask for fewer
            policy.refused_aggregators(job.job_id, max(1, job.aggregators))
        delay = min(REQUEUE_MAX_DELAY_S, self.config.interval * 2 ** (run.requeues - 1))
        run.retry_at, run.requeue_reason = now + delay, reason
        self.driver.abort_start(job)                   # its GPUs are free at once; not a preemption
        run.status = "preempted" if job.preemptions else "waiting"
        self._persist_job(job.job_id, events=[(now, job.job_id, "requeued",
                                               f"run {number}: {reason}; retry in {delay:g} s")])

    def _close(self, job_id: int, status: str, now: float, detail: str = "", code: int | None = None) -> None:
        assert status in TERMINAL
        run = self.runs.pop(job_id)
        job = self.states.pop(job_id)
        self.progress.pop(job_id, None)
        self.learner.forget(job_id)
        self.store.update_jobs([(job_id, {"status": status, "ended": now, "exit_code": code, "detail": detail,
                                          "attained_service": job.service, "executed": job.executed,
                                          "preemptions": job.preemptions, "handle": None})],
                               [(now, job_id, status, detail.splitlines()[0] if detail else run.name)])

    def _check_nodes(self, now: float) -> None:
        """Executor-side node changes (a Ray node removed or back)."""
        if self.executor.name == "local":
            return
        alive = {n.name: n.alive for n in self.executor.nodes()}
        for name, i in self.node_index.items():
            up = alive.get(name, False) and name not in self.drained
            if up == (i not in self.driver.nodes.offline):
                continue
            hit = self.driver.set_online(i, up)
            self.store.event("node-up" if up else "node-lost", None, name, now)
            for job in hit:
                self._request_stop(job.job_id, self.runs[job.job_id], now, f"node {name} lost")

    def _take_reports(self) -> None:
        skews = self.reports.job_skews()
        if not skews:
            return
        for job_id, run in self.runs.items():
            if run.secret is None:
                continue                                   # never launched with AutoPS since secrets
            for r in range(run.run, 0, -1):
                measured = skews.get(autops_job_name(job_id, r, run.secret))
                if measured is not None:
                    if run.skew_measured != measured:
                        run.skew_measured = measured
                        self.states[job_id].skew = measured        # used from its next placement on
                        self.store.update_job(job_id, skew=measured)
                    break

    def _take_progress(self) -> None:
        """What running jobs reported since the last pass (``tiresias.job.report``), at most
        ``PROGRESS_READ_BYTES`` per job and pass; an allocation policy learns from it."""
        for job_id, run in self.runs.items():
            if run.status == "running":
                self._read_progress(job_id, run, speed=True)
                if self.driver.slots is not None:
                    self._learn_sharing(job_id, run, self.progress[job_id])

    def _read_progress(self, job_id: int, run: _Run, speed: bool) -> None:
        policy = self.driver.policy
        progress = self.progress.get(job_id)
        if progress is None:
            progress = self.progress[job_id] = JobProgress()
        chunk = runas.read_control_bytes(os.path.join(self.ckpt_root, str(job_id)), PROGRESS_FILE,
                                         PROGRESS_READ_BYTES, progress.offset)
        if not chunk:
            return
        progress.feed(chunk)
        if policy.allocates:
            for step, loss in progress.take_new_points():
                policy.observe_loss(job_id, step, loss)
            job = self.states[job_id]
            since = None
            if speed and self.driver.slots is not None:     # GPU sharing: its speed alone only
                partner = self.driver.partner(job_id)
                speed = partner is None
                since = self.learner.since(self.clock(), job_id, partner)
            measured = (self._autops_speed(job_id, run) or progress.steps_per_s(since=since)) if speed else None
            if measured is not None:
                policy.observe_speed(job_id, max(1, job.aggregators), job.num_gpus, measured, step=progress.step)

    def _learn_sharing(self, job_id: int, run: _Run, progress: JobProgress) -> None:
        """GPU sharing: the job's measured speed, alone or beside its partner, teaches the
        profile the pair's normalised speeds (``tiresias.packing.learning``)."""
        partner = self.driver.partner(job_id)        # None: it runs alone (a partner planned, not started)
        now = self.clock()
        since = self.learner.since(now, job_id, partner)
        rate = self._autops_speed(job_id, run) or progress.steps_per_s(since=since)
        sharing = self.driver.sharing
        kind = sharing.kind(self.states[job_id]) if sharing is not None else None
        measured = self.learner.sample(now, job_id, partner, rate, kind)
        if measured is not None and sharing is not None:
            kinds = {jid: self.learner.kind(jid) for jid in (measured[0], measured[2])}
            if observe_pair(sharing, kinds, measured):
                a, sa, b, sb = measured
                self.store.event("profile", a, f"shared GPUs with job {b}: {sa:.2f} and {sb:.2f} of their speeds "
                                               f"alone, folded into the co-location profile", self.clock())

    def _autops_speed(self, job_id: int, run: _Run) -> float | None:
        """Steps per second of the job's current run as AutoPS measures its iterations (None
        when it uses no AutoPS or pMaster has not reported it)."""
        if run.secret is None or not run.spec.get("autops_aggregators"):
            return None
        seconds = self.reports.job_iteration_times().get(autops_job_name(job_id, run.run, run.secret))
        return 1.0 / seconds if seconds else None

    def _eligible(self, job: JobState) -> list[bool] | None:
        """Nodes whose free memory plus the cluster's lendable remote memory covers the job's."""
        run = self.runs.get(job.job_id)
        if run is not None and run.retry_at is not None and self.clock() < run.retry_at:
            return [False] * len(self.node_infos)       # requeued: not before its retry time
        memory = run.spec.get("memory") if run else None
        if not memory or not self.reports.infiniswap_endpoints:
            return None
        hosts = self.reports.memory()
        lendable = {h: int(r.get("lendable_bytes") or 0) for h, r in hosts.items()}
        mask = []
        for node in self.node_infos:
            host = self.config.node_hosts.get(node.name, node.name)
            report = hosts.get(host)
            if report is None:
                mask.append(False)
                continue
            remote = sum(v for h, v in lendable.items() if h != host)
            mask.append(int(report.get("memory_free_bytes") or 0) + remote >= memory)
        return mask

    # --- GPUs --------------------------------------------------------------------------------------
    def _alloc_of(self, placement: list[tuple[str, list[int]]]) -> list[tuple[int, int]]:
        return [(self.node_index[n], len(g)) for n, g in placement if n in self.node_index]

    def _pick_gpus(self, alloc: list[tuple[int, int]]) -> list[tuple[str, list[int]]]:
        placement = []
        for node, count in alloc:
            name = self.node_infos[node].name
            free = [g for g in range(self.node_infos[node].gpus) if g not in self.gpus_busy[name]]
            if len(free) < count:
                raise AssertionError(f"node {name}: {count} GPUs placed, {len(free)} free")
            placement.append((name, free[:count]))
        self._take_gpus(placement)
        return placement

    def _take_gpus(self, placement) -> None:
        for name, gpus in placement or []:
            self.gpus_busy.setdefault(name, set()).update(gpus)

    def _release_gpus(self, placement) -> None:
        for name, gpus in placement or []:
            self.gpus_busy.get(name, set()).difference_update(gpus)
        if self.driver.slots is not None:     # GPU sharing: a partner's run still holds its GPUs
            for run in self.runs.values():
                if run.handle is not None and run.placement is not placement:
                    self._take_gpus(run.placement)

    # --- persistence ---------------------------------------------------------------------------------
    def _fields(self, job_id: int) -> dict[str, Any]:
        run, job = self.runs[job_id], self.states[job_id]
        return {"status": run.status, "started": run.started, "run": run.run, "placement": run.placement,
                "handle": run.handle, "stop_requested": run.stop_requested,
                "attained_service": job.service, "executed": job.executed, "waited": job.waited,
                "wait_since": job.wait_since, "preemptions": job.preemptions, "service_at": self.driver.now,
                "queue": self._queue(job), "checkpoint_dir": self.checkpoint_dir(job_id)}

    def _persist_job(self, job_id: int, events: list[tuple] = ()) -> None:
        self.store.update_jobs([(job_id, self._fields(job_id))], events)

    def _persist(self, force: bool = False) -> None:
        """Running and stopping jobs' service, at least once per interval (durable)."""
        now = time.monotonic()
        if not force and now - self.last_persist < self.config.interval:
            return
        self.last_persist = now
        self.store.update_jobs([(jid, self._fields(jid)) for jid, r in self.runs.items()
                                if r.status in ("running", "stopping")])

    def _queue(self, job: JobState) -> int:
        queue_of = getattr(self.driver.policy, "queue_of", None)
        return int(queue_of(job)) if queue_of is not None else 0

    # --- views ---------------------------------------------------------------------------------------
    def checkpoint_dir(self, job_id: int) -> str:
        return os.path.join(self.ckpt_root, str(job_id), "checkpoint")

    def log_path(self, job_id: int) -> str:
        return os.path.join(self.jobs_dir, str(job_id), "job.log")

    def log_tail(self, job_id: int, nbytes: int = LOG_TAIL_BYTES) -> str:
        try:
            return joblog.tail(self.log_path(job_id), nbytes).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def read_log(self, job_id: int, offset: int = 0, limit: int = 1 << 20,
                 owner: str | None = None) -> tuple[str, int, str]:
        """The job's output from ``offset``: ``(text, next offset, job status)``. Offsets count the
        job's output from its first byte, across rotations; one rotated away (older than the
        kept ``job.log.1`` + ``job.log``) reads from the oldest byte kept."""
        with self.lock:
            row = self._row(job_id, owner)
            status = self.runs[job_id].status if job_id in self.runs else row["status"]
        try:
            data, new = joblog.read_log(self.log_path(job_id), max(0, offset), limit)
        except OSError:
            return "", offset, status
        return data.decode("utf-8", "replace"), new, status

    def job(self, job_id: int, owner: str | None = None) -> dict[str, Any]:
        """One job with its runs (``owner``: only one of theirs; another's is "no job")."""
        with self.lock:
            row = self._row(job_id, owner)
            view = self._view(row)
            asked = row["spec"].get("autops_aggregators")     # runs from before per-run counts
            view["runs"] = [{**r, "gpus": sum(len(g) for _, g in r["nodes"]),
                             "aggregators": r["aggregators"] if r.get("aggregators") is not None else asked}
                            for r in self.store.placements(job_id)]
            return view

    def jobs(self, statuses: list[str] | None = None, owner: str | None = None,
             limit: int | None = None) -> list[dict[str, Any]]:
        """Jobs in id order (``limit``: only the newest that many); the SQL runs outside the lock."""
        rows = (self.store.jobs(statuses, owner=owner) if limit is None else
                self.store.latest_jobs(limit, statuses, owner=owner))
        with self.lock:
            return [self._view(r) for r in rows]

    def _view(self, row: dict[str, Any]) -> dict[str, Any]:
        job_id = row["id"]
        spec = row["spec"]
        view = {"id": job_id, "name": row["name"], "owner": row["owner"], "status": row["status"],
                "gpus": row["gpus"],
                "submitted": row["submitted"], "started": row["started"], "ended": row["ended"],
                "preemptions": row["preemptions"], "attained_service": row["attained_service"],
                "executed": row["executed"], "queue": row["queue"], "run": row["run"],
                "placement": {n: g for n, g in row["placement"]} if row["placement"] else {},
                "command": spec["command"], "launcher": spec.get("launcher"), "memory": spec.get("memory"),
                "autops_aggregators": spec.get("autops_aggregators"), "duration": spec.get("duration"),
                "min_gpus": spec.get("min_gpus"), "converge": spec.get("converge"),
                "skew": row["skew"] if row["skew"] is not None else skew_of(spec.get("model"), spec.get("skew")),
                "skew_measured": row["skew"] is not None, "exit_code": row["exit_code"], "detail": row["detail"],
                "checkpoint_dir": row["checkpoint_dir"], "reason": None,
                "jct": row["ended"] - row["submitted"] if row["ended"] is not None else None}
        job, run = self.states.get(job_id), self.runs.get(job_id)
        if job is not None and run is not None:      # live figures, fresher than the last write
            view.update(status=run.status, attained_service=job.service, executed=job.executed,
                        preemptions=job.preemptions, queue=self._queue(job), run=run.run,
                        placement={n: g for n, g in run.placement} if run.placement and run.status in
                        ("running", "stopping") else view["placement"])
            progress = self.progress.get(job_id)
            if progress is not None and progress.step is not None:
                view["progress"] = progress.view()
            if run.status in ("running", "stopping"):
                view["allocation"] = {"gpus": job.num_gpus, "aggregators": self._aggregators(job_id)}
            slots = self.driver.slots
            if slots is not None:                     # GPU sharing: who it shares with, at what speed
                view["shares_with"] = self.driver.partner(job_id)
                view["model_batch"] = [spec.get("model"), spec.get("batch_size")]
                view["may_share"] = spec.get("share", True)
            policy = self.driver.policy
            if policy.allocates and job_id in policy.models:
                view["model"] = model = policy.models[job_id].fitted()
                fit = policy.models[job_id].speed_model()
                speed = fit.speed(max(1, job.aggregators), job.num_gpus) if fit is not None and job.running else 0.0
                model["predicted_remaining_s"] = model["remaining_steps"] / speed if speed > 0 else None
            if run.status in ("waiting", "preempted"):
                view["reason"] = self.driver.reasons.get(job_id) or "queued behind higher-priority jobs"
                if run.requeue_reason:
                    retry = "" if run.retry_at is None or run.retry_at <= self.clock() else \
                        f"; retry in {run.retry_at - self.clock():.0f} s"
                    view["reason"] = f"requeued: {run.requeue_reason}{retry}"
        if view["status"] in ("waiting", "preempted"):
            view["placement"] = {}
        return view

    def nodes(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Nodes with their GPUs, jobs (``owner``: only theirs are named) and memory."""
        with self.lock:
            hosts = self.reports.memory()
            out = []
            for i, info in enumerate(self.node_infos):
                host = self.config.node_hosts.get(info.name, info.name)
                mem = hosts.get(host)
                jobs = {jid: [g for n, g in r.placement if n == info.name][0] for jid, r in self.runs.items()
                        if r.placement and r.status in ("running", "stopping") and
                        any(n == info.name for n, _ in r.placement) and owner in (None, r.owner)}
                holders: dict[int, list[int]] = {}
                for jid, gpus in jobs.items():
                    for g in gpus:
                        holders.setdefault(g, []).append(jid)
                shared = {str(g): sorted(js) for g, js in sorted(holders.items()) if len(js) > 1}
                out.append({"name": info.name, "gpus": info.gpus, "online": i not in self.driver.nodes.offline,
                            "shared_gpus": shared,
                            "drained": info.name in self.drained, "free_gpus": info.gpus - len(self.gpus_busy[info.name]),
                            "jobs": {str(k): v for k, v in jobs.items()}, "host": host,
                            "memory_total_bytes": mem.get("memory_total_bytes") if mem else None,
                            "memory_free_bytes": mem.get("memory_free_bytes") if mem else None,
                            "memory_lent_bytes": (int(mem.get("slabs_lent") or 0) * int(mem.get("slab_bytes") or 0)
                                                  if mem else None),
                            "memory_lendable_bytes": mem.get("lendable_bytes") if mem else None})
            return out

    def summary(self) -> dict[str, Any]:
        """Cluster-level view: queues, GPU use, JCTs so far, report sources, pass times, the
        state disk (counts and JCTs by SQL aggregate, outside the lock)."""
        counts = self.store.status_counts()
        finished, avg_jct = self.store.finished_jct()
        try:
            free, total = diskspace.usage(self.config.state_dir)
        except OSError:
            free, total = None, None
        with self.lock:
            queues: dict[int, int] = {}
            for jid, run in self.runs.items():
                if run.status in ("waiting", "preempted"):
                    q = self._queue(self.states[jid])
                    queues[q] = queues.get(q, 0) + 1
            passes = sorted(self.pass_seconds)
            return {"policy": self.config.policy, "executor": self.executor.name,
                    "nodes": len(self.node_infos), "gpus": sum(n.gpus for n in self.node_infos),
                    "gpus_used": sum(len(s) for s in self.gpus_busy.values()), "jobs": counts,
                    "queues": {str(k): v for k, v in sorted(queues.items())},
                    "thresholds": list(self.config.thresholds),
                    "finished": finished, "avg_jct": avg_jct,
                    "state_disk": {"free_bytes": free, "total_bytes": total,
                                   "floor_bytes": diskspace.floor(total, self.config.min_free_bytes)
                                   if total is not None else None,
                                   "pending_writes": self.store.pending_writes()},
                    "reports": self.reports.sources(), "lendable_bytes": self.reports.lendable_bytes(),
                    "pass_ms_p50": passes[len(passes) // 2] * 1e3 if passes else None}

    def dashboard(self, owner: str | None = None) -> dict[str, Any]:
        """What the dashboard shows: active jobs and the latest ``dashboard_recent`` ended ones
        (``owner``: their jobs only; the summary stays the cluster's), read by index outside the
        lock; the summary's counts cover every job."""
        rows = self.store.board_jobs(self.config.dashboard_recent, owner)
        summary = self.summary()
        nodes = self.nodes(owner)
        events = self.events(limit=40, owner=owner)
        with self.lock:
            jobs = [self._view(r) for r in rows]
        return {"summary": summary, "nodes": nodes, "jobs": jobs, "events": events,
                "recent_ended_shown": self.config.dashboard_recent}

    def events(self, since: int = 0, job_id: int | None = None, limit: int = 200,
               owner: str | None = None) -> list[dict[str, Any]]:
        """Recent events (``owner``: only those of their jobs)."""
        return self.store.events(since, job_id, limit, owner=owner)

    # --- retention -------------------------------------------------------------------------------
    def prune_step(self) -> int:
        """Prune one batch of ended jobs older than the retention: rows, runs and events in one
        short transaction (no master lock: ended jobs are not in its memory), then their job and
        checkpoint dirs. The number pruned (0: nothing due, retention off, or a full disk)."""
        limit = retention_cutoff(self.clock(), self.retention.retention_s)
        if limit is None:
            return 0
        ids = self.store.expired(limit, self.retention.batch)
        if not self.store.delete_jobs(ids, cutoff=limit):
            return 0
        for job_id in ids:
            for d in (os.path.join(self.jobs_dir, str(int(job_id))), os.path.join(self.ckpt_root, str(int(job_id)))):
                shutil.rmtree(d, ignore_errors=True)
        if ids:
            log.info("pruned %d job(s) that ended before the retention (%g s)", len(ids), self.retention.retention_s)
        return len(ids)

    def prune_loop(self, stop: threading.Event) -> None:
        """``prune_step`` soon after the start, then every ``check_every_s``, batch after batch
        while there is more."""
        wait = min(PRUNE_FIRST_S, self.retention.check_every_s)
        while not stop.wait(wait):
            wait = self.retention.check_every_s
            try:
                while self.prune_step() >= self.retention.batch and not stop.wait(0.05):
                    pass
            except Exception:
                log.exception("pruning ended jobs failed")

    def close(self) -> None:
        with self.lock:
            self.store.flush_pending()
            self._persist(force=True)
            self.reports.stop()
            if self.resizer is not None:
                self.resizer.close()
            self.executor.close()
            self.store.close()


def _sharing_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """GPU sharing's view of a job: its profile key's batch size, whether it may share."""
    return {"batch_size": spec.get("batch_size"), "may_share": spec.get("share", True)}


def _gpu_range(spec: dict[str, Any]) -> dict[str, int | None]:
    """An elastic job's GPU range for its ``JobState`` (a fixed job has none)."""
    low = spec.get("min_gpus")
    return {"min_gpus": low, "max_gpus": spec["gpus"]} if low else {}


def autops_job_name(job_id: int, run: int, secret: str) -> str:
    """The AutoPS job name of a run (a new registration per run): ``tiresias-ID-rRUN-TAG``, TAG
    16 hex digits of an HMAC of the job's secret, so that nobody without the secret can name
    (and register first, squatting) a run's AutoPS job; the same after a master restart."""
    tag = hmac.new(secret.encode(), f"tiresias autops job {job_id} r{run}".encode(), hashlib.sha256).hexdigest()
    return f"tiresias-{job_id}-r{run}-{tag[:16]}"


def _base(policy: str) -> str:
    """The policy a command-line name runs (``tesserae-optimus``: ``optimus``)."""
    return SHARING_POLICIES.get(policy, (None, policy))[1]
