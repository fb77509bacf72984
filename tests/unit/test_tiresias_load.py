"""Offered load (tiresias.load) and the queue configuration, fixed or auto (tiresias.queues)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tiresias.load import WEEK, offered_load
from tiresias.queues import DEFAULT_THRESHOLDS, auto_thresholds, queue_config

DAY = 86400.0


@dataclass
class J:
    submit_time: float
    num_gpus: int
    duration: float


def test_overall_is_work_submitted_over_capacity_times_the_submission_span():
    jobs = [J(0, 2, 100), J(50, 1, 300), J(100, 4, 25)]          # 200 + 300 + 100 GPU-s over 100 s
    load = offered_load(jobs, 4)
    assert load.overall == pytest.approx(600 / (4 * 100)) and load.weekly == [pytest.approx(1.5)]
    assert load.span_seconds == 100 and load.jobs == 3 and load.gpus == 4
    assert "offered load 1.50 of 4 GPUs over 100 s" == load.text()


def test_weekly_windows_from_the_first_submission_the_last_one_partial():
    jobs = [J(0, 1, 7 * DAY), J(WEEK + 1, 2, 7 * DAY), J(WEEK + 3 * DAY, 1, 0.5 * DAY)]
    load = offered_load(jobs, 2)
    # week 0: 7 GPU-days on 2 GPUs x 7 days; week 1 (3 days long): 14.5 GPU-days on 2 x 3 days
    assert load.weekly == [pytest.approx(0.5), pytest.approx(14.5 / 6)]
    assert load.overall == pytest.approx(21.5 / (2 * 10))
    assert load.text().endswith("per week: 0.50 2.42") and "10.0 days" in load.text()


def test_a_remainder_shorter_than_a_day_joins_the_last_week():
    jobs = [J(0, 1, DAY), J(WEEK + 3600, 1, DAY)]
    load = offered_load(jobs, 1)
    assert load.weekly == [pytest.approx(2 * DAY / (WEEK + 3600))]


def test_no_window_when_every_job_arrives_at_once():
    load = offered_load([J(5, 1, 10), J(5, 2, 10)], 2)
    assert load.overall is None and load.weekly == [] and "undefined" in load.text()
    assert offered_load([], 2).overall is None
    with pytest.raises(ValueError):
        offered_load([J(0, 1, 1)], 0)


def test_auto_thresholds_double_from_the_median_until_past_the_largest():
    services = [50.0, 100.0, 150.0, 1000.0, 5000.0]               # median 150
    th = auto_thresholds(services)
    assert th == [150.0 * 2 ** i for i in range(7)]                # 150 ... 9600 >= 5000 > 4800
    assert th[-2] < max(services) <= th[-1]
    assert auto_thresholds([7.0, 7.0]) == [7.0]                    # one value: one threshold
    # the rule is scale-free: services x 10 give thresholds x 10
    assert np.allclose(auto_thresholds([10 * s for s in services]), [10 * t for t in th])
    with pytest.raises(ValueError):
        auto_thresholds([0.0, -1.0])


def test_queue_config_fixed_auto_and_errors():
    paper = queue_config("2", "3200")
    assert paper.thresholds == DEFAULT_THRESHOLDS and paper.queues == 2 and not paper.auto
    assert "K=2, thresholds 3,200 GPU-s" == paper.text()
    assert queue_config(3, "100,400").as_dict() == {"queues": 3, "thresholds": [100.0, 400.0], "auto": False}
    auto = queue_config("AUTO", "3200", services=[1.0, 2.0, 3.0, 16.0])
    assert auto.auto and auto.thresholds == (2.5, 5.0, 10.0, 20.0) and auto.queues == 5
    assert "auto" in auto.text()
    for args, match in [(("3", "3200"), "needs 2 thresholds"), (("2", "-5"), "positive"),
                        (("3", "400,100"), "increasing"), (("many", "3200"), "'auto'"),
                        (("2", "x"), "numbers"), (("auto", "3200"), "distribution")]:
        with pytest.raises(ValueError, match=match):
            queue_config(*args)
