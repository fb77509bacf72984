"""What the agent's user threads hand its I/O thread: one small class per command (made by
the ``Agent``'s methods, carried out by ``IOLoop.command``) and ``CommandQueue``, the queue
they travel on, with the waker whose descriptor the I/O thread polls."""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import ClassVar, Iterator, Union

import numpy as np

from dlrt.waker import Waker

from ..wire.partition import KeySpec
from .handles import Handle, StateHandle
from .table import Table


@dataclass(frozen=True, slots=True, eq=False)
class PushCmd:
    """Push ``flat`` for ``iteration``; with ``out``, a push_pull that pulls the result into it."""
    kind: ClassVar[str] = "push"
    specs: list[KeySpec]
    flat: np.ndarray
    iteration: int
    handle: Handle
    hp: dict | None
    out: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class PullCmd:
    """Pull the value of ``iteration`` into ``flat``."""
    kind: ClassVar[str] = "pull"
    specs: list[KeySpec]
    flat: np.ndarray
    iteration: int
    handle: Handle


@dataclass(frozen=True, slots=True, eq=False)
class InitCmd:
    """Server mode: set the master copy (``flat``), optimizer ``state`` and ``step`` of a tensor."""
    kind: ClassVar[str] = "init"
    specs: list[KeySpec]
    flat: np.ndarray
    handle: Handle
    hp: dict | None
    state: dict[str, np.ndarray]
    step: int


@dataclass(frozen=True, slots=True, eq=False)
class StateCmd:
    """Server mode: fetch a tensor's state as it is right after ``iteration``."""
    kind: ClassVar[str] = "state"
    specs: list[KeySpec]
    iteration: int
    handle: StateHandle


@dataclass(frozen=True, slots=True, eq=False)
class BcastCmd:
    """Broadcast ``flat`` of rank ``root`` (the ``seq``-th broadcast of ``name``)."""
    kind: ClassVar[str] = "bcast"
    name: str
    flat: np.ndarray
    root: int
    seq: int
    handle: Handle


@dataclass(frozen=True, slots=True, eq=False)
class FlushCmd:
    """Send the batched small keys now."""
    kind: ClassVar[str] = "flush"


@dataclass(frozen=True, slots=True, eq=False)
class TableCmd:
    """Route by ``table`` from now on (the commands before it were routed by the old one)."""
    kind: ClassVar[str] = "table"
    table: Table


@dataclass(frozen=True, slots=True, eq=False)
class StopCmd:
    """Send what is batched and stop the I/O thread."""
    kind: ClassVar[str] = "stop"


Command = Union[PushCmd, PullCmd, InitCmd, StateCmd, BcastCmd, FlushCmd, TableCmd, StopCmd]


class CommandQueue:
    """Commands from any thread to the I/O thread: ``put`` queues one and wakes the I/O
    thread, which polls ``fd``, calls ``clear`` when it woke and then takes them (``drain``)."""

    def __init__(self) -> None:
        self._cmds: collections.deque[Command] = collections.deque()
        self._waker = Waker()

    @property
    def fd(self) -> int:
        return self._waker.fd

    def put(self, cmd: Command) -> None:
        self._cmds.append(cmd)
        self._waker.wake()

    def clear(self) -> None:
        """The I/O thread woke up: accept wakes again (before it looks at the queue)."""
        self._waker.clear()

    def drain(self) -> Iterator[Command]:
        """The commands queued, oldest first, until the queue is empty (commands put meanwhile
        included); a command not taken yet stays queued."""
        while self._cmds:
            yield self._cmds.popleft()

    def close(self) -> None:
        self._waker.close()
