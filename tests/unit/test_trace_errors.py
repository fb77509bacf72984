"""A trace without a valid job and the messages about skipped rows (``dlrt.trace``)."""
from __future__ import annotations

import re

import pytest

from dlrt.trace import NoValidJob, TraceError, load_trace, problems_summary, skipped_message

HEADER = "job_id,submit_time,num_gpus,duration\n"


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_every_row_bad_names_the_count_and_the_first_three(tmp_path):
    p = write(tmp_path, HEADER + "0,0,x,10\n\n1,-5,1,10\n2,0,1,0\n3,0,1\n")
    with pytest.raises(NoValidJob) as err:
        load_trace(p)
    assert str(err.value) == (f"no valid job in {p}: 4 bad rows; first: {p}:2: num_gpus is not an integer: 'x'; "
                              f"{p}:4: negative submit time -5; {p}:5: duration must be > 0, got 0")
    assert isinstance(err.value, TraceError)


def test_a_header_and_blank_lines_hold_no_job(tmp_path):
    p = write(tmp_path, HEADER + "\n  \n")
    with pytest.raises(NoValidJob, match=re.escape(f"no valid job in {p}: no rows after the header")):
        load_trace(p)


def test_reject_still_names_the_first_bad_row(tmp_path):
    p = write(tmp_path, HEADER + "0,0,x,10\n1,0,1,0\n")
    with pytest.raises(TraceError, match=re.escape(f"{p}:2: num_gpus")) as err:
        load_trace(p, on_bad="reject")
    assert not isinstance(err.value, NoValidJob)


def test_one_valid_job_is_enough_and_the_skipped_rows_are_summarised(tmp_path):
    p = write(tmp_path, HEADER + "0,0,x,10\n1,0,1,10\n2,0,1,0\n")
    report = load_trace(p)
    assert len(report.jobs) == 1 and report.skipped == 2
    assert skipped_message(report, p) == (f"skipped 2 bad rows of {p}: {p}:2: num_gpus is not an integer: 'x'; "
                                          f"{p}:4: duration must be > 0, got 0")
    assert skipped_message(load_trace(write(tmp_path, HEADER + "0,0,1,10\n", "ok.csv")), p) == ""


def test_problems_summary_counts_all_and_lists_the_first_few():
    assert problems_summary(["a"]) == "1 bad row: a"
    assert problems_summary(["a", "b", "c"], of="F") == "3 bad rows of F: a; b; c"
    assert problems_summary(list("abcde"), shown=2) == "5 bad rows; first: a; b"
