"""Memory made ready ahead of use (``autops.transport.prefault``): the pace's arithmetic with a
fake clock, population in chunks, and a warmed heap serving later allocations without faults."""
from __future__ import annotations

import mmap
import os
import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from autops.transport import prefault


class FakeClock:
    """The thread's CPU clock and the sleeps, under the test's control."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.slept: list[float] = []

    def work(self, seconds: float):
        def run() -> str:
            self.cpu += seconds
            return "done"
        return run


def test_a_step_is_followed_by_a_pause_that_keeps_the_work_to_its_share():
    clock = FakeClock()
    pace = prefault.Pace(0.25, sleep=clock.slept.append, cpu=lambda: clock.cpu)
    assert pace.step(clock.work(0.010)) == "done"
    assert pace.step(clock.work(0.002)) == "done"
    # 0.25 of a core: every CPU second is followed by three seconds asleep
    assert clock.slept == pytest.approx([0.030, 0.006])
    assert pace.cpu_s == pytest.approx(0.012) and pace.paused_s == pytest.approx(0.036)
    assert pace.cpu_s / (pace.cpu_s + pace.paused_s) == pytest.approx(0.25)


def test_a_whole_core_never_pauses_and_a_share_outside_0_1_is_refused():
    clock = FakeClock()
    pace = prefault.Pace(1.0, sleep=clock.slept.append, cpu=lambda: clock.cpu)
    pace.step(clock.work(0.5))
    assert clock.slept == [] and pace.paused_s == 0.0
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError):
            prefault.Pace(bad)


class FakeHost:
    """The host's CPU pressure (seconds some task waited for a CPU) and the wall clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stall = 0.0

    def run(self, seconds: float, stalled: float) -> None:
        self.now += seconds
        self.stall += seconds * stalled


def test_host_load_is_the_share_of_its_window_some_task_waited_for_a_cpu():
    host = FakeHost()
    load = prefault.HostLoad(window=0.1, stall=lambda: host.stall, clock=lambda: host.now)
    assert load.stalled() is None            # no history yet
    host.run(0.05, stalled=0.5)
    assert load.stalled() is None            # half a window
    host.run(0.05, stalled=0.5)
    assert load.stalled() == pytest.approx(0.5)
    for _ in range(10):                      # the window slides: only its last 0.1 s count
        host.run(0.02, stalled=0.0)
        load.stalled()
    assert load.stalled() == pytest.approx(0.0)
    assert load.core_free()
    host.run(0.02, stalled=1.0)              # a fifth of the window with a task waiting
    assert not load.core_free()


def test_without_pressure_information_the_host_never_has_a_core_to_spare():
    load = prefault.HostLoad(stall=lambda: None)
    assert not load.available and load.stalled() is None and not load.core_free()
    assert prefault.cpu_stall_s("/nonexistent/pressure") is None


class FakeWorld:
    """One clock for the wall time, this thread's CPU and the host's CPU pressure: sleeping
    and working advance it; in the ``busy`` stretches of time, tasks wait for a CPU
    ``stalled`` of the time."""

    def __init__(self) -> None:
        self.now = self.cpu = self.stall = 0.0
        self.busy: list[tuple[float, float]] = []
        self.stalled = 0.8
        self.slept: list[float] = []

    def advance(self, seconds: float) -> None:
        begin, self.now = self.now, self.now + seconds
        for start, end in self.busy:
            self.stall += max(0.0, min(end, self.now) - max(start, begin)) * self.stalled

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)

    def work(self, seconds: float):
        def run() -> None:
            self.cpu += seconds
            self.advance(seconds)
        return run

    def pace(self, share: float, patience: float = 1.0) -> prefault.Pace:
        load = prefault.HostLoad(window=0.1, stall=lambda: self.stall, clock=lambda: self.now)
        return prefault.Pace(share, sleep=self.sleep, cpu=lambda: self.cpu, load=load, clock=lambda: self.now,
                             patience=patience, poll=0.02)


def test_with_a_host_load_steps_go_unpaused_on_idle_cpu_and_wait_while_tasks_wait_for_one():
    world = FakeWorld()
    pace = world.pace(0.25)
    pace.step(world.work(0.01))
    # the load needs a window of history first: it polled until it had one, then went on
    assert world.slept == pytest.approx([0.02] * 5) and pace.waited_s == pytest.approx(0.1)
    for _ in range(20):                     # nobody waits for a CPU: no pauses
        pace.step(world.work(0.01))
    assert len(world.slept) == 5 and pace.idle_cpu_s == pytest.approx(0.21)
    world.busy.append((world.now, world.now + 0.5))      # a communication phase of 0.5 s begins
    world.advance(0.05)
    pace.step(world.work(0.01))             # waits for it to end, and for a window without it
    end = world.busy[-1][1]
    assert end + 0.1 - 0.02 <= world.now - 0.01 <= end + 0.1 + 0.02
    assert pace.cpu_s == pace.idle_cpu_s == pytest.approx(0.22) and pace.paused_s == 0.0


