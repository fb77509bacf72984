"""The interface between scheduling policies and whatever drives them (simulator, live master).

A driver (``tiresias.driver``) owns ``JobState`` records (plain data) and tells the policy
which jobs are active (``add``/``remove``) and which started or stopped (``started``/
``stopped``). A policy defines a priority ``key`` (smaller runs first, a tuple ending with the
job id) and says when its order may change on its own (``next_change``: a queue threshold
crossed, a quantum over). A policy never writes a job's fields: a change of a job's state
that it decides (a demotion at a threshold, a promotion back to Q1) is returned by ``due``
as a ``Change``; the driver applies it to the job and calls ``changed``.

Every policy's key of a *waiting* job is static while it waits (LAS: its queue and start
time; SRTF: its remaining time; Gandiva: when it last ran), so the base class keeps waiting
jobs in one sorted list per GPU count, keyed once when they start waiting. A policy whose
keys of *running* jobs stay put too (``static_running_keys``: 2D-LAS, smallest-first) has
them kept in order with their GPU prefix sums (``RunningOrder``), re-filed only when the
policy changes a job's key (a demotion); the others are sorted per pass (``running_order``).
``allocate`` is the one scheduling pass both drivers run: it merges the running order with
the waiting lists of the GPU counts that still fit. Over a ``RunningOrder`` it keeps whole
stretches of running jobs at once (bisecting the prefix sums), so a pass costs the jobs it
admits or preempts and the waiting jobs it passes — never the backlog, nor the jobs that
simply keep running.

Policies that read a running job's attained service or execution in their keys
(``reads_running_progress``: 2D-Gittins, continuous LAS, SRTF) get them settled by the
driver before each pass; the others never need them between a job's start and its stop.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Callable, Iterable, Iterator

from sortedcontainers import SortedList

from .order import RunningOrder

INF = math.inf
BY_ID = attrgetter("job_id")     # sort key: jobs by id


@dataclass(frozen=True, slots=True)
class Change:
    """A job state change a policy decided: ``demote`` raises ``job.service`` to at least
    ``service`` (the threshold it crossed); ``promote`` resets its service and waiting time
    (back to Q1)."""
    kind: str
    job: "JobState"
    service: float


@dataclass(slots=True, eq=False)
class JobState:
    job_id: int
    num_gpus: int
    submit_time: float
    duration: float | None = None     # oracle work (seconds at speed 1, or steps); SRTF/SRSF/oracles read it
    executed: float = 0.0             # work done so far (t_J): seconds at speed 1, or steps
    service: float = 0.0              # attained service W_J * t_J since the last promotion
    first_start: float | None = None
    running: bool = False
    wait_since: float = 0.0           # when it last stopped waiting-time accounting
    waited: float = 0.0               # waiting time accumulated since the last promotion
    last_run: float = -INF            # last time it was running (round robin)
    preemptions: int = 0
    end_time: float | None = None
    skew: float = 0.0
    model: str | None = None
    stall: float = 0.0                # overhead seconds left before this run makes progress
    speed: float = 1.0                # progress per second in the current placement
    overhead: float = 0.0             # seconds charged to pauses and resumes so far
    migrations: int = 0
    protected_until: float = -INF     # not preemptible before (the progress guarantee)
    settled: float = 0.0              # running: service, executed and stall accounted up to here
    batch_size: str | None = None     # with model: the job's profile key for GPU sharing
    may_share: bool = True            # GPU sharing may pack it with another job (--no-share: False)
    # elastic jobs (allocation policies): the GPU range, the aggregators of the current run, and
    # in the simulator the true rate: work units (steps) per second at (GPUs, aggregators, nodes)
    min_gpus: int | None = None
    max_gpus: int | None = None
    aggregators: int = 0
    rate: "Callable[[int, int, int], float] | None" = None

    def remaining(self) -> float:
        return INF if self.duration is None else max(0.0, self.duration - self.executed)


def settle(job: JobState, now: float) -> None:
    """Account a running job's service (GPUs x time), stall and execution up to ``now``."""
    dt = now - job.settled
    if dt > 0.0 and job.running:
        job.service += job.num_gpus * dt
        if job.stall > 0.0:
            s = job.stall if job.stall < dt else dt
            job.stall -= s
            job.executed += (dt - s) * job.speed
        else:
            job.executed += dt * job.speed
    job.settled = now


