"""``quota``: the per-user token bucket and queued-jobs cap, on a fake clock."""
from __future__ import annotations

import pytest

from tiresias.service.quota import QuotaConfig, SubmitQuota, TokenBucket


def test_bucket_burst_then_rate():
    b = TokenBucket(rate=2.0, burst=3, now=100.0)
    assert [b.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(100.0) == pytest.approx(0.5)                      # one token every 0.5 s
    assert b.take(100.25) == pytest.approx(0.25)                    # refused takes spend nothing
    assert b.take(100.5) == 0.0 and b.take(100.5) > 0
    assert b.take(1000.0) == 0.0 and b.tokens == pytest.approx(2.0)  # refilled up to the burst only


def test_bucket_clock_stepping_back_mints_nothing():
    b = TokenBucket(rate=1.0, burst=1, now=50.0)
    assert b.take(50.0) == 0.0
    assert b.take(10.0) > 0 and b.take(50.5) > 0 and b.take(51.0) == 0.0


def test_bucket_rejects_nonsense():
    with pytest.raises(ValueError):
        TokenBucket(0, 1, 0.0)
    with pytest.raises(ValueError):
        TokenBucket(1, 0, 0.0)


def test_rate_limit_is_per_user_and_names_its_option():
    q = SubmitQuota(QuotaConfig(max_queued_per_user=0, submit_rate_per_user=60.0, submit_burst=5))
    assert all(q.check("mallory", 0, 0.0) is None for _ in range(5))
    limit = q.check("mallory", 0, 0.0)
    assert limit is not None and "--submit-rate-per-user" in limit.reason and "mallory" in limit.reason
    assert limit.retry_after == pytest.approx(1.0) and limit.retry_after_header == "1"
    assert q.check("victim", 0, 0.0) is None                         # another user's bucket is full
    assert q.check("mallory", 0, 1.0) is None                        # one a second afterwards


def test_queued_cap_comes_first_and_spends_no_token():
    q = SubmitQuota(QuotaConfig(max_queued_per_user=3, submit_rate_per_user=60.0, submit_burst=1))
    limit = q.check("mallory", 3, 0.0)
    assert limit is not None and "--max-queued-per-user" in limit.reason and int(limit.retry_after_header) >= 1
    assert q.check("mallory", 2, 0.0) is None                        # the token was still there


def test_zero_disables():
    q = SubmitQuota(QuotaConfig(max_queued_per_user=0, submit_rate_per_user=0, submit_burst=1))
    assert all(q.check("u", 10 ** 6, 0.0) is None for _ in range(1000))
    with pytest.raises(ValueError):
        QuotaConfig(max_queued_per_user=-1)
    with pytest.raises(ValueError):
        QuotaConfig(submit_burst=0)


def test_idle_buckets_are_forgotten():
    q = SubmitQuota(QuotaConfig(max_queued_per_user=0, submit_rate_per_user=60.0, submit_burst=2))
    q.MAX_IDLE_BUCKETS = 10
    for i in range(10):
        q.check(f"u{i}", 0, 0.0)
    q.check("late", 0, 1000.0)                                       # the others refilled: dropped
    assert set(q.buckets) == {"late"}
