"""A run that asks to be requeued (``dlrt.requeue``: an AutoPS pool refusing it for now) goes
back to the queue with its reason shown, and is started again after a back-off; and the ranks
of a job agree on the ``should_stop()`` call at which they all stop.

The master runs on a fake clock with the in-memory executor of ``test_tiresias_master``."""
from __future__ import annotations

import os
import threading
import time

import pytest

from dlrt import requeue
from test_tiresias_master import make, spec, status
from tiresias import job as tjob


def ask_requeue(launch, reason: str) -> None:
    """What ``requeue.request`` does inside the run ``launch`` started."""
    with open(launch.env[requeue.ENV], "w") as f:
        f.write(reason + "\n")


def events(m, job_id: int, kind: str) -> list[str]:
    return [e["detail"] for e in m.events(job_id=job_id) if e["kind"] == kind]


def test_a_run_refused_by_the_pool_is_requeued_with_its_reason_and_retried_after_a_back_off(tmp_path):
    m, clock, ex = make(tmp_path, interval=2.0)
    j = m.submit(spec(2))["id"]
    m.tick()
    assert status(m, j) == "running"
    first = ex.launched[-1]
    assert first.env[requeue.ENV].endswith(f"/{j}/control/requeue")
    ask_requeue(first, "AutoPS pool refused the job for now: admission refused: the pool can give 0 now")
    decision = os.path.join(os.path.dirname(first.env["TIRESIAS_STOP_FILE"]), "stop-at-1-2")
    open(decision, "w").close()                                            # as the ranks leave it
    clock.t += 5
    ex.end(j, 1, 1)
    m.tick()
    view = m.job(j)
    assert view["status"] == "waiting" and view["exit_code"] is None        # not failed
    assert view["reason"].startswith("requeued: AutoPS pool refused the job for now: admission refused")
    assert "retry in 2 s" in view["reason"]
    assert events(m, j, "requeued") == ["run 1: AutoPS pool refused the job for now: admission refused: "
                                        "the pool can give 0 now; retry in 2 s"]
    assert m.nodes()[0]["free_gpus"] == 2 and len(ex.launched) == 1          # GPUs free, not started yet
    clock.t += 1.5
    m.tick()
    assert len(ex.launched) == 1 and status(m, j) == "waiting"
    clock.t += 0.6
    m.tick()
    assert len(ex.launched) == 2 and status(m, j) == "running"
    assert not os.path.exists(first.env[requeue.ENV])                      # removed before run 2
    assert not os.path.exists(decision)
    ask_requeue(ex.launched[-1], "AutoPS pool refused the job for now: restarting")
    ex.end(j, 2, 1)
    m.tick()
    assert "retry in 4 s" in m.job(j)["reason"]                            # the second in a row: doubled
    clock.t += 4.1
    m.tick()
    assert len(ex.launched) == 3
    ex.end(j, 3, 0)
    m.tick()
    view = m.job(j)
    assert view["status"] == "finished" and view["preemptions"] == 0
    assert [r["outcome"] for r in view["runs"]] == ["exit 1 (asked to be requeued)"] * 2 + ["exit 0"]


def test_a_failure_without_the_request_is_still_a_failure_and_success_ignores_it(tmp_path):
    m, clock, ex = make(tmp_path)
    a = m.submit(spec(1, "a"))["id"]
    b = m.submit(spec(1, "b"))["id"]
    m.tick()
    ex.end(a, 1, 3)
    ask_requeue(ex.launched[1], "not needed after all")
    ex.end(b, 1, 0)
    m.tick()
    assert status(m, a) == "failed" and status(m, b) == "finished"


def test_a_symlink_in_place_of_the_request_is_not_followed(tmp_path):
    m, clock, ex = make(tmp_path)
    j = m.submit(spec(1))["id"]
    m.tick()
    target = tmp_path / "elsewhere"
    target.write_text("planted\n")
    os.symlink(target, ex.launched[0].env[requeue.ENV])
    ex.end(j, 1, 1)
    m.tick()
    assert status(m, j) == "failed"


