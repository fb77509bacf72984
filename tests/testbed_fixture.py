"""Emulated hosts for tests: ``from testbed_fixture import testbed, emulated_hosts``.

``testbed`` is a function-scoped fixture factory::

    def test_x(testbed):
        tb = testbed(hosts=3, link="1gbit")       # an up dlrt_bench.testbed.Testbed
        tb.hosts[0].popen([...])

It skips the test with the reason when ``dlrt_bench.testbed.available()`` gives one (not root, no
``tc``, no netem for a ``delay``), removes what a killed earlier run left under the same
prefix before building, and always tears down (processes, namespaces, links), also when the
test fails. The prefix is derived from the test module's name (and a counter, for a second
testbed in one test), so it is the same in every run and differs between modules:
leftovers of a SIGKILLed run are found and removed by the next one.

``emulated_hosts(hosts, link, delay, prefix=...)`` is the same as a context manager, for
fixtures of a wider scope (one testbed for a module's tests).

Emulated hosts talk over addresses beyond loopback, so the tests run them the way a cluster
should run: with CURVE. Each testbed gets a fresh cluster key directory
(``dlrt.keys.temporary_cluster``) that ``$DLRT_KEYS`` points at while it is up, for the test
process and every process started on its hosts; ``secure=False`` keeps the session's
plaintext directory.
"""
from __future__ import annotations

import contextlib
import itertools
import zlib
from typing import Callable, Iterator

import pytest

from dlrt.keys import temporary_cluster
from dlrt_bench.testbed import Testbed, available, cleanup

__all__ = ["testbed", "emulated_hosts", "prefix_for"]


def prefix_for(name: str, index: int = 0) -> str:
    """A testbed prefix for test module ``name``: stable across runs, short enough for
    interface names (``t`` + 6 hex digits + the index)."""
    return f"t{zlib.crc32(name.encode()) & 0xFFFFFF:06x}{index}"


@contextlib.contextmanager
def emulated_hosts(hosts: int = 2, link: str | None = "1gbit", delay: str | None = None, *,
                   prefix: str, secure: bool = True) -> Iterator[Testbed]:
    """An up testbed, removed on exit; skips the calling test when none can be built here."""
    reason = available(delay=delay is not None)
    if reason:
        pytest.skip(f"emulated hosts unavailable: {reason}")
    cleanup(prefix)
    tb = Testbed(hosts, link=link, delay=delay, prefix=prefix)
    with contextlib.ExitStack() as stack:
        if secure:
            stack.enter_context(temporary_cluster())
        try:
            yield tb.up()
        finally:
            tb.down()


@pytest.fixture
def testbed(request: pytest.FixtureRequest) -> Iterator[Callable[..., Testbed]]:
    """A factory ``testbed(hosts=2, link="1gbit", delay=None, prefix=None) -> Testbed``; every
    testbed it made is torn down when the test ends."""
    counter = itertools.count()

    with contextlib.ExitStack() as stack:
        def make(hosts: int = 2, link: str | None = "1gbit", delay: str | None = None,
                 prefix: str | None = None, secure: bool = True) -> Testbed:
            name = prefix or prefix_for(request.module.__name__, next(counter))
            return stack.enter_context(emulated_hosts(hosts, link, delay, prefix=name, secure=secure))

        yield make
