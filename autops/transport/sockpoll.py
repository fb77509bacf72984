"""Channels and listeners over plain sockets (``rdma.py``, ``stream.py``): what a service's
``zmq.Poller`` watches for them (an epoll descriptor over the connection sockets and a
waker), and the sender a listener's message replies to."""
from __future__ import annotations

import select
from collections import deque
from typing import Any, Sequence

from dlrt.waker import Waker


def first_n(items: deque, n: int):
    """The first ``n`` items of ``items`` (a ``sendmsg`` takes at most so many buffers)."""
    for i, item in enumerate(items):
        if i == n:
            return
        yield item


class SocketPoll:
    """An epoll descriptor over sockets (readable, and writable while output waits) and a
    waker: what ``zmq.Poller`` watches for a channel or a listener."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.waker = Waker()
        self.epoll.register(self.waker.fd, select.EPOLLIN)
        self._writing: set[int] = set()

    def fileno(self) -> int:
        return self.epoll.fileno()

    def add(self, fd: int) -> None:
        self.epoll.register(fd, select.EPOLLIN)

    def remove(self, fd: int) -> None:
        self._writing.discard(fd)
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass

    def want_write(self, fd: int, pending: bool) -> None:
        if pending != (fd in self._writing):
            (self._writing.add if pending else self._writing.discard)(fd)
            self.epoll.modify(fd, select.EPOLLIN | (select.EPOLLOUT if pending else 0))

    def ready(self) -> set[int]:
        return {fd for fd, _ in self.epoll.poll(0)}

    def close(self) -> None:
        self.epoll.close()
        self.waker.close()


class PeerLink:
    """The sender of one message at a listener over such sockets: replies go back on its
    connection (``link``), and the listener watches it for writing while output waits."""

    __slots__ = ("listener", "link")

    def __init__(self, listener: Any, link: Any) -> None:
        self.listener, self.link = listener, link

    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        self.link.send(header, payloads)
        self.listener.track(self.link)