def test_a_host_busy_for_longer_than_the_patience_gets_the_steps_at_the_share():
    world = FakeWorld()
    pace = world.pace(0.25, patience=1.0)
    world.busy.append((0.0, float("inf")))     # tasks always wait for a CPU
    pace.step(world.work(0.01))
    assert pace.waited_s == pytest.approx(1.0)          # it waited its patience out
    assert world.slept[-1] == pytest.approx(0.03)      # then went at a quarter of a core
    for _ in range(9):
        pace.step(world.work(0.01))
    assert world.slept[-9:] == pytest.approx([0.03] * 9)
    assert pace.idle_cpu_s == 0.0 and pace.paused_s == pytest.approx(3 * pace.cpu_s)


def test_with_a_quiet_probe_steps_wait_for_the_gap_between_communication_phases():
    """The service's own jobs communicate from 0.1 to 0.6 s: a step asked for in that phase
    runs only once it is over, while the host (busy all along) gets it at the share."""
    world = FakeWorld()
    world.busy.append((0.0, float("inf")))
    phases = [(0.1, 0.6)]
    quiet = lambda: not any(start <= world.now < end for start, end in phases)     # noqa: E731
    pace = prefault.Pace(0.25, sleep=world.sleep, cpu=lambda: world.cpu, clock=lambda: world.now,
                         poll=0.02, quiet=quiet, quiet_patience=5.0)
    world.advance(0.1)
    began = []
    pace.step(lambda: (began.append(world.now), world.work(0.01)()))
    assert 0.6 - 1e-9 <= began[0] <= 0.6 + 0.02         # it began in the gap after the phase
    assert pace.waited_s == pytest.approx(0.5, abs=0.021)
    assert world.slept[-1] == pytest.approx(0.03)      # and was paused for the others' sake
    pace.step(world.work(0.01))                         # in the gap: no wait
    assert pace.waited_s == pytest.approx(0.5, abs=0.021) and pace.idle_cpu_s == 0.0


def test_a_service_never_quiet_for_longer_than_the_patience_still_gets_its_steps():
    world = FakeWorld()
    pace = prefault.Pace(0.5, sleep=world.sleep, cpu=lambda: world.cpu, clock=lambda: world.now,
                         poll=0.02, quiet=lambda: False, quiet_patience=2.0)
    pace.step(world.work(0.01))
    assert pace.waited_s == pytest.approx(2.0)
    for _ in range(5):                      # the patience is spent for this stretch: no more waits
        pace.step(world.work(0.01))
    assert pace.waited_s == pytest.approx(2.0) and pace.cpu_s == pytest.approx(0.06)


def test_a_pace_at_a_whole_core_neither_waits_for_quiet_nor_pauses():
    world = FakeWorld()
    pace = prefault.Pace(1.0, sleep=world.sleep, cpu=lambda: world.cpu, clock=lambda: world.now,
                         quiet=lambda: False)
    pace.step(world.work(0.01))
    assert world.slept == [] and pace.waited_s == 0.0


def test_this_hosts_cpu_pressure_counts_processes_waiting_for_a_cpu():
    """Two spinning processes more than the host has cores: at any moment some wait, so the
    stall time grows by about the time they spin (half of it is asked)."""
    if prefault.cpu_stall_s() is None:
        pytest.skip(f"this kernel reports no CPU pressure ({prefault.CPU_PRESSURE}: PSI off)")
    spin_s = 0.5
    code = f"import time\nend = time.monotonic() + {spin_s}\nwhile time.monotonic() < end:\n    pass\n"
    before = prefault.cpu_stall_s()
    spinners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range((os.cpu_count() or 1) + 2)]
    for proc in spinners:
        proc.wait(timeout=30)
    assert prefault.cpu_stall_s() - before >= spin_s / 2


def needs_populate() -> None:
    if not prefault.CAN_POPULATE:
        pytest.skip("this kernel cannot populate memory through madvise(MADV_POPULATE_WRITE)")


def faults_touching(array: np.ndarray) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    array[::mmap.PAGESIZE] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


class CountingPace(prefault.Pace):
    def __init__(self) -> None:
        super().__init__(1.0)
        self.steps = 0

    def step(self, work):
        self.steps += 1
        return super().step(work)


