"""Channels and listeners over plain sockets (``rdma.py``, ``stream.py``): what a service's
``zmq.Poller`` watches for them (an epoll descriptor over the connection sockets and a
waker), the sender a listener's message replies to, and the channel and listener over
connections (*links*) that each transport makes its own way.

A link has ``fd``, ``broken`` (None, or why it failed and closed), ``wants_write``,
``send(header, payloads)``, ``pump()`` (flush output, read what arrived; never blocks),
``next_message()`` (``(header, payloads)`` or None), ``has_records`` (messages may be
waiting that no descriptor will announce), ``wants_pump`` (worth pumping without a
readable descriptor) and ``close()``.
"""
from __future__ import annotations

import errno
import logging
import select
import socket
from abc import abstractmethod
from collections import deque
from typing import Any, Sequence

from dlrt.waker import Waker

from .base import Channel, Inbound, Listener, TransportError

log = logging.getLogger("autops.transport")

_NO_LENT: frozenset = frozenset()


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

    def writing(self) -> bool:
        """Whether output waits on some socket (safe to ask from another thread)."""
        return bool(self._writing)

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


class LinkChannel(Channel):
    """A connection to one peer's listener, made by ``_dial`` on the first ``send`` and
    again after it broke (a message it cannot send then is dropped with a warning: the
    caller's request timeouts take over); replies come back on it."""

    def __init__(self) -> None:
        self.poll = SocketPoll()
        self.link: Any = None

    @abstractmethod
    def _dial(self) -> Any:
        """A new link to the peer (OSError or TransportError when it cannot be reached)."""

    @property
    def pollable(self) -> int:
        return self.poll.fileno()

    def send(self, header: bytes, payloads: Sequence = ()) -> None:
        try:
            link = self._connected()
        except (OSError, TransportError) as exc:
            log.warning("%s: dropped a message to %s (cannot connect: %s)", self.kind, self.address, exc)
            return
        link.send(header, payloads)
        self._track(link)

    def open(self) -> None:
        try:
            self._connected()
        except (OSError, TransportError) as exc:
            log.info("%s: cannot connect to %s ahead (%s); sending will try again", self.kind, self.address, exc)

    def _connected(self) -> Any:
        """The link, dialled now if there is none or it broke (OSError or TransportError when
        the peer cannot be reached)."""
        link = self.link
        if link is None or link.broken is not None:
            self._forget()
            link = self._dial()
            self.link = link
            if link.broken is None:
                self.poll.add(link.fd)
        return link

    def recv(self) -> Inbound | None:
        link = self.link
        if link is None:
            self.poll.waker.clear()
            return None
        link.pump()
        message = link.next_message()
        self._track(link)
        if message is None:
            self.poll.waker.clear()
            return None
        if link.has_records:
            self.poll.waker.wake()
        return Inbound(message[0], message[1], _NO_LENT, self)

    def _track(self, link: Any) -> None:
        if link.broken is None:
            self.poll.want_write(link.fd, link.wants_write)

    def _forget(self) -> None:
        if self.link is not None:
            self.poll.remove(self.link.fd)
            self.link.close()
            self.link = None

    def close(self) -> None:
        self._forget()
        self.poll.close()


class LinkListener(Listener):
    """A bound, listening ``sock`` whose connections each become a link (``_link_for``);
    messages are taken from the links in turn, each answered on its own."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.poll = SocketPoll()
        self.poll.add(sock.fileno())
        self.links: dict[int, Any] = {}
        self._senders: dict[int, PeerLink] = {}

    @abstractmethod
    def _link_for(self, sock: socket.socket, peer: Any) -> Any:
        """The link over an accepted connection."""

    @property
    def pollable(self) -> int:
        return self.poll.fileno()

    def recv(self) -> Inbound | None:
        ready = self.poll.ready()
        if self.sock.fileno() in ready:
            self._accept()
        for fd, link in list(self.links.items()):
            if link.broken is None and (fd in ready or link.wants_pump):
                link.pump()
                message = link.next_message()
                self.track(link)
                if message is not None:
                    sender = self._senders[fd]
                    del self.links[fd]             # to the back of the queue: fair to the others
                    self.links[fd] = link
                    if link.has_records:
                        self.poll.waker.wake()     # messages wait that no descriptor will announce
                    return Inbound(message[0], message[1], _NO_LENT, sender)
            if link.broken is not None:
                self._drop(fd)
        self.poll.waker.clear()
        return None

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("%s: cannot accept a connection: %s", self.kind, exc)
                    return
                raise
            link = self._link_for(sock, peer)
            fd = link.fd
            self._drop(fd)                          # a closed link whose number was reused
            self.links[fd] = link
            self._senders[fd] = PeerLink(self, link)
            self.poll.add(fd)

    def track(self, link: Any) -> None:
        if link.broken is None:
            self.poll.want_write(link.fd, link.wants_write)

    def sending(self) -> bool:
        return self.poll.writing()

    def _drop(self, fd: int) -> None:
        self.poll.remove(fd)
        self.links.pop(fd, None)
        self._senders.pop(fd, None)

    def close(self) -> None:
        for fd, link in list(self.links.items()):
            self.poll.remove(fd)
            link.close()
        self.links.clear()
        self._senders.clear()
        self.sock.close()
        self.poll.close()
