"""Memory made ready ahead of use (``autops.transport.prefault``): the pace's arithmetic with a
fake clock, population in chunks, and a warmed heap serving later allocations without faults."""
from __future__ import annotations

import mmap
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
