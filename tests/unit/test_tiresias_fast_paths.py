"""The simulator's fast paths decide exactly as the plain rules they replace.

Each fast path (best-fit placement by one sort, the protected set kept beside its heap) is
checked against the plain rule, written out here, on random inputs or along a whole
simulation; the pinned replays (``tests/integration/test_tiresias_pinned.py``) check the
decisions of whole runs."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from tiresias import placement as plc
from tiresias.cluster import ClusterSpec
from tiresias.driver import EPS
from tiresias.policies.las import DiscretizedLAS
from tiresias.sim import SimConfig, simulate
from dlrt.trace import TraceJob


def plain_place(free: list[int], gpus: int, consolidate: bool, per: int) -> plc.Allocation | None:
    """The placement rule as stated (module docstring of ``tiresias.placement``)."""
    fitting = [f for f in free if f >= gpus]
    if fitting:                                   # best fit: the fewest free GPUs that hold it
        return [(free.index(min(fitting)), gpus)]  # ... on the first such node
    if sum(free) < gpus:
        return None
    if consolidate:
        nodes = sorted(range(len(free)), key=lambda n: (-free[n], n))[:plc.min_nodes(gpus, per)]
    else:
        nodes = [n for _, n in sorted((f, n) for n, f in enumerate(free) if f > 0)]
    alloc, left = [], gpus
    for n in nodes:
        take = min(free[n], left)
        if take:
            alloc.append((n, take))
            left -= take
    return alloc if left == 0 else None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=12), st.integers(1, 40), st.booleans())
def test_placement_is_the_plain_rule(free, gpus, consolidate):
    assert plc.place(list(free), gpus, consolidate, 8) == plain_place(list(free), gpus, consolidate, 8)


def _trace(n: int, seed: int) -> list[TraceJob]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / 120.0)
        model = rng.choice(["resnet50", "vgg16", "bert", None])
        jobs.append(TraceJob(i, t, rng.choice([1, 1, 1, 2, 4, 8, 16]), rng.expovariate(1 / 4000.0) + 30.0, model))
    return jobs


def test_protected_set_of_a_pass_is_the_plain_one_along_whole_runs():
    """At every pass of runs that preempt, resume, protect and move jobs, the set the pass keeps
    (``_shielded``) equals the plain definition: running jobs whose protection outlasts now."""
    checked = 0
    for seed, migrate in ((1, False), (2, True), (3, True)):
        def observe(drv):
            nonlocal checked
            limit = drv.now + EPS * max(1.0, abs(drv.now))
            plain = frozenset(j.job_id for j in drv.running.values() if j.protected_until > limit)
            assert drv._shielded(limit) == drv._protected(limit) == plain
            checked += len(plain)
        config = SimConfig("tiresias", overheads=True, slowdown=True, migrate=migrate, min_run=60.0)
        result = simulate(_trace(300, seed), ClusterSpec(4, 8), DiscretizedLAS(), config=config, observe=observe)
        assert result.preemptions > 0
    assert checked > 100                          # the runs did protect jobs


def test_progress_is_the_plain_measure_after_every_advance():
    """The stall detector's measure, noted lazily (at stops, stall changes, on request), equals
    the plain one kept at every clock step: the step's time when a running job's stall ended
    before it, or no job was active."""
    for seed, min_run in ((4, 0.0), (5, 120.0)):
        plain = {"t": None, "checked": 0, "steps": 0}

        def observe(drv):
            if plain["t"] is None:                # from the first event on, step the clock through
                plain["t"] = drv.progress()       # a wrapper that keeps the plain measure
                step = drv.advance

                def advance(t):
                    if t > drv.now and (not drv.policy.active
                                        or any(end < t for end in drv._stall_end.values())):
                        plain["t"] = t
                    step(t)
                    plain["steps"] += 1
                    if plain["steps"] % 5 == 0:        # asked now and then: what stopped between was noted
                        assert drv.progress() == plain["t"]
                        plain["checked"] += 1
                drv.advance = advance

        config = SimConfig("tiresias", overheads=True, slowdown=True, migrate=True, min_run=min_run)
        simulate(_trace(300, seed), ClusterSpec(4, 8), DiscretizedLAS(), config=config, observe=observe)
        assert plain["checked"] > 60


def test_progress_remembers_a_job_that_executed_then_stopped():
    from tiresias.driver import Driver, DriverConfig
    from tiresias.policies.base import JobState
    drv = Driver(DiscretizedLAS(), ClusterSpec(1, 2), DriverConfig("tiresias", overheads=True))
    job = JobState(0, 1, 0.0, 1000.0)
    drv.submit(job)
    assert [j.job_id for j in drv.schedule().started] == [0]     # a first start: no stall
    drv.advance(50.0)
    drv.preempt(job)                              # it executed until 50, then stopped
    drv.advance(80.0)
    assert drv.progress() == 50.0                 # waiting since: no progress after 50
