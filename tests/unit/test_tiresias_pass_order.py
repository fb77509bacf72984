"""The scheduling pass over a ``RunningOrder`` (prefix sums, whole stretches of running jobs
kept at once) decides exactly what the job-by-job priority walk decides, and the order keeps
its keys and sums right through starts, stops and re-filings."""
from __future__ import annotations

import itertools
import random

import pytest

from tiresias.policies import make_policy
from tiresias.policies.base import JobState, allocate
from tiresias.policies.order import RunningOrder

SIZES = [1] * 8 + [2] * 3 + [4] * 3 + [8] * 2 + [16]


def test_running_order_keys_and_sums_follow_every_change():
    rng = random.Random(7)
    order, ref = RunningOrder(), {}
    for _ in range(3000):
        if ref and rng.random() < 0.45:
            job_id = rng.choice(list(ref))
            order.discard(job_id)
            del ref[job_id]
        else:
            job_id = rng.randrange(10 ** 6)
            ref[job_id] = ((rng.randrange(3), rng.random(), job_id), rng.choice(SIZES))
            order.add(*ref[job_id])
        if rng.random() < 0.3:
            items = sorted(ref.values())
            assert order.keys == [k for k, _ in items]
            assert order.prefix() == list(itertools.accumulate((g for _, g in items), initial=0))
            if items:
                k = rng.choice(items)[0]
                assert order.keys[order.position(k[-1])] == k


def _state(policy_name: str, rng: random.Random, n: int, capacity: int):
    policy = make_policy(policy_name)
    now = 1e5
    jobs = []
    for i in range(n):
        job = JobState(i, rng.choice(SIZES), now - rng.uniform(0, 1e4))
        if rng.random() < 0.6:
            job.first_start = job.submit_time + rng.uniform(0, 50)
            job.service = rng.choice([0.0, 1e3, 5e3, 2e4]) * rng.random()
        jobs.append(job)
        policy.add(job, now)
    to_start, _ = allocate(policy, capacity, [], now)
    for job in to_start:
        job.running = True
        policy.started(job, now)
    for job in rng.sample(jobs, k=n // 10):      # arrivals and demotions since the last pass
        if job.running and policy.order is not None and rng.random() < 0.5:
            job.service += 4000.0
            policy.refile_running(job, now)
    return policy, now


@pytest.mark.parametrize("policy_name", ["las", "sf"])
@pytest.mark.parametrize("seed", range(12))
def test_ordered_pass_decides_as_the_priority_walk(policy_name, seed):
    rng = random.Random(seed)
    capacity = rng.choice([8, 32, 64, 256])
    policy, now = _state(policy_name, rng, rng.choice([5, 40, 200, 600]), capacity)
    assert policy.order is not None
    running = list(policy.running.values())
    keeps = [frozenset()]
    if running:
        keeps.append(frozenset(j.job_id for j in rng.sample(running, k=max(1, len(running) // 4))))
    for keep in keeps:
        for cap in (capacity, max(1, capacity - rng.randrange(capacity))):
            if sum(j.num_gpus for j in running if j.job_id in keep) > cap:
                continue
            fast = allocate(policy, cap, running, now, keep=keep)
            walk = allocate(policy, cap, running, now, fits=lambda job, free: True, keep=keep)
            naive = _textbook_pass(policy, cap, now, keep)
            for got in (fast, walk):
                assert [j.job_id for j in got[0]] == naive[0]
                assert sorted(j.job_id for j in got[1]) == naive[1]


def _textbook_pass(policy, capacity: int, now: float, keep: frozenset) -> tuple[list[int], list[int]]:
    """Every active job sorted by its key, walked one by one (Pseudocode 2, no index)."""
    free = capacity - sum(j.num_gpus for j in policy.running.values() if j.job_id in keep)
    start, preempt = [], []
    for job in sorted(policy.active.values(), key=lambda j: policy.key(j, now)):
        if job.job_id in keep:
            continue
        if job.num_gpus <= free:
            free -= job.num_gpus
            if not job.running:
                start.append(job.job_id)
        elif job.running:
            preempt.append(job.job_id)
    return sorted(start), sorted(preempt)