class Policy:
    """Base class: keeps the active jobs indexed for ``allocate``; a policy defines ``key``."""

    name = "base"
    preemptive = True       # may a running job be stopped for a higher-priority one?
    blocking = False        # stop at the first job that does not fit (head-of-line blocking)
    static_running_keys = False     # a running job's key changes only when the policy re-files it
    reads_running_progress = True   # keys read running jobs' service / execution (settled per pass)
    allocates = False               # decides GPU and aggregator counts (``AllocationPolicy``)

    def __init__(self) -> None:
        self.active: dict[int, JobState] = {}
        self.running: dict[int, JobState] = {}
        self.waiting: dict[int, SortedList] = {}      # GPU count -> sorted keys of waiting jobs
        self._wkey: dict[int, tuple] = {}             # job id -> its key in ``waiting``
        self.heads: dict[int, tuple] = {}             # GPU count -> its first waiting key
        self.head_list: list[tuple] = []               # (first key, GPU count, None) of each, sorted
        self.running_gpus = 0                          # GPUs of the running jobs
        self.order: RunningOrder | None = RunningOrder() if self.static_running_keys else None

    # --- what a policy defines -------------------------------------------------------
    def key(self, job: JobState, now: float) -> tuple:
        """Sort key of ``job`` at ``now`` (smaller runs first), a tuple ending with the job id."""
        raise NotImplementedError(f"{type(self).__name__} does not define key()")

    def running_order(self, now: float) -> list[tuple[tuple, JobState]]:
        """The running jobs as ``(key, job)`` in priority order."""
        if self.order is not None:
            active = self.active
            return [(k, active[k[-1]]) for k in self.order.keys]
        return sorted(((self.key(j, now), j) for j in self.running.values()), key=itemgetter(0))

    def due(self, now: float) -> Change | None:
        """The next job state change due at ``now`` (None when there is none)."""
        return None

    def changed(self, change: Change, now: float) -> None:
        """The driver applied ``change`` (returned by ``due``): file the job anew."""

    def next_change(self, running: Iterable[JobState], now: float) -> float:
        """The earliest time the order may change without an arrival or completion."""
        return INF

    def may_preempt(self, now: float) -> bool:
        """May this pass stop running jobs? (time-sharing policies: only at a quantum's end;
        asked again at the same ``now`` it answers the same)"""
        return self.preemptive

    def plan(self, capacity: int, running: Iterable[JobState], now: float, fits, keep: frozenset[int]
             ) -> tuple[list[JobState], list[JobState]] | None:
        """A policy with its own pass returns ``(to_start, to_preempt)`` as ``allocate`` does
        (keeping the jobs in ``keep`` running); None (the default): the priority walk."""
        return None

    # --- bookkeeping the driver calls ------------------------------------------------
    def add(self, job: JobState, now: float) -> None:
        self.active[job.job_id] = job
        if job.running:
            self.running[job.job_id] = job
            self.running_gpus += job.num_gpus
        else:
            self._wait(job, now)

    def remove(self, job: JobState, now: float) -> None:
        if self.active.pop(job.job_id, None) is not None:
            if self.running.pop(job.job_id, None) is not None:
                self.running_gpus -= job.num_gpus
                if self.order is not None:
                    self.order.discard(job.job_id)
            self._unwait(job)

    def started(self, job: JobState, now: float) -> tuple | None:
        """``job`` was started (``first_start`` is set by the driver before this call); the key
        it is filed under in the running order (None without one)."""
        self._unwait(job)
        self.running[job.job_id] = job
        self.running_gpus += job.num_gpus
        if self.order is None:
            return None
        key = self.key(job, now)
        self.order.add(key, job.num_gpus)
        return key

    def stopped(self, job: JobState, now: float) -> None:
        """``job`` was preempted (it stays active) or finished (``remove`` came first)."""
        if self.running.pop(job.job_id, None) is not None:
            self.running_gpus -= job.num_gpus
            if self.order is not None:
                self.order.discard(job.job_id)
            if job.job_id in self.active:
                self._wait(job, now)

    def resize(self, job: JobState, gpus: int, now: float) -> None:
        """A waiting job's GPU count changes (elastic jobs): file it under its new count."""
        if job.running:
            raise ValueError(f"job {job.job_id} is running: stop it before resizing")
        self._unwait(job)
        job.num_gpus = gpus
        if job.job_id in self.active:
            self._wait(job, now)

    def refile_running(self, job: JobState, now: float) -> None:
        """A running job's key changed (e.g. a demotion): file it anew in the running order."""
        if self.order is not None and job.job_id in self.running:
            self.order.add(self.key(job, now), job.num_gpus)

    def rekey(self, job: JobState, now: float) -> None:
        """A waiting job's key changed (e.g. promotion): file it again."""
        if job.job_id in self._wkey:
            self._unwait(job)
            self._wait(job, now)

    def _wait(self, job: JobState, now: float) -> None:
        key = self.key(job, now)
        size = job.num_gpus
        lst = self.waiting.get(size)
        if lst is None:
            lst = self.waiting[size] = SortedList()
        lst.add(key)
        self._wkey[job.job_id] = key
        head = self.heads.get(size)
        if head is None or key < head:
            self._set_head(size, head, key)

    def _unwait(self, job: JobState) -> None:
        key = self._wkey.pop(job.job_id, None)
        if key is not None:
            size = job.num_gpus
            lst = self.waiting[size]
            if self.heads[size] != key:
                lst.remove(key)
            elif len(lst) == 1:
                del self.waiting[size]
                self._set_head(size, key, None)
            else:                               # the head (a pass starts heads): no search
                lst.pop(0)
                self._set_head(size, key, lst[0])

    def _set_head(self, size: int, old: tuple | None, new: tuple | None) -> None:
        """The first waiting key of GPU count ``size`` is now ``new`` (None: none waits)."""
        heads = self.head_list
        if old is not None:
            i = bisect_left(heads, (old, size, None))
            if new is not None and (i == 0 or heads[i - 1][0] < new) \
                    and (i + 1 == len(heads) or new < heads[i + 1][0]):
                heads[i] = (new, size, None)       # the new head sorts where the old one was
                self.heads[size] = new
                return
            del heads[i]
        if new is None:
            del self.heads[size]
        else:
            self.heads[size] = new
            insort(heads, (new, size, None))

    @property
    def sizes(self) -> list[int]:
        """GPU counts of the waiting jobs."""
        return list(self.waiting)

    def ordered(self, now: float) -> Iterator[JobState]:
        """Every active job in priority order (running and waiting merged)."""
        active = self.active
        streams = [((k, j) for k, j in self.running_order(now))]
        streams += [((k, active[k[-1]]) for k in lst) for lst in self.waiting.values()]
        for _, job in heapq.merge(*streams, key=itemgetter(0)):
            yield job


