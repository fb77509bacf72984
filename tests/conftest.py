"""Shared fixtures: an embedded pool (pMaster + aggregators as real processes on loopback), a ZeroMQ context."""
from __future__ import annotations

import pytest


@pytest.fixture
def pool2():
    """pMaster and 2 aggregators, always stopped by pid afterwards."""
    from autops.local import LocalPool
    pool = LocalPool(2)
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def pool1():
    from autops.local import LocalPool
    pool = LocalPool(1)
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def ctx():
    """A ZeroMQ context for the transports under test, terminated afterwards."""
    from autops.transport import make_context
    context = make_context()
    yield context
    context.term()
