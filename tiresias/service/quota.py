"""Per-user submit limits, as pure policy: a token bucket per user and the queued-jobs cap.

``SubmitQuota.check(owner, queued, now)`` answers None (allowed; a token is taken) or a
``Limit`` naming the option that refused and when to retry (``Retry-After``). Clocks are
passed in, so tests drive them by hand. The master calls it under its lock and exempts the
operator's token; the API turns a ``Limit`` into HTTP 429.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

QUEUED_RETRY_AFTER_S = 30.0          # a user at the queued cap: try again after this (jobs end meanwhile)


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved; ``take(now)`` spends one if there is one."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.at = now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = max(self.at, now)                  # a clock that steps back never mints tokens

    def take(self, now: float) -> float:
        """0.0 when a token was spent, else the seconds until one is there (nothing spent)."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


@dataclass(frozen=True)
class Limit:
    """A refused submit: why (one line naming the limit and its option) and when to retry."""
    reason: str
    retry_after: float

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


@dataclass(frozen=True)
class QuotaConfig:
    max_queued_per_user: int = 1000         # not-yet-ended jobs per user; 0: no cap
    submit_rate_per_user: float = 600.0     # submits per minute per user; 0: no limit
    submit_burst: int = 100                 # submits a user may make at once before the rate applies

    def __post_init__(self) -> None:
        if self.max_queued_per_user < 0 or self.submit_rate_per_user < 0:
            raise ValueError("--max-queued-per-user and --submit-rate-per-user must be >= 0")
        if self.submit_burst < 1:
            raise ValueError("--submit-burst must be >= 1")


class SubmitQuota:
    """Every user's bucket (idle full buckets are forgotten, so memory follows active users)."""

    MAX_IDLE_BUCKETS = 10_000

    def __init__(self, config: QuotaConfig) -> None:
        self.config = config
        self.buckets: dict[str, TokenBucket] = {}

    def check(self, owner: str, queued: int, now: float) -> Limit | None:
        cfg = self.config
        if cfg.max_queued_per_user and queued >= cfg.max_queued_per_user:
            return Limit(f"user {owner!r} has {queued} queued or running jobs, the limit is "
                         f"{cfg.max_queued_per_user} (--max-queued-per-user)", QUEUED_RETRY_AFTER_S)
        if not cfg.submit_rate_per_user:
            return None
        bucket = self.buckets.get(owner)
        if bucket is None:
            if len(self.buckets) >= self.MAX_IDLE_BUCKETS:
                self.buckets = {k: b for k, b in self.buckets.items() if not b.full(now)}
            bucket = self.buckets[owner] = TokenBucket(cfg.submit_rate_per_user / 60.0, cfg.submit_burst, now)
        wait = bucket.take(now)
        if wait:
            return Limit(f"user {owner!r} submits faster than {cfg.submit_rate_per_user:g} jobs per minute "
                         f"(burst {cfg.submit_burst}) (--submit-rate-per-user, --submit-burst)", wait)
        return None
