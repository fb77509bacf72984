"""The orphan timeout decision (``autops.aggregator.orphan``) on a fake clock: an aggregator gives up only
after its pMaster was silent for longer than the timeout, any word from a pMaster resets the
wait, and 0 means never."""
from __future__ import annotations

import pytest

from autops.aggregator.orphan import DEFAULT_ORPHAN_TIMEOUT, OrphanWatch


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_expires_only_after_the_timeout_without_word_from_pmaster():
    clock = FakeClock()
    watch = OrphanWatch(30.0, clock)
    clock.t += 30.0
    assert not watch.expired()                  # exactly the timeout: not yet
    clock.t += 0.5
    assert watch.expired() and watch.silent_for() == pytest.approx(30.5)


def test_every_answer_from_pmaster_starts_the_wait_again():
    clock = FakeClock()
    watch = OrphanWatch(10.0, clock)
    for _ in range(5):                          # a pMaster answering every 9 s keeps it
        clock.t += 9.0
        assert not watch.expired()
        watch.seen()
    clock.t += 10.5                             # then silence (pMaster SIGKILLed)
    assert watch.expired()
    watch.seen()                                # a restarted pMaster answers in time
    assert not watch.expired() and watch.silent_for() == 0.0


def test_zero_means_never_and_a_negative_timeout_is_refused():
    clock = FakeClock()
    watch = OrphanWatch(0.0, clock)
    clock.t += 1e9
    assert not watch.expired()
    with pytest.raises(ValueError, match="orphan timeout"):
        OrphanWatch(-1.0, clock)
    assert 60 <= DEFAULT_ORPHAN_TIMEOUT <= 600    # "a few minutes"


def test_an_aggregator_refuses_an_orphan_timeout_its_own_heartbeats_cannot_keep():
    from autops.aggregator.service import Aggregator
    with pytest.raises(ValueError, match="two heartbeat intervals"):
        Aggregator("tcp://127.0.0.1:1", heartbeat_interval=1.0, orphan_timeout=1.5)