def allocate(policy: Policy, capacity: int, running: Iterable[JobState], now: float,
             fits: Callable[[JobState, int], bool] | None = None,
             keep: frozenset[int] = frozenset()) -> tuple[list[JobState], list[JobState]]:
    """One scheduling pass (Pseudocode 2): ``(to_start, to_preempt)``.

    Walk the jobs in priority order; admit a job when its GPUs fit in what is left
    (all-or-nothing), skip it otherwise — or stop, for head-of-line-blocking policies. Running
    jobs left out are to be preempted; a non-preemptive policy keeps every running job and
    fills what is left. ``fits(job, free)`` may refuse a waiting job that fits by count (e.g.
    no consolidated placement); running jobs keep the GPUs they hold. Running jobs in ``keep``
    (protected by the progress guarantee) keep their GPUs whatever their priority.
    """
    own = policy.plan(capacity, running, now, fits, keep)
    if own is not None:
        return own
    active = policy.active
    if not policy.may_preempt(now):
        return _fill(policy, capacity - policy.running_gpus, now, fits), []
    if policy.order is not None and fits is None:
        return _pass_ordered(policy, policy.order, capacity, keep)
    order = policy.running_order(now)
    free = capacity - sum(j.num_gpus for j in running if j.job_id in keep) if keep else capacity
    to_start: list[JobState] = []
    to_preempt: list[JobState] = []
    heads = [(key, size, None) for size, key in policy.heads.items() if size <= free]
    heapq.heapify(heads)
    for key, job in order:
        # admit the waiting jobs ahead of this running job
        while heads and heads[0][0] < key:
            free = _admit_head(policy, heads, free, to_start, fits, active)
        if job.job_id in keep:
            continue
        if job.num_gpus <= free:
            free -= job.num_gpus
        else:
            to_preempt.append(job)
    while heads:
        free = _admit_head(policy, heads, free, to_start, fits, active)
    to_start.sort(key=BY_ID)
    return to_start, to_preempt


