"""Fixtures of the Infiniswap unit tests that talk to a data server:
``from slab_fixtures import store, server  # noqa: F401`` and a ``slab_size`` fixture in the
module. ``store``: a ``SlabStore`` of 8 slabs; ``server``: a ``DataServer`` over it on
127.0.0.1 (the session's cluster key); both closed afterwards."""
from __future__ import annotations

import pytest

from infiniswap.core import DataServer, SlabStore


@pytest.fixture
def store(slab_size: int):
    s = SlabStore(8 * slab_size, slab_size, lock=False)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def server(store):
    srv = DataServer(store, "127.0.0.1", 0)
    try:
        yield srv
    finally:
        srv.stop()


def lease(st: SlabStore) -> tuple[int, int]:
    """A new slab of the store as a daemon lends it: (region offset, generation)."""
    region = st.alloc_slab()
    return region, st.generation(region)
