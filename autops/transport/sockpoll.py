"""Channels and listeners over plain sockets (``rdma.py``, ``stream.py``): what a service's
``zmq.Poller`` watches for them (an epoll descriptor over the connection sockets and a
waker), the sender a listener's message replies to, and the channel and listener over
connections (*links*) that each transport makes its own way.

A link has ``fd``, ``broken`` (None, or why it failed and closed), ``wants_write``,
``send(header, payloads)``, ``pump()`` (flush output, read what arrived; never blocks),
``next_message()`` (``(header, payloads)`` or None), ``has_records`` (messages may be
waiting that no descriptor will announce), ``wants_pump`` (worth pumping without a
readable descriptor) and ``close()``. A ``LinkBudget`` is one connection cap shared by
every listener of a process that is given it (``links.Transport``: the tcp ``stream`` and
the ``ipc`` endpoints), so a peer connecting to all of them holds no more than the cap.
"""
from __future__ import annotations

import errno
import logging
import select
import socket
import time
from abc import abstractmethod
from collections import deque
from typing import Any, Iterable, Sequence

from dlrt.waker import Waker

from ..config import MAX_LINKS_ENV
from .base import Channel, Inbound, Listener, TransportError

log = logging.getLogger("autops.transport")

_NO_LENT: frozenset = frozenset()

# Limits on connections nobody has vouched for (docs/autops.md, "Limits on connections"):
# a listener that sets them (``StreamListener``, from ``TransportConfig``) closes a connection
# that has not delivered a whole message within its ``handshake_s``, and one that delivered
# some but never became a job's channel (``PeerLink.vouch``) once idle for its ``idle_s``; the
# listeners sharing a ``LinkBudget`` keep at most its ``max_links`` connections together (the
# oldest one not vouched for, on any of them, makes room for a new one, else the new one is
# closed); and where accept fails for want of descriptors a listener stops accepting for
# ACCEPT_PAUSE_S, logging once per LOG_EVERY_S.
ACCEPT_PAUSE_S = 0.5
LOG_EVERY_S = 10.0
_HOUSEKEEP_EVERY_S = 0.25


def oldest_unvouched(connections: Iterable[tuple[Any, bool, bool, float]]) -> Any:
    """Which connection makes room for a new one: of ``(key, greeted, vouched, since)``, the
    key of the oldest not vouched for -- one still in its handshake (not ``greeted``) before
    one that delivered a message -- or None when every one is a job's channel."""
    best, rank = None, None
    for key, greeted, vouched, since in connections:
        if vouched:
            continue
        if rank is None or (greeted, since) < rank:
            best, rank = key, (greeted, since)
    return best


