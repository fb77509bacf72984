"""Shared fixtures: an embedded pool (pMaster + aggregators as real processes on loopback), a ZeroMQ context."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# The key directory of every service and client the tests start: a fresh one per session, never
# the user's ~/.dlrt/keys (which would turn CURVE on, or be written to by a first start). Tests
# that want CURVE make their own with dlrt.keys.init_keys and point DLRT_KEYS at it.
os.environ["DLRT_KEYS"] = tempfile.mkdtemp(prefix="dlrt-test-keys-")
atexit.register(shutil.rmtree, os.environ["DLRT_KEYS"], True)


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


@pytest.fixture(scope="module")
def pool2_cma():
    """pMaster and 2 aggregators that also listen on cma (the rdma protocol, READs by
    process_vm_readv); skips where this machine cannot use cma."""
    from autops.local import LocalPool
    from autops.transport.cma import available
    if available() is not None:
        pytest.skip(f"cma unavailable: {available()}")
    pool = LocalPool(2, aggregator_args=["--transport", "cma"])
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
