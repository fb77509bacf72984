"""The aggregator's store without sockets: accumulation, publishing, validation."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autops.aggregator.optim import make_optimizer
from autops.wire.partition import KeySpec
from autops.aggregator.store import Store, StoreError

SPEC = KeySpec("w", "w", 0, 6, "float32", False)


def store(world=3, mode="sum", average=False, **kw):
    s = Store()
    s.assign("j", "secret", world, mode, [SPEC], average=average, **kw)
    return s, s.jobs["j"], s.jobs["j"].keys["w"]


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.data())
def test_no_update_lost_or_applied_twice(world, iterations, data):
    """Any arrival order of the ranks' pushes, each inline (socket) or deferred (shared
    memory), publishes exactly the sum of every rank's push of that iteration."""
    s, job, ks = store(world)
    for it in range(1, iterations + 1):
        order = data.draw(st.permutations(range(world)))
        pushes = {r: np.full(6, float(r * 10 + it), np.float32) for r in range(world)}
        for i, r in enumerate(order):
            assert not s.pull_ready(ks, it)
            deferred = data.draw(st.booleans())
            s.check_push(job, r, "w", it, pushes[r])
            done = s.push(ks, r, pushes[r], deferred=deferred)
            assert done == (i == world - 1)
        assert s.pull_ready(ks, it)
        np.testing.assert_array_equal(ks.value(it), sum(pushes.values()))
        with pytest.raises(StoreError, match="open iteration"):
            s.check_push(job, 0, "w", it, pushes[0])       # a replayed push is refused


def test_previous_iteration_stays_readable_while_the_next_accumulates():
    s, job, ks = store(2)
    for r in (0, 1):
        s.push(s.check_push(job, r, "w", 1, np.ones(6, np.float32)), r, np.ones(6, np.float32))
    s.push(s.check_push(job, 0, "w", 2, np.full(6, 5, np.float32)), 0, np.full(6, 5, np.float32))
    np.testing.assert_array_equal(ks.value(1), 2.0)          # a slow worker still reads iteration 1
    assert not s.pull_ready(ks, 2)
    with pytest.raises(StoreError, match="ahead"):
        s.pull_ready(ks, 3)


def test_validation_leaves_state_unchanged():
    s, job, ks = store(2)
    with pytest.raises(StoreError, match="expected 6 x float32"):
        s.check_push(job, 0, "w", 1, np.ones(5, np.float32))
    with pytest.raises(StoreError, match="rank 2 outside"):
        s.check_push(job, 2, "w", 1, np.ones(6, np.float32))
    with pytest.raises(StoreError, match="wrong secret"):
        s.job("j", "guess")
    with pytest.raises(StoreError, match="not declared"):
        s.key(job, "nope")
    assert ks.ranks == set() and ks.completed == 0


def test_server_mode_waits_for_init_and_applies_the_optimizer():
    s, job, ks = store(2, "server", average=True, optimizer="sgd", hp={"lr": 0.5})
    assert not s.pull_ready(ks, 0) and not s.pull_ready(ks, 1)     # no master copy yet: wait
    g0, g1 = np.full(6, 1.0, np.float32), np.full(6, 3.0, np.float32)
    s.push(s.check_push(job, 0, "w", 1, g0), 0, g0, deferred=True)
    assert not s.push(s.check_push(job, 1, "w", 1, g1), 1, g1)      # complete, but waits for INIT
    assert s.init(job, "w", np.full(6, 10.0, np.float32))
    ref = np.full(6, 10.0, np.float32)
    make_optimizer("sgd", {"lr": 0.5}).step(ref, np.full(6, 2.0, np.float32))
    np.testing.assert_array_equal(ks.value(1), ref)                  # 10 - 0.5 * mean(1, 3) = 9
    assert s.pull_ready(ks, 1)


def test_broadcast_is_kept_until_every_other_rank_read_it():
    s, job, _ = store(3)
    s.bcast_put(job, "x", 0, np.arange(4, dtype=np.uint8))
    assert s.bcast_get(job, "x", 0) is not None
    assert s.bcast_get(job, "x", 0) is not None
    assert s.bcast_get(job, "x", 0) is None and not job.broadcasts


def test_server_keys_take_their_accumulator_and_optimizer_state_from_arrays_given_ahead():
    """``private_sizes`` names what a server-mode key needs beside its master copy (gradient
    accumulator, optimizer slots); ``assign`` puts given arrays there and the key computes as
    with its own."""
    specs = [SPEC, KeySpec("v", "v", 0, 4, "float64", False)]
    assert Store.private_sizes("sum", None, None, specs) == []
    sizes = Store.private_sizes("server", "adam", {"lr": 0.1}, specs)
    assert sizes == [(6, "float32")] * 3 + [(4, "float64")] * 3
    private = [np.zeros(n, d) for n, d in sizes]
    s = Store()
    s.assign("j", "secret", 2, "server", specs, average=True, optimizer="adam", hp={"lr": 0.1}, private=private)
    ks = s.jobs["j"].keys["w"]
    assert ks.accumulator() is private[0]
    assert {id(a) for a in ks.optimizer.state_arrays().values()} == {id(private[1]), id(private[2])}
    ref, _, ref_ks = store(2, "server", average=True, optimizer="adam", hp={"lr": 0.1})
    for st_ in (s, ref):
        job = st_.jobs["j"]
        st_.init(job, "w", np.full(6, 10.0, np.float32))
        for rank, value in ((0, 1.0), (1, 3.0)):
            g = np.full(6, value, np.float32)
            st_.push(st_.check_push(job, rank, "w", 1, g), rank, g)
    np.testing.assert_array_equal(ks.value(1), ref_ks.value(1))
    with pytest.raises(ValueError):
        Store.private_sizes("server", "nope", {}, specs)