def _pass_ordered(policy: Policy, order: RunningOrder, capacity: int, keep: frozenset[int]
                  ) -> tuple[list[JobState], list[JobState]]:
    """``allocate``'s walk over a ``RunningOrder``, with the same result: between two waiting
    jobs admitted, the running jobs that fit are kept in one step (the prefix sums bisected);
    only a running job that does not fit is visited, to be preempted. Protected jobs (``keep``)
    count 0 GPUs where they stand, their GPUs being taken first."""
    keys = order.keys
    n = len(keys)
    active = policy.active
    free = capacity
    prefix = order.sums                         # right up to order.valid
    if keep:                                    # their positions, each walk stretch stops there
        kept, held = order.positions(keep)
        free -= held
        kept.append(n)
    else:
        kept = [n]
    k = 0
    heads = list(policy.head_list)              # sorted: a heap already; sizes over free are
                                                # dropped as the walk meets them
    to_start: list[JobState] = []
    to_preempt: list[JobState] = []
    waiting = policy.waiting
    heappop, heapreplace = heapq.heappop, heapq.heapreplace
    p = 0
    while True:
        while heads and heads[0][1] > free:
            heappop(heads)                     # this GPU count no longer fits this pass
        if heads:
            wkey, size, _ = heads[0]
            q = bisect_left(keys, wkey, p)     # the running jobs ahead of the next waiting one
        else:
            q = n
        while p < q:
            if p == kept[k]:                   # a protected job: its GPUs are counted already
                p += 1
                k += 1
                if order.valid < p:
                    prefix = order.prefix()
                continue
            end = q if q < kept[k] else kept[k]
            if end == n and order.total - prefix[p] <= free:    # the rest all fit
                free -= order.total - prefix[p]
                p = n
                break
            if order.valid < end:
                prefix = order.prefix()        # all of them: one recomputation per pass
            c = bisect_right(prefix, prefix[p] + free, p, end + 1) - 1    # keys[p:c] fit
            free -= prefix[c] - prefix[p]
            p = c
            if p < end:
                to_preempt.append(active[keys[p][-1]])
                p += 1
        if free == 0:
            if p < n:                          # nothing fits: the rest are preempted
                to_preempt += [active[key[-1]] for key in keys[p:] if key[-1] not in keep]
            break
        if not heads:
            break
        if size > free:
            heappop(heads)
            continue
        to_start.append(active[wkey[-1]])      # the waiting job is admitted
        free -= size
        if size <= free and (nxt := _next_waiting(waiting[size], heads[0])) is not None:
            heapreplace(heads, nxt)
        else:
            heappop(heads)
    if len(to_start) > 1:
        to_start.sort(key=BY_ID)
    return to_start, to_preempt


def _next_waiting(keys: SortedList, entry: tuple) -> tuple | None:
    """The heap entry after ``entry`` (a waiting key, its GPU count, and None for the first
    key of its list or else an iterator over the list past that key), None at the end."""
    rest = entry[2]
    if rest is None:
        rest = iter(keys)
        next(rest)
    key = next(rest, None)
    return None if key is None else (key, entry[1], rest)


def _admit_head(policy: Policy, heads: list, free: int, to_start: list, fits, active) -> int:
    wkey, size, _ = heads[0]
    if size > free:
        heapq.heappop(heads)                   # this GPU count no longer fits this pass
        return free
    job = active[wkey[-1]]
    if fits is None or fits(job, free):
        to_start.append(job)
        free -= size
    if size <= free and (nxt := _next_waiting(policy.waiting[size], heads[0])) is not None:
        heapq.heapreplace(heads, nxt)
    else:
        heapq.heappop(heads)
    return free


def _fill(policy: Policy, free: int, now: float, fits) -> list[JobState]:
    """Non-preemptive: waiting jobs in order into ``free``; blocking stops at the first misfit."""
    to_start: list[JobState] = []
    active = policy.active
    if policy.blocking:
        streams = [((k, active[k[-1]]) for k in lst) for lst in policy.waiting.values()]
        for _, job in heapq.merge(*streams, key=itemgetter(0)):
            if job.num_gpus > free or (fits is not None and not fits(job, free)):
                break
            to_start.append(job)
            free -= job.num_gpus
    else:
        heads = [(key, size, None) for size, key in policy.heads.items() if size <= free]
        heapq.heapify(heads)
        while heads:
            free = _admit_head(policy, heads, free, to_start, fits, active)
    to_start.sort(key=BY_ID)
    return to_start