def test_request_writes_one_clean_line_only_under_a_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv(requeue.ENV, raising=False)
    assert requeue.request("nobody asked") is False
    path = tmp_path / "requeue"
    monkeypatch.setenv(requeue.ENV, str(path))
    assert requeue.request("pool\nbusy\x00 now " + "x" * 1000)
    text = path.read_text()
    assert text.endswith("...\n") and text.count("\n") == 1 and len(text) == requeue.MAX_REASON + 1
    assert text.startswith("pool busy now xx")


def test_exit_requeue_asks_and_exits_75(tmp_path, monkeypatch):
    monkeypatch.setenv(requeue.ENV, str(tmp_path / "requeue"))
    with pytest.raises(SystemExit) as done:
        tjob.exit_requeue("the licence server is busy")
    assert done.value.code == tjob.EXIT_REQUEUE == 75
    assert (tmp_path / "requeue").read_text() == "the licence server is busy\n"


def lockstep(polls: list[tjob.StopPoll], stop_file, request_at: tuple[int, int], steps: int = 30) -> list[int]:
    """Two ranks in lock-step (neither more than one call ahead): ``request_at = (call, rank)``
    creates the stop file just before that rank's call. Returns the call each stopped at."""
    stopped = [0, 0]
    for call in range(1, steps + 1):
        for rank in (0, 1):
            if (call, rank) == request_at:
                stop_file.touch()
            if not stopped[rank] and polls[rank]():
                stopped[rank] = call
        if all(stopped):
            break
    return stopped


@pytest.mark.parametrize("request_at", [(5, 0), (5, 1), (1, 1), (12, 0)])
def test_ranks_stop_at_the_same_call_whoever_sees_the_request_first(tmp_path, request_at):
    stop = tmp_path / "stop"
    polls = [tjob.StopPoll(str(stop), 2), tjob.StopPoll(str(stop), 2)]
    stopped = lockstep(polls, stop, request_at)
    assert stopped == [request_at[0] + tjob.AGREE_AHEAD] * 2
    [decision] = tmp_path.glob("stop-at-*")
    assert decision.read_text() == f"{stopped[0]}\n"


def test_a_decision_left_by_an_earlier_stop_request_is_not_read(tmp_path):
    """A run resumed outside Tiresias with the same stop file (no master cleans up): its ranks
    agree anew when asked to stop again, not on the old request's call."""
    stop = tmp_path / "stop"
    assert lockstep([tjob.StopPoll(str(stop), 2), tjob.StopPoll(str(stop), 2)], stop, (3, 0)) == [5, 5]
    stop.unlink()
    time.sleep(0.01)                                # another mtime for the next request
    assert lockstep([tjob.StopPoll(str(stop), 2), tjob.StopPoll(str(stop), 2)], stop, (20, 1), 40) == [22, 22]
    assert len(list(tmp_path.glob("stop-at-*"))) == 2


def test_ranks_one_call_apart_still_stop_together(tmp_path):
    """Rank 1 runs one call ahead of rank 0 (it may, in lock-step training), and the request
    appears between them: rank 1 saw it first, rank 0 must still reach the same call."""
    stop = tmp_path / "stop"
    r0, r1 = tjob.StopPoll(str(stop), 2), tjob.StopPoll(str(stop), 2)
    seen = {0: None, 1: None}
    r1()                                            # rank 1 is one call ahead
    for call in range(1, 20):
        if call == 4:
            stop.touch()
        for rank, poll in ((1, r1), (0, r0)):
            if seen[rank] is None and poll():
                seen[rank] = poll.calls
    assert seen[0] == seen[1] is not None


def test_a_single_worker_stops_at_once_and_many_threads_agree_on_one_call(tmp_path):
    stop = tmp_path / "stop"
    alone = tjob.StopPoll(str(stop), 1)
    assert not alone()
    stop.touch()
    assert alone() and not list(tmp_path.glob("stop-at-*"))
    polls = [tjob.StopPoll(str(stop), 8) for _ in range(8)]
    for p in polls:
        p.calls = 10
    agreed: list[int] = []
    threads = [threading.Thread(target=lambda p=p: agreed.append(p._agreed())) for p in polls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert agreed == [12] * 8


def test_outside_tiresias_should_stop_is_false(monkeypatch):
    monkeypatch.delenv(tjob.ENV_STOP_FILE, raising=False)
    assert tjob.StopPoll(None, 4)() is False
