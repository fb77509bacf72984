"""An aggregator's migration reports to pMaster, one per batch (``autops.aggregator.batch_reports``),
decided with a fake clock."""
from __future__ import annotations

from autops.aggregator.batch_reports import BatchReports, Report


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_batch_is_reported_once_when_its_last_key_comes_due():
    clock = Clock()
    reports = BatchReports(max_delay=0.1, clock=clock)
    reports.expect(7, "job", 3)
    reports.add(7, "job", ["a"], wait_ms=2.0)
    clock.now += 0.01
    reports.add(7, "job", ["b"], wait_ms=5.0)
    assert reports.due() == []                     # one key still to come, within the delay
    assert reports.deadline() == 100.1
    reports.add(7, "job", ["c"])
    assert reports.due() == [Report(7, "job", ["a", "b", "c"], 5.0)]
    assert reports.due() == [] and reports.deadline() is None


def test_keys_that_waited_the_longest_delay_go_without_the_rest():
    clock = Clock()
    reports = BatchReports(max_delay=0.125, clock=clock)
    reports.expect(1, "job", 4)
    reports.add(1, "job", ["a", "b"])
    clock.now += 0.0625
    reports.add(1, "job", ["c"])
    clock.now += 0.0625                            # "a" came due 0.125 s ago
    assert reports.due() == [Report(1, "job", ["a", "b", "c"], 0.0)]
    assert reports.deadline() is None
    clock.now += 1.0
    reports.add(1, "job", ["d"])                   # the last one completes the batch at once
    assert reports.due() == [Report(1, "job", ["d"], 0.0)]


def test_batches_and_jobs_are_reported_apart():
    clock = Clock()
    reports = BatchReports(clock=clock)
    reports.expect(1, "a", 1)
    reports.expect(2, "a", 2)
    reports.expect(1, "b", 1)
    reports.add(1, "a", ["x"])
    reports.add(2, "a", ["y"])
    reports.add(1, "b", ["z"])
    assert sorted(reports.due()) == [Report(1, "a", ["x"], 0.0), Report(1, "b", ["z"], 0.0)]
    reports.add(2, "a", ["w"])
    assert reports.due() == [Report(2, "a", ["y", "w"], 0.0)]


def test_keys_given_up_complete_a_batch_and_a_released_job_is_forgotten():
    clock = Clock()
    reports = BatchReports(clock=clock)
    reports.expect(3, "job", 3)
    reports.add(3, "job", ["a", "b"])
    reports.give_up(3, "job", 1)                   # refused: reported apart, with its error
    assert reports.due() == [Report(3, "job", ["a", "b"], 0.0)]
    reports.expect(4, "gone", 2)
    reports.add(4, "gone", ["a"])
    reports.forget("gone")
    clock.now += 10
    assert reports.due() == [] and reports.deadline() is None


def test_without_an_expectation_keys_wait_the_delay():
    clock = Clock()
    reports = BatchReports(max_delay=0.2, clock=clock)
    reports.add(5, "job", ["a"])
    assert reports.due() == []
    clock.now += 0.2
    assert reports.due() == [Report(5, "job", ["a"], 0.0)]
