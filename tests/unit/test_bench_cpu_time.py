"""The CPU time sampler of the benchmarks (dlrt_bench/cpu_time.py): parsing ``/proc/stat``,
the milliseconds between two readings, and windows over a sampled file."""
import os
import time

import pytest

from dlrt_bench.cpu_time import CpuSampler, cpu_delta, read_cpu

STAT = """cpu  {user} 0 {system} {idle} {iowait} 0 {softirq} {steal} 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
intr 12345
"""


def stat(path, user=0, system=0, idle=0, iowait=0, softirq=0, steal=0):
    path.write_text(STAT.format(user=user, system=system, idle=idle, iowait=iowait, softirq=softirq, steal=steal))


def test_the_first_line_is_every_cpu_together(tmp_path):
    path = tmp_path / "stat"
    stat(path, user=10, system=5, idle=100, iowait=2, softirq=1, steal=7)
    assert read_cpu(str(path)) == {"user": 10, "nice": 0, "system": 5, "idle": 100, "iowait": 2, "irq": 0,
                                   "softirq": 1, "steal": 7}
    (tmp_path / "empty").write_text("intr 1\n")
    with pytest.raises(ValueError, match="no 'cpu' line"):
        read_cpu(str(tmp_path / "empty"))


def test_a_delta_splits_the_time_into_the_hosts_idle_and_used():
    a = {"user": 10, "system": 5, "idle": 100, "iowait": 2, "softirq": 1, "steal": 7}
    b = {"user": 30, "system": 9, "idle": 130, "iowait": 4, "softirq": 2, "steal": 12}
    assert cpu_delta(a, b, tick_ms=10.0) == {"steal_ms": 50.0, "idle_ms": 320.0, "busy_ms": 250.0}


def test_a_window_reads_the_samples_around_it(tmp_path):
    path = tmp_path / "stat"
    stat(path, idle=100)
    sampler = CpuSampler(interval=0.01, path=str(path))
    sampler._sample()                                  # as the thread does, at chosen moments
    t0 = time.monotonic()
    stat(path, idle=100, steal=4, user=3)              # the host took 4 ticks, this machine used 3
    sampler._sample()
    t1 = time.monotonic()
    got = sampler.window(t0, t1)
    assert got["steal_ms"] > 0 and got["busy_ms"] > 0 and got["idle_ms"] == 0
    assert sampler.window(t1, t1)["steal_ms"] == 0     # nothing changed after


def test_the_thread_samples_from_start_to_stop(tmp_path):
    path = tmp_path / "stat"
    stat(path, idle=1)
    sampler = CpuSampler(interval=0.001, path=str(path)).start()
    sampler.stop()
    assert len(sampler.samples) >= 2 and sampler.samples[-1]["machine"]["idle"] == 1


def test_a_window_says_what_each_process_used(tmp_path):
    path = tmp_path / "stat"
    stat(path, idle=1)
    sampler = CpuSampler(interval=0.01, path=str(path), pids={"me": os.getpid(), "gone": 2 ** 22 + 1})
    sampler._sample()
    t0 = time.monotonic()
    before = time.process_time()
    while time.process_time() - before < 0.1:          # 100 ms of this process's CPU
        pass
    sampler._sample()
    t1 = time.monotonic()
    used = sampler.window(t0, t1)["by_process"]
    assert set(used) == {"me"} and used["me"] >= 50    # the kernel counts in clock ticks


def test_a_window_says_what_each_thread_used_by_its_name(tmp_path):
    import threading

    from dlrt.procs import name_this_thread
    from dlrt_bench.cpu_time import thread_cpu
    path = tmp_path / "stat"
    stat(path, idle=1)
    sampler = CpuSampler(interval=0.01, path=str(path), pids={"me": os.getpid()}, threads=True)
    sampler._sample()
    t0 = time.monotonic()

    burnt, release = threading.Event(), threading.Event()

    def burn() -> None:
        name_this_thread("test-burner")
        before = time.thread_time()
        while time.thread_time() - before < 0.1:       # 100 ms of this thread's CPU
            pass
        burnt.set()
        release.wait(10)                               # alive while sampled: a thread gone is not listed

    thread = threading.Thread(target=burn)
    thread.start()
    assert burnt.wait(10)
    sampler._sample()
    t1 = time.monotonic()
    release.set()
    thread.join()
    used = sampler.window(t0, t1)["by_thread"]["me"]
    assert used["test-burner"] >= 50 and used.get("main", 0) < used["test-burner"]
    assert "main" in thread_cpu(os.getpid()) and thread_cpu(2 ** 22 + 1) == {}
