"""CUDA tensors for the parameter service: pinned host staging that overlaps communication.

AutoPS moves host memory. ``DeviceStager.push_pull`` takes a tensor on a GPU:

1. it copies the tensor into a pinned host buffer on a side stream, after the work already
   queued on the current stream (autograd's), and records an event -- the training thread
   goes on at once, so the copy overlaps the rest of backward;
2. the host buffer goes to the agent once the copy is done, staged tensors in the order they
   came: from the caller's thread when it stages the next tensor or waits for one (every
   staged tensor whose copy is done by then), else from the stager thread, which waits for
   the oldest copy and hands it over if no caller did within ``grace`` seconds. (A thread
   per hand-over made the two threads take the GIL from each other for every tensor: about
   60 us a tensor on an H200 machine, against 30 us for the copy's launch.)
3. ``wait()`` on the returned handle waits for the result (in a pinned buffer), copies it
   back into the device tensor on the side stream, and makes the current stream wait for
   that copy, so whatever the caller queues next sees the result.

The device operations (buffers, streams, events) go through ``CudaOps``; tests pass a fake
that runs them synchronously on CPU tensors to check the ordering and copies without a GPU.
One stager per training process; its pinned buffers are kept per name and reused.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np
import torch

from dlrt.procs import name_this_thread

__all__ = ["CudaOps", "DeviceStager", "StagedHandle", "host_array", "HAND_OVER_GRACE_S"]

HAND_OVER_GRACE_S = 0.002   # how long the stager thread leaves a finished copy to the callers


def host_array(t: torch.Tensor) -> np.ndarray:
    """The flat numpy view of a contiguous CPU tensor (shares its memory)."""
    return t.detach().reshape(-1).numpy()


class CudaOps:
    """What staging needs from CUDA: pinned buffers, one side stream, events."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Queue ``dst <- src`` after the current stream's work; returns an event to wait on."""
        current = torch.cuda.current_stream(src.device)
        self.stream.wait_stream(current)
        self._on_side_stream(current, dst, src.detach().reshape(-1))
        src.record_stream(self.stream)       # src's memory is not reused before the copy ran
        return self.stream.record_event()

    def done(self, event: Any) -> bool:
        return event.query()

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``dst <- src`` and make the current stream wait for it."""
        current = torch.cuda.current_stream(dst.device)
        self._on_side_stream(current, dst.view(-1), src)
        current.wait_stream(self.stream)

    def _on_side_stream(self, current: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        # set_stream directly: torch.cuda.stream()'s context costs as much again as the copy's launch
        torch.cuda.set_stream(self.stream)
        try:
            dst.copy_(src, non_blocking=True)
        finally:
            torch.cuda.set_stream(current)


class StagedHandle:
    """Completion of one staged operation: ``wait()`` also copies the result back."""

    def __init__(self, submitted: Future, finish: Callable[[], None],
                 hand_over: Callable[[Future], None]) -> None:
        self._submitted = submitted
        self._finish = finish
        self._hand_over = hand_over
        self._done = False

    def submitted(self, timeout: float | None = None) -> Any:
        """Wait until the operation was handed to the agent (from this thread, if it is the
        first to get there); its handle."""
        if not self._submitted.done():
            self._hand_over(self._submitted)
        return self._submitted.result(timeout)

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        self.submitted(timeout).wait(timeout)
        self._finish()
        self._done = True


class DeviceStager:
    """Stages device tensors through pinned host buffers for an agent's operations."""

    def __init__(self, ops: Any | None = None, grace: float = HAND_OVER_GRACE_S) -> None:
        self.ops = ops if ops is not None else CudaOps()
        self.grace = grace
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._staged: deque = deque()          # (event, start, submitted), oldest first
        self._order = threading.Lock()         # one hand-over at a time: the order is kept
        self._arrived = threading.Condition()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autops-stager", daemon=True)
        self._thread.start()

    def buffer(self, name: str, role: str, like: torch.Tensor) -> torch.Tensor:
        """The pinned host buffer ``role`` of ``name`` (made on first use, then reused)."""
        buf = self._buffers.get((name, role))
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype:
            buf = self._buffers[(name, role)] = self.ops.pinned_like(like)
        return buf

    def submit(self, name: str, tensor: torch.Tensor, start: Callable[[np.ndarray], Any],
               result: torch.Tensor | None = None) -> StagedHandle:
        """Copy ``tensor`` to the host, then ``start(host_array)`` (once the copy is done, from
        whichever thread gets there first) must return a handle whose result lands in that same
        array; ``wait()`` copies it back into ``result`` (a device tensor; None: nothing comes back)."""
        host = self.buffer(name, "io", tensor)
        event = self.ops.to_host(tensor, host)
        submitted: Future = Future()
        with self._arrived:
            self._staged.append((event, lambda: start(host_array(host)), submitted))
            self._arrived.notify()
        self.hand_over()                       # the earlier tensors whose copies are done

        def finish() -> None:
            if result is not None:
                self.ops.to_device(host, result)
        return StagedHandle(submitted, finish, self.hand_over)

    def hand_over(self, until: Future | None = None) -> None:
        """Start the staged operations whose copies are done, oldest first; with ``until``,
        also wait for copies until that operation has started."""
        with self._order:
            while self._staged:
                event, start, submitted = self._staged[0]
                if not self.ops.done(event):
                    if until is None or until.done():
                        return
                    self.ops.wait_event(event)
                self._staged.popleft()
                try:
                    submitted.set_result(start())
                except BaseException as exc:      # the caller's wait() raises it
                    submitted.set_exception(exc)

    def _run(self) -> None:
        """Hand over what no caller did: the oldest copy, ``grace`` seconds after it is done."""
        name_this_thread()
        while True:
            with self._arrived:
                while not self._staged and not self._closing.is_set():
                    self._arrived.wait()
                if not self._staged:
                    return
                oldest = self._staged[0]
            self.ops.wait_event(oldest[0])
            self._closing.wait(self.grace)
            if self._staged and self._staged[0] is oldest:
                self.hand_over()

    def close(self) -> None:
        """Stop the stager thread once everything staged was handed over."""
        self._closing.set()
        with self._arrived:
            self._arrived.notify()
        self._thread.join(10)