def test_population_goes_chunk_by_chunk(monkeypatch):
    needs_populate()
    monkeypatch.setattr(prefault, "CHUNK", 64 * mmap.PAGESIZE)
    pages = 1000                                   # 15 full chunks and a part
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    try:
        pace = CountingPace()
        assert prefault.populate_buffer(region, pace)
        assert pace.steps == 16
        view = np.frombuffer(region, np.uint8)
        faults = faults_touching(view)
        del view
    finally:
        region.close()
    assert faults < pages // 8, f"{faults} page faults touching {pages} populated pages"


def test_a_fresh_mapping_faults_on_every_page_without_population():
    """The control for the test above: the fault count does tell populated from not."""
    pages = 1000
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    try:
        view = np.frombuffer(region, np.uint8)
        faults = faults_touching(view)
        del view
    finally:
        region.close()
    assert faults >= pages // 2


WARM_PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from autops.transport import prefault
    from autops.transport.zmq import heap_kept, keep_freed_buffers
    assert heap_kept() == 0
    assert keep_freed_buffers(one_arena=True)
    assert heap_kept() == 1 << 30
    warm = int(sys.argv[1])
    warmed = prefault.warm_heap(warm) if warm else 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.empty(4 << 20, np.uint8) for _ in range(8)]     # 32 MiB, as received messages
    for b in blocks:
        b[::4096] = 1
    print(warmed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults_after_warming(nbytes: int) -> tuple[int, int]:
    """(bytes warmed, page faults of then allocating and touching 32 MiB), in a fresh process:
    the malloc settings are process-wide."""
    done = subprocess.run([sys.executable, "-c", WARM_PROBE, str(nbytes)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    warmed, faults = done.stdout.split()
    return int(warmed), int(faults)


def test_a_warmed_heap_serves_received_buffers_without_page_faults():
    needs_populate()
    warmed, faults = faults_after_warming(48 << 20)
    assert warmed >= 48 << 20
    _, cold = faults_after_warming(0)
    pages = (32 << 20) // mmap.PAGESIZE
    # the control: a cold heap faults on every page, or every few (the kernel may fault in
    # a few pages at once)
    assert cold >= pages // 8, cold
    assert faults < cold // 16, (faults, cold)


FENCE_PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from autops.transport import prefault
    from autops.transport.zmq import keep_freed_buffers
    assert keep_freed_buffers(trim_threshold=16 << 20, one_arena=True)   # glibc keeps 16 MiB of free top
    warmed = prefault.warm_heap(96 << 20, fence=sys.argv[1] == "fence")
    free = prefault.heap_free()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.zeros(4 << 20, np.uint8) for _ in range(16)]         # 64 MiB, as a job's state
    for a in arrays:
        a[::4096] = 1
    print(warmed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, free, prefault.heap_free())
""")


@pytest.mark.parametrize("fence", [True, False])
def test_a_fenced_warm_heap_stays_mapped_beyond_the_trim_threshold(fence):
    """``warm_heap(fence=True)``, an aggregator's reserve: with one block left allocated above
    them, the freed blocks stay mapped although they are far more than glibc's trim threshold,
    and a job's arrays allocated next take no page fault. Without the fence they join the
    heap's top and glibc gives them back: every page faults again."""
    needs_populate()
    done = subprocess.run([sys.executable, "-c", FENCE_PROBE, "fence" if fence else "none"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    warmed, faults, free, free_after = map(int, done.stdout.split())
    pages = (64 << 20) // mmap.PAGESIZE
    assert warmed >= 96 << 20
    if fence:
        assert faults < pages // 16, (faults, pages)
        # heap_free, which the room check counts, sees the fenced blocks, and the arrays taken from them
        assert free >= 80 << 20 and free - free_after >= 60 << 20, (free, free_after)
    else:
        assert faults >= pages // 8, (faults, pages)
        assert free <= 17 << 20, free           # no more than the trim threshold stayed


def test_a_malloc_threshold_beyond_a_c_int_is_refused_not_truncated():
    from autops.transport.zmq import keep_freed_buffers
    with pytest.raises(ValueError, match="outside"):
        keep_freed_buffers(trim_threshold=4 << 30)


def test_zeroed_arrays_are_zero_private_and_populated():
    """Large arrays are populated (touching them does not fault); all are zero-filled,
    writable and of the asked shape."""
    needs_populate()
    numel = 1000 * mmap.PAGESIZE // 4
    big, small = prefault.zeroed_arrays([(numel, "float32"), (100, "float64")], CountingPace())
    assert big.shape == (numel,) and big.dtype == np.float32 and small.shape == (100,) and small.dtype == np.float64
    assert not big.any() and not small.any() and big.flags.writeable and small.flags.writeable
    faults = faults_touching(big.view(np.uint8))
    assert faults < 1000 // 8, f"{faults} page faults touching 1000 populated pages"