class LinkBudget:
    """At most ``max_links`` connections (None: no cap) over every ``LinkListener`` sharing
    this budget (each joins it when made, and leaves it when closed): one cap per process
    however many endpoints it listens on."""

    def __init__(self, max_links: int | None) -> None:
        if max_links is not None and max_links < 1:
            raise ValueError(f"max_links must be at least 1, not {max_links}")
        self.max_links = max_links
        self.listeners: list["LinkListener"] = []

    def join(self, listener: "LinkListener") -> None:
        if listener not in self.listeners:
            self.listeners.append(listener)

    def leave(self, listener: "LinkListener") -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def held(self) -> int:
        """Connections held by the listeners sharing the budget."""
        return sum(len(listener.links) for listener in self.listeners)

    def make_room(self) -> bool:
        """Whether one more connection may come in: under the cap, or once the oldest
        connection not vouched for on any listener (``oldest_unvouched``) was closed."""
        if self.max_links is None or self.held() < self.max_links:
            return True
        victim = oldest_unvouched(((listener, fd), greeted, vouched, since) for listener in self.listeners
                                  for fd, greeted, vouched, since in listener.connections())
        if victim is None:
            return False
        listener, fd = victim
        listener.evict(fd)
        return True


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

    def vouch(self) -> None:
        """The service served a request of a job on this connection (its secret was right):
        a job's channel, kept however long it is idle and never closed to make room."""
        self.listener.vouch(self.link)


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
    messages are taken from the links in turn, each answered on its own. ``budget`` (a
    ``LinkBudget``, shared with the process's other listeners; None: no cap), ``handshake_s``
    and ``idle_s`` (None: no limit) bound the connections nobody vouched for (see the
    limits above); ``housekeep`` applies the deadlines, from ``recv`` and from the
    service's loop."""

    budget: LinkBudget | None = None
    handshake_s: float | None = None
    idle_s: float | None = None

    @property
    def max_links(self) -> int | None:
        """The cap on the connections of every listener sharing this one's budget."""
        return self.budget.max_links if self.budget is not None else None

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.poll = SocketPoll()
        self.poll.add(sock.fileno())
        self.links: dict[int, Any] = {}
        self._senders: dict[int, PeerLink] = {}
        self._since: dict[int, float] = {}      # fd -> when accepted, then when its last message came
        self._greeted: set[int] = set()         # fds that delivered a whole message
        self._vouched: set[int] = set()         # fds that are a job's channel
        self._accept_paused_until = 0.0
        self._housekept = 0.0
        self._logged: dict[str, float] = {}     # what was logged (rate-limited) -> when
        self._quiet: dict[str, int] = {}        # what was not logged since, how often
        self.limit_counts = {"refused_over_cap": 0, "evicted": 0, "handshake_timeouts": 0,
                             "idle_timeouts": 0, "accept_pauses": 0}
        if self.budget is not None:
            self.budget.join(self)

    @abstractmethod
    def _link_for(self, sock: socket.socket, peer: Any) -> Any:
        """The link over an accepted connection."""

    @property
    def pollable(self) -> int:
        return self.poll.fileno()

    def recv(self) -> Inbound | None:
        ready = self.poll.ready()
        now = time.monotonic()
        if now - self._housekept >= _HOUSEKEEP_EVERY_S:
            self.housekeep(now)
        if self.sock.fileno() in ready and self._accept_paused_until == 0.0:
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
                    self._greeted.add(fd)
                    self._since[fd] = now
                    if link.has_records:
                        self.poll.waker.wake()     # messages wait that no descriptor will announce
                    return Inbound(message[0], message[1], _NO_LENT, sender)
            if link.broken is not None:
                self._drop(fd)
        self.poll.waker.clear()
        return None

    def _say(self, what: str, message: str, *args: Any) -> None:
        """A warning about ``what``, at most once per LOG_EVERY_S (with how often it was not said)."""
        now = time.monotonic()
        if now - self._logged.get(what, -LOG_EVERY_S) < LOG_EVERY_S:
            self._quiet[what] = self._quiet.get(what, 0) + 1
            return
        self._logged[what] = now
        quiet = self._quiet.pop(what, 0)
        log.warning("%s: " + message + (f" ({quiet} more like it not logged)" if quiet else ""),
                    self.kind, *args)

    def housekeep(self, now: float | None = None) -> None:
        """Close connections past their handshake deadline or idle timeout, and accept again
        after a pause (cheap; the service's loop calls it every turn)."""
        now = time.monotonic() if now is None else now
        self._housekept = now
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self.poll.add(self.sock.fileno())
        if self.handshake_s is None and self.idle_s is None:
            return
        for fd, since in list(self._since.items()):
            if fd in self._vouched:
                continue
            greeted = fd in self._greeted
            limit = self.idle_s if greeted else self.handshake_s
            if limit is None or now - since < limit:
                continue
            link = self.links.get(fd)
            if link is None:
                self._drop(fd)
                continue
            self.limit_counts["idle_timeouts" if greeted else "handshake_timeouts"] += 1
            self._say("idle" if greeted else "handshake", "closed %s: %s", link.name,
                      f"idle for {limit:g}s and not a job's channel" if greeted
                      else f"no whole message within {limit:g}s of connecting")
            self._close_link(fd, link)

    def _close_link(self, fd: int, link: Any) -> None:
        self._drop(fd)
        try:
            link.close()
        except OSError:
            pass

    def _make_room(self) -> bool:
        """Whether a new connection may come in under the budget's cap: the oldest connection
        not vouched for on any listener sharing it -- one still in its handshake first -- is
        closed to make room (``LinkBudget.make_room``)."""
        return self.budget is None or self.budget.make_room()

    def connections(self) -> list[tuple[int, bool, bool, float]]:
        """``(fd, greeted, vouched, since)`` of every connection held (``oldest_unvouched``)."""
        return [(fd, fd in self._greeted, fd in self._vouched, since) for fd, since in self._since.items()
                if fd in self.links]

    def evict(self, fd: int) -> None:
        """Close connection ``fd`` (not a job's channel) to make room for a new one on a
        listener sharing this one's budget."""
        link = self.links[fd]
        self.limit_counts["evicted"] += 1
        self._say("evict", "%d connections (the limit for the process, $%s): closed %s, not a job's channel, "
                  "for a new one", self.max_links, MAX_LINKS_ENV, link.name)
        self._close_link(fd, link)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # the listening socket stays readable: stop watching it for a while, or
                    # this loop spins on it (and logs) until descriptors are free again
                    self.limit_counts["accept_pauses"] += 1
                    self._say("accept", "cannot accept a connection (%s): not accepting for %gs",
                              exc.strerror or exc, ACCEPT_PAUSE_S)
                    self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
                    self.poll.remove(self.sock.fileno())
                    return
                raise
            if not self._make_room():
                self.limit_counts["refused_over_cap"] += 1
                self._say("cap", "%d connections, every one a job's channel (the limit, $%s): refused one "
                          "from %s", self.max_links, MAX_LINKS_ENV, peer)
                sock.close()
                continue
            link = self._link_for(sock, peer)
            fd = link.fd
            self._drop(fd)                          # a closed link whose number was reused
            self.links[fd] = link
            self._senders[fd] = PeerLink(self, link)
            self._since[fd] = time.monotonic()
            self.poll.add(fd)

    def vouch(self, link: Any) -> None:
        if self.links.get(link.fd) is link:
            self._vouched.add(link.fd)

    def track(self, link: Any) -> None:
        if link.broken is None:
            self.poll.want_write(link.fd, link.wants_write)

    def sending(self) -> bool:
        return self.poll.writing()

    def _drop(self, fd: int) -> None:
        self.poll.remove(fd)
        self.links.pop(fd, None)
        self._senders.pop(fd, None)
        self._since.pop(fd, None)
        self._greeted.discard(fd)
        self._vouched.discard(fd)

    def close(self) -> None:
        if self.budget is not None:
            self.budget.leave(self)
        for fd, link in list(self.links.items()):
            self.poll.remove(fd)
            link.close()
        self.links.clear()
        self._senders.clear()
        self._since.clear()
        self._greeted.clear()
        self._vouched.clear()
        self.sock.close()
        self.poll.close()
