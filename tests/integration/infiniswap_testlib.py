"""Helpers shared by the Infiniswap integration tests: polling with a deadline, and a thread
that keeps a device busy and checks every page it reads back."""
from __future__ import annotations

import time


def wait_until(cond, timeout: float, what: str, step: float = 0.02) -> None:
    """Poll ``cond()`` every ``step`` seconds; fail the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class PageChurn:
    """A thread that writes and reads random page ranges of ``dev`` (keeping its slabs hot)
    and checks every read against its own model of the device; ``reads`` counts the reads
    checked, ``errors`` names any mismatch (the thread then stops)."""

    def __init__(self, dev, pages: int, seed: int = 0, page: int = 4096) -> None:
        import random
        import threading

        self._dev, self._pages, self._page = dev, pages, page
        self._rng = random.Random(seed)
        self.model = bytearray(pages * page)
        self.reads = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="page-churn", daemon=True)

    def start(self) -> "PageChurn":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _range(self) -> tuple[int, int]:
        first = self._rng.randrange(self._pages)
        return first, min(self._rng.randint(1, 16), self._pages - first)

    def _run(self) -> None:
        p = self._page
        try:
            while not self._stop.is_set():
                first, n = self._range()
                data = self._rng.randbytes(n * p)
                self._dev.write(first * p, data)
                self.model[first * p:(first + n) * p] = data
                first, n = self._range()
                got = self._dev.read(first * p, n * p)
                if got != self.model[first * p:(first + n) * p]:
                    bad = next(i for i in range(n) if got[i * p:(i + 1) * p] !=
                               self.model[(first + i) * p:(first + i + 1) * p])
                    self.errors.append(f"page {first + bad} read back wrong after "
                                       f"{self.reads} good reads")
                    return
                self.reads += 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"I/O failed: {exc!r}")


def map_proof(sock, identity: bytes, key: bytes | None = None) -> dict:
    """The ``proof`` field a raw DEALER (routing id ``identity``) puts in its MAP: the answer to
    the daemon's challenge (from a PONG) with the cluster key (default: the key directory's)."""
    from dlrt.keys import ensure_cluster_secret
    from infiniswap import protocol as p
    from infiniswap.ctlauth import device_proof

    sock.send(p.encode(p.PING, id=4242))
    while True:
        assert sock.poll(5000), "no PONG from the daemon"
        pong = p.decode(sock.recv())
        if pong.op == p.PONG and pong.id == 4242:
            break
    return {"proof": device_proof(key or ensure_cluster_secret(), pong["challenge"], identity)}


def stalled_device_loses_its_lease(daemon, stalled, other, used: list, *, slab: int = 1 << 20,
                                   taken_back=lambda: None, gave_up=lambda stalled: True) -> None:
    """The fence, end to end: ``stalled``'s control thread stalls past the daemon's EVICT
    timeout while the machine needs its memory (``used[0]``, what the daemon's memory reader
    returns); the daemon takes the slab back (``taken_back()`` then checks what the transport
    did), lends the same memory to ``other``, and the stalled device's reads and writes of its
    old mapping go to its backup file, never to that memory; once it resumes it gives the
    slab up (``gave_up(stalled)``). Closes both devices."""
    import os
    import threading

    from infiniswap.core import SlabState

    in_stall, resume = threading.Event(), threading.Event()

    def stall() -> None:        # (test hook) occupy the stalled device's control thread
        in_stall.set()
        resume.wait(30)
    staller = threading.Thread(target=lambda: stalled._ctl.call(stall))
    try:
        try:
            assert stalled.map_now([0]) == 1
            mine = os.urandom(slab)
            stalled.write(0, mine)                  # in the daemon's memory (and on disk)
            before = stalled.core.slab_info(0)
            assert before.bytes_written_remote == slab
            staller.start()
            assert in_stall.wait(5)

            used[0] = 8 * slab      # the machine needs its memory: the slab must go, and the
            wait_until(lambda: daemon.stats()["devices_lost"] == 1 and     # device never answers
                       daemon.stats()["allocated_bytes"] == 0, 10,
                       "the daemon to take the slab back and release its memory")
            taken_back()
            used[0] = 0
            wait_until(lambda: daemon.stats()["slabs_free"] == 1, 10, "memory to lend again")
            assert other.map_now([0]) == 1
            theirs = os.urandom(slab)
            other.write(0, theirs)
            lent = other.core.slab_info(0)
            assert lent.region_offset == before.region_offset       # the same memory, lent again
            assert lent.generation != before.generation

            # The stalled device has heard nothing: it still maps the slab, old generation.
            old = stalled.core.slab_info(0)
            assert (old.state, old.region_offset, old.generation, old.bits_set) == (
                SlabState.MAPPED, before.region_offset, before.generation, slab // 4096)
            assert stalled.read(0, slab) == mine        # refused remotely: its backup file
            newer = os.urandom(slab)
            stalled.write(0, newer)                     # refused remotely: its backup file
            assert stalled.read(0, slab) == newer
            io = stalled.stats()["io"]
            assert io["bytes_read_remote"] == 0 and io["remote_errors"] == 1
            assert other.read(0, slab) == theirs        # from the daemon's memory, intact
            assert other.stats()["io"]["bytes_read_remote"] == slab
        finally:
            resume.set()
            staller.join(10)
        wait_until(lambda: gave_up(stalled) and stalled.core.slab_info(0).state is SlabState.UNMAPPED, 10,
                   "the stalled device to give the slab up once it resumes")
        assert stalled.read(0, slab) == newer and other.read(0, slab) == theirs
        assert daemon.stats()["devices"] == {"other": [0]}
    finally:
        stalled.close()
        other.close()


class ControlPeer:
    """One DEALER connected to a daemon's control socket (with the default CURVE keys) and
    kept for the whole test, so the test can ask for STATUS when the daemon could not accept
    a new connection (out of descriptors).  ``close()`` when done."""

    def __init__(self, address: str) -> None:
        import zmq

        from dlrt.curve import default_security
        from dlrt.endpoints import endpoint
        from infiniswap.channel import context

        ep = endpoint(address)
        self._sock = context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        default_security().client(self._sock, ep)
        self._sock.connect(ep)
        self._id = 0

    def status(self, timeout: float = 10.0) -> dict:
        """The daemon's report (its STATUS reply)."""
        from infiniswap import protocol as p

        self._id += 1
        self._sock.send(p.encode(p.STATUS, id=self._id))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self._sock.poll(int(left * 1000)), "no STATUS reply"
            reply = p.decode(self._sock.recv_multipart()[-1])
            if reply.id == self._id:
                assert reply.op == p.REPORT, reply
                return reply["report"]

    def close(self) -> None:
        self._sock.close(0)


def proven_data_connection(address: str, key: bytes | None = None, timeout: float = 1.0):
    """A TCP connection to the data server at ``address`` (host:port) that proved the cluster
    key (default: the key directory's) with ``infiniswap.handshake``; ``TimeoutError`` when the
    server's HELLO or VERDICT does not come within ``timeout`` (the socket is closed then)."""
    import socket

    from dlrt.keys import ensure_cluster_secret
    from infiniswap.handshake import client_handshake

    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        client_handshake(s, key or ensure_cluster_secret())
    except BaseException:
        s.close()
        raise
    return s
