"""The daemon's per-peer record policy (infiniswap/peerrecords.py) and limits
(infiniswap/limits.py), on a fake clock: expiry after the TTL, the cap dropping the least
recently seen record, proven lease holders never dropped, the per-identity rate."""
from __future__ import annotations

import pytest

from infiniswap.limits import ControlLimits, DataLimits, default_max_connections
from infiniswap.peerrecords import PeerRecords


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def table(max_peers=3, ttl=10.0, rate=2.0, burst=4.0, pinned=frozenset()):
    clock, dropped = Clock(), []
    recs = PeerRecords(max_peers, ttl, rate, burst, pinned=lambda p: p in pinned, clock=clock,
                       on_drop=lambda peer, rec: dropped.append((peer, rec.shm)))
    return recs, clock, dropped


def test_records_expire_after_the_ttl_unless_seen_again():
    recs, clock, dropped = table()
    recs.seen(b"a")
    recs.get(b"a").shm = (5, 6)
    clock.t += 6
    recs.seen(b"b")
    clock.t += 5                                    # a: 11 s unseen, b: 5 s
    assert recs.expire() == [b"a"] and list(recs) == [b"b"]
    assert dropped == [(b"a", (5, 6))] and recs.expired == 1
    clock.t += 4
    recs.seen(b"b")                                 # seen again: its clock restarts
    clock.t += 9
    assert recs.expire() == [] and b"b" in recs


def test_the_cap_drops_the_least_recently_seen_record():
    recs, clock, dropped = table(max_peers=3)
    for peer in (b"a", b"b", b"c"):
        recs.seen(peer)
        clock.t += 1
    recs.seen(b"a")                                 # a is the most recent now
    recs.seen(b"d")
    assert list(recs) == [b"c", b"a", b"d"] and recs.dropped == 1
    assert [peer for peer, _ in dropped] == [b"b"]


def test_a_proven_lease_holder_is_never_dropped():
    holders = {b"dev"}
    recs, clock, _ = table(max_peers=2, pinned=holders)
    recs.seen(b"dev").proven = True
    recs.seen(b"unproven-holder")                   # pinned only once proven
    clock.t += 100
    assert recs.expire() == [b"unproven-holder"] and list(recs) == [b"dev"]
    for i in range(50):                             # a flood of identities
        recs.seen(b"x%d" % i)
    assert b"dev" in recs and len(recs) == 2 and recs.dropped == 49
    holders.clear()                                 # its leases ended: an ordinary record
    clock.t += 100
    assert set(recs.expire()) == {b"dev", b"x49"}


def test_no_room_when_every_record_is_pinned():
    recs, _, _ = table(max_peers=1, pinned={b"dev"})
    recs.seen(b"dev").proven = True
    assert recs.seen(b"other") is None and recs.refused == 1 and list(recs) == [b"dev"]
    assert not recs.allow(b"other")


def test_the_rate_limits_unproven_identities_only():
    recs, clock, _ = table(rate=2.0, burst=4.0)
    recs.seen(b"a")
    assert [recs.allow(b"a") for _ in range(6)] == [True] * 4 + [False] * 2
    assert recs.limited == 2
    clock.t += 1.0                                  # two tokens back
    assert [recs.allow(b"a") for _ in range(3)] == [True, True, False]
    clock.t += 100.0                                # never more than the burst
    assert sum(recs.allow(b"a") for _ in range(10)) == 4
    recs.seen(b"dev").proven = True
    assert all(recs.allow(b"dev") for _ in range(100))


def test_forget_drops_through_on_drop():
    recs, _, dropped = table()
    recs.seen(b"a")
    recs.forget(b"a")
    recs.forget(b"never-seen")
    assert dropped == [(b"a", (0, 0))] and len(recs) == 0


def test_default_connection_cap_is_half_the_open_file_limit_within_bounds():
    assert default_max_connections(1024) == 512
    assert default_max_connections(20) == 16
    assert default_max_connections(1 << 20) == 4096


def test_limits_come_from_the_environment_and_bad_values_fall_back():
    ctl = ControlLimits.from_env({"INFINISWAP_CTL_MAX_PEERS": "64", "INFINISWAP_CTL_RATE": "5",
                                  "INFINISWAP_CTL_PEER_TTL_S": "-1"})
    assert (ctl.max_peers, ctl.rate, ctl.burst, ctl.peer_ttl) == (64, 5.0, 15.0, 300.0)
    opts = ctl.socket_options()
    assert opts["SNDHWM"] == ctl.sndhwm and opts["MAXMSGSIZE"] == ctl.max_message
    data = DataLimits.from_env({"INFINISWAP_DATA_MAX_CONNECTIONS": "40",
                                "INFINISWAP_DATA_HANDSHAKE_S": "nope"})
    assert (data.max_connections, data.handshake_timeout) == (40, 2.0)
    with pytest.raises(ValueError):
        DataLimits(0)
    with pytest.raises(ValueError):
        ControlLimits(sndhwm=0)
