"""What the agent's callers wait on and what its I/O thread completes: ``Handle`` (one
asynchronous operation on one tensor), ``StateHandle`` (a fetch of a tensor's server-side
state) and ``Part`` (one key of one operation in flight, which completes its handle)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..transport import Shared
from ..wire.partition import KeySpec
from .errors import AutoPSError

log = logging.getLogger("autops.worker.agent")


class Flusher(Protocol):
    """What a handle's ``wait`` needs of the agent that made it."""
    timeout: float

    def flush(self) -> None: ...


class Handle:
    """Completion of one asynchronous operation on one tensor (all its keys)."""

    @classmethod
    def of(cls, name: str, agent: Flusher, specs: list[KeySpec], parts: int) -> "Handle":
        """A handle for ``parts`` requests on ``specs``; ``batched`` is known before the I/O
        thread sees the operation, so a ``wait()`` right after submitting flushes the batch."""
        handle = cls(name, agent)
        handle._add(parts)
        handle.batched = any(spec.small for spec in specs)
        return handle

    def __init__(self, name: str, agent: Flusher | None) -> None:
        self.name = name
        self._agent = agent
        self._pending = 0
        self._lock = threading.Lock()
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.batched = False     # has parts waiting in a small-key batch
        self.done_at: float | None = None    # time.monotonic() when it completed

    def _add(self, n: int = 1) -> None:
        with self._lock:
            self._pending += n

    def _part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._pending -= 1
            if self._pending <= 0:
                self._complete()

    def _seal(self) -> None:
        with self._lock:
            if self._pending <= 0:
                self._complete()

    def _complete(self) -> None:
        if self.done_at is None:
            self.done_at = time.monotonic()
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; re-raises the service's error."""
        if self.batched and not self._event.is_set():
            self._agent.flush()
        if not self._event.wait(timeout if timeout is not None else self._agent.timeout * 2 + 5):
            raise TimeoutError(f"operation on {self.name!r} did not complete")
        if self.error is not None:
            raise self.error


def fail_pending(handle: Handle, error: BaseException) -> None:
    """Fail every part of ``handle`` still pending (its command failed in the I/O thread)."""
    while handle._pending > 0:
        handle._part_done(error)


class StateHandle(Handle):
    """A fetch of one tensor's server-side state; after ``wait()``: ``param`` (the master
    copy), ``state`` (optimizer arrays under torch's names) and ``step``, all flat."""

    def __init__(self, name: str, agent: Flusher, numel: int, dtype: str) -> None:
        super().__init__(name, agent)
        self.param = np.empty(numel, dtype)
        self.state: dict[str, np.ndarray] = {}
        self.step = 0

    def _absorb(self, spec: KeySpec, meta: dict, arrays: list[np.ndarray]) -> None:
        """Place one key's part of the state (I/O thread; read by the user after ``wait``)."""
        names = list(meta.get("state") or [])
        if len(arrays) != 1 + len(names) or any(a.size != spec.numel for a in arrays):
            raise AutoPSError(f"state of {spec.key!r}: {len(arrays)} arrays for {len(names)} state "
                              f"entries of {spec.numel} elements")
        sl = slice(spec.offset, spec.offset + spec.numel)
        self.param[sl] = arrays[0]
        for name, arr in zip(names, arrays[1:]):
            if name not in self.state:
                self.state[name] = np.zeros_like(self.param)
            self.state[name][sl] = arr
        self.step = int(meta.get("step") or 0)


class BackgroundHandle(Handle):
    """The handle of a request nobody waits for (a push replayed after a failure)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, None)
        self._add(1 << 30)

    def _part_done(self, error: BaseException | None = None) -> None:
        if error is not None:
            log.error("replayed push of %s: %s", self.name, error)


@dataclass
class Part:
    """One key of one operation in flight; a push with ``out`` is a push_pull (PUSH_PULL:
    the aggregator answers it with the value of its iteration) and stands for two parts of
    its handle."""
    spec: KeySpec
    handle: Handle
    iteration: int
    data: np.ndarray | None = None     # push: the slice sent
    out: np.ndarray | None = None      # pull: where the reply is copied
    hp: dict | None = None             # push: changed hyper-parameters (server mode)
    staged: Shared | None = None       # push: the slice, copied into memory the transport lends

    @property
    def fused(self) -> bool:
        return self.data is not None and self.out is not None

    def finish(self, error: BaseException | None = None) -> None:
        """Complete this part (both halves of a push_pull) on its handle."""
        self.handle._part_done(error)
        if self.fused:
            self.handle._part_done(error)

    def absorb(self, meta: dict, arrays: list[np.ndarray]) -> None:
        """Place this key's part of a fetched state in its ``StateHandle`` (``finish_state`` completes it)."""
        self.handle._absorb(self.spec, meta, arrays)

    def finish_state(self, error: BaseException | None = None) -> None:
        """Complete this key of a state fetch on its handle (one part, whatever the request was)."""
        self.handle._part_done(error)

    def halves(self) -> tuple["Part", "Part"]:
        """A push_pull as a plain push and a plain pull (resent separately after a failure)."""
        return (Part(self.spec, self.handle, self.iteration, data=self.data, hp=self.hp),
                Part(self.spec, self.handle, self.iteration, out=self.out))
