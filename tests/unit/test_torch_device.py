"""Staging of device tensors (``autops.worker.device``) with fake device operations on CPU
tensors: the push sees the tensor's bytes only after its copy to the host finished, pushes
leave in the order they were staged (from the caller's thread when it comes back to the
stager, else from the stager thread), the result is copied back on ``wait()``, and errors
reach the caller. (The real CUDA path runs in tests/gpu.)"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from autops.worker.device import DeviceStager


class FakeOps:
    """Synchronous stand-ins for CUDA: an event is a threading.Event the test releases."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.events: list[threading.Event] = []
        self.log: list[str] = []

    def pinned_like(self, t):
        return torch.empty(t.numel(), dtype=t.dtype)

    def to_host(self, src, dst):
        dst.copy_(src.reshape(-1))
        event = threading.Event()
        if not self.hold:
            event.set()
        self.events.append(event)
        return event

    def done(self, event):
        return event.is_set()

    def wait_event(self, event):
        assert event.wait(10)

    def to_device(self, src, dst):
        self.log.append("to_device")
        dst.view(-1).copy_(src)


class Done:
    def wait(self, timeout=None):
        pass


def test_the_push_sees_the_host_copy_and_the_result_comes_back_on_wait():
    ops = FakeOps()
    stager = DeviceStager(ops)
    grad = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    seen = []

    def start(arr: np.ndarray):
        seen.append(arr.copy())
        arr *= 10                       # the service writes its result into the same buffer
        return Done()

    handle = stager.submit("w", grad, start, result=grad)
    handle.wait(5)
    assert np.array_equal(seen[0], np.arange(6, dtype=np.float32))
    assert torch.equal(grad, torch.arange(6, dtype=torch.float32).reshape(2, 3) * 10)
    handle.wait(5)
    assert ops.log == ["to_device"], "a second wait copies nothing"
    stager.close()


def test_pushes_wait_for_their_copy_and_leave_in_order():
    ops = FakeOps(hold=True)
    stager = DeviceStager(ops)
    started = []
    handles = [stager.submit(n, torch.ones(3), lambda a, n=n: started.append(n) or Done()) for n in "abc"]
    assert started == [], "no push before its copy to the host finished"
    for event in ops.events:
        event.set()
    for h in handles:
        h.wait(5)
    assert started == ["a", "b", "c"]
    stager.close()


def test_buffers_are_reused_per_name():
    stager = DeviceStager(FakeOps())
    a = stager.buffer("w", "io", torch.ones(4))
    assert stager.buffer("w", "io", torch.zeros(4)) is a
    assert stager.buffer("w", "io", torch.zeros(5)) is not a
    stager.close()


def test_an_error_of_the_push_reaches_wait():
    stager = DeviceStager(FakeOps())

    def start(arr):
        raise RuntimeError("refused")

    handle = stager.submit("w", torch.ones(2), start, result=torch.ones(2))
    with pytest.raises(RuntimeError, match="refused"):
        handle.wait(5)
    stager.close()


def test_a_finished_copy_is_handed_over_by_the_caller_at_its_next_call():
    ops = FakeOps(hold=True)
    stager = DeviceStager(ops, grace=60.0)      # the stager thread would wait a minute
    threads = []

    def start(arr):
        threads.append(threading.current_thread().name)
        return Done()

    first = stager.submit("a", torch.ones(2), start)
    ops.events[0].set()                          # a's copy is done; b's is not
    second = stager.submit("b", torch.ones(2), start)
    assert threads == [threading.current_thread().name], "staging b handed a over, not b"
    ops.events[1].set()
    second.wait(5)
    first.wait(5)
    assert threads == [threading.current_thread().name] * 2
    stager.close()


def test_the_stager_thread_hands_over_what_no_caller_came_back_for():
    ops = FakeOps(hold=True)
    stager = DeviceStager(ops, grace=0.0)
    started = threading.Event()
    threads = []

    def start(arr):
        threads.append(threading.current_thread().name)
        started.set()
        return Done()

    stager.submit("a", torch.ones(2), start)
    assert not started.is_set()
    ops.events[0].set()
    assert started.wait(10), "the copy is done and nobody calls: the stager thread pushes"
    assert threads == ["autops-stager"]
    stager.close()
