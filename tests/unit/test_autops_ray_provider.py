"""pMaster's Ray provider (``autops.master.rayprovider``) against a fake Ray: no Ray, no processes.

The fake keeps alive nodes with CPUs and named actors placed the way Ray would (SPREAD: the
node with the most free CPUs; a soft node affinity: that node while it has a free CPU, else
anywhere; none free: pending). Its aggregators exit on SIGTERM unless told to ignore it. The
provider's clock is a fake too, so the kill after ``kill_after`` and the give-up after
``start_timeout`` are exact. The real Ray is ``tests/integration/test_autops_ray_provider.py``.
"""
from __future__ import annotations

import logging
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

import pytest

from autops.master.providers import aggregator_command
from autops.master.rayapi import connect
from autops.master.rayprovider import RayProvider, actor_prefix, ray_provider
from dlrt.rayconn import RayUnreachable, check_address

MASTER = "tcp://10.0.0.1:5555"


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    cpus: float


class FakeRay:
    """What ``RayProvider`` asks of Ray, in memory."""

    def __init__(self, *nodes: Node) -> None:
        self.all = list(nodes)
        self.dead: set[str] = set()
        self.actors: dict[str, dict[str, Any]] = {}     # name -> {"node", "near", "master", "options"}
        self.signals: list[tuple[str, int]] = []
        self.kills: list[str] = []
        self.forgotten: list[str] = []
        self.stubborn: set[str] = set()                  # aggregators that ignore SIGTERM
        self.queries = 0
        self.closed = False

    # --- the interface ---------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        return [n for n in self.all if n.node_id not in self.dead]

    def free_cpus(self) -> float:
        return sum(self._free(n) for n in self.nodes())

    def live_actors(self, prefix: str) -> set[str]:
        self.queries += 1
        return {name for name in self.actors if name.startswith(prefix)}

    def start_actor(self, name: str, master: str, options: dict[str, Any], node_id: str | None = None) -> None:
        if name in self.actors:
            raise ValueError(f"The name {name} is already taken")
        self.actors[name] = {"node": None, "near": node_id, "master": master, "options": dict(options)}
        self.schedule()

    def placed(self, name: str) -> dict[str, Any] | None:
        actor = self.actors.get(name)
        if actor is None or actor["node"] is None:
            return None
        node = next(n for n in self.all if n.node_id == actor["node"])
        return {"node_id": node.node_id, "ip": node.ip, "pid": 1000 + len(name), "actor_pid": 2000 + len(name)}

    def signal(self, name: str, sig: int) -> None:
        self.signals.append((name, sig))
        if sig == signal.SIGTERM and name not in self.stubborn:
            self.actors.pop(name, None)          # the aggregator exits, its actor with it
            self.schedule()

    def kill(self, name: str) -> None:
        self.kills.append(name)
        self.actors.pop(name, None)
        self.schedule()

    def forget(self, name: str) -> None:
        self.forgotten.append(name)

    def close(self) -> None:
        self.closed = True

    # --- the test's hand on the cluster ----------------------------------------------------------
    def _free(self, node: Node) -> int:
        return int(node.cpus) - sum(1 for a in self.actors.values() if a["node"] == node.node_id)

    def schedule(self) -> None:
        """Place the pending actors, in the order they were asked for."""
        for actor in self.actors.values():
            if actor["node"] is not None:
                continue
            alive = [n for n in self.nodes() if self._free(n) > 0]
            near = [n for n in alive if n.node_id == actor["near"]]
            if near or alive:
                actor["node"] = (near or sorted(alive, key=lambda n: -self._free(n)))[0].node_id

    def lose(self, node_id: str) -> None:
        """The node leaves the cluster, its actors with it."""
        self.dead.add(node_id)
        for name in [n for n, a in self.actors.items() if a["node"] == node_id]:
            del self.actors[name]

    def on(self, name: str) -> str | None:
        return self.actors[name]["node"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


A = Node("aaaa" * 14, "10.0.0.11", 2.0)
B = Node("bbbb" * 14, "10.0.0.12", 2.0)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def provider(ray: FakeRay, clock: Clock, master: str = MASTER, **kw: Any) -> RayProvider:
    return RayProvider(master, ray, clock=clock, sleep=clock.sleep, **kw)


def test_the_actors_are_named_by_pmasters_address_and_spread_one_cpu_each(clock):
    ray = FakeRay(A, B)
    p = provider(ray, clock, orphan_timeout=7.0, log_level="INFO", transport="tcp")
    assert p.kind == "ray"
    names = p.start(2)
    prefix = actor_prefix("ray", MASTER)
    assert prefix.startswith("ray-") and len(prefix) == len("ray-12345678-") and prefix != actor_prefix("ray", "x")
    assert names == [f"{prefix}0", f"{prefix}1"]
    assert {ray.on(n) for n in names} == {A.node_id, B.node_id}          # spread over both nodes
    assert all(ray.actors[n]["near"] is None for n in names)
    assert ray.actors[names[0]] == {"node": A.node_id, "near": None, "master": MASTER,
                                    "options": {"log_level": "INFO", "transport": "tcp", "orphan_timeout": 7.0}}
    assert all(p.owns(n) for n in names) and not p.owns("agg-0")
    assert p.where(names[1])["ip"] == B.ip


def test_the_actor_runs_the_same_aggregator_command_as_the_local_provider():
    cmd = aggregator_command(MASTER, "ray-x-0", "10.0.0.12", log_level="INFO", transport="tcp", orphan_timeout=7.0)
    assert cmd[1:] == ["-m", "autops.cli", "--log-level", "INFO", "aggregator", "--master", MASTER,
                       "--name", "ray-x-0", "--bind-host", "10.0.0.12", "--transport", "tcp",
                       "--orphan-timeout", "7.0"]
    default = aggregator_command(MASTER, "local-0", "127.0.0.1")
    assert "--transport" not in default and default[-2] == "--orphan-timeout"


def test_near_asks_for_that_node_by_id_or_ip_and_spreads_when_it_is_unknown(clock, caplog):
    ray = FakeRay(A, B)
    p = provider(ray, clock)
    first = p.start(2, near=B.node_id)
    assert [ray.actors[n]["near"] for n in first] == [B.node_id, B.node_id]
    assert [ray.on(n) for n in first] == [B.node_id, B.node_id]
    (by_ip,) = p.start(1, near=A.ip)
    assert ray.actors[by_ip]["near"] == A.node_id and ray.on(by_ip) == A.node_id
    with caplog.at_level(logging.INFO, logger="autops.master.rayprovider"):
        (anywhere,) = p.start(1, near="10.9.9.9")
    assert ray.actors[anywhere]["near"] is None and "no alive Ray node 10.9.9.9" in caplog.text


def test_near_is_only_a_preference_a_full_node_sends_the_aggregator_elsewhere(clock):
    ray = FakeRay(A, B)
    p = provider(ray, clock)
    names = p.start(3, near=A.node_id)
    assert [ray.on(n) for n in names] == [A.node_id, A.node_id, B.node_id]


def test_capacity_counts_the_alive_nodes_whole_cpus_within_max_aggregators_plus_foreign_ones(clock):
    ray = FakeRay(A, B, Node("cccc" * 14, "10.0.0.13", 1.5))
    assert provider(ray, clock).capacity(0) == 5                 # 2 + 2 + 1
    p = provider(ray, clock, max_aggregators=3)
    assert p.capacity(0) == 3
    p.start(2)
    assert p.capacity(2) == 3                                     # its own are within the cap
    assert p.capacity(4) == 5                                     # two registered on their own
    ray.lose(B.node_id)
    assert provider(ray, clock).capacity(0) == 3


def test_can_start_is_the_free_cpus_less_pending_actors_within_max_aggregators(clock):
    ray = FakeRay(A, B)
    assert provider(ray, clock).can_start(0) == 4
    p = provider(ray, clock, max_aggregators=3)
    assert p.can_start(0) == 3
    assert len(p.start(5)) == 3 and p.can_start(0) == 0
    ray2 = FakeRay(A)
    q = provider(ray2, clock, master="tcp://10.0.0.2:5555")
    ray2.actors["someone-else"] = {"node": A.node_id, "near": None, "master": "", "options": {}}
    assert q.can_start(0) == 1                                    # Ray's free CPUs: one taken by another user
    assert q.start(3) == [f"{q.names}0"]
    ray2.all.append(B)                                            # a node joins: room again
    assert q.can_start(0) == 2


def test_actors_ray_has_not_placed_yet_are_not_counted_free_twice(clock):
    ray = FakeRay(A)
    p = provider(ray, clock)
    ray.actors["other-0"] = {"node": A.node_id, "near": None, "master": "", "options": {}}
    ray.actors["other-1"] = {"node": A.node_id, "near": None, "master": "", "options": {}}
    ray.all.append(B)
    (late,) = p.start(1)
    ray.actors[late]["node"] = None                               # Ray has not placed it yet
    assert ray.free_cpus() == 2 and p.can_start(0) == 1


def test_a_restarted_pmaster_adopts_its_own_actors_and_numbers_after_them(clock):
    ray = FakeRay(A, B, Node("cccc" * 14, "10.0.0.13", 1.0))
    first = provider(ray, clock)
    old = first.start(3)
    other = provider(ray, clock, master="tcp://10.0.0.2:5555")
    (foreign,) = other.start(1)
    ray.actors["ray-unrelated"] = {"node": None, "near": None, "master": "", "options": {}}
    ray.schedule()
    assert first.stop(old[1])                                     # exits at once in the fake
    again = provider(ray, clock)                                  # same address: same names
    assert sorted(again.actors) == [old[0], old[2]]
    assert again.owns(old[0]) and not again.owns(foreign) and not again.owns("ray-unrelated")
    assert again.start(1) == [f"{again.names}3"]                  # unique after the highest
    assert again.capacity(3) == 5 and again.can_start(0) == 0
    assert again.where(old[2])["node_id"] == ray.on(old[2])
    assert again.stop(old[0]) and (old[0], signal.SIGTERM) in ray.signals
    again.close()
    assert foreign in ray.actors and "ray-unrelated" in ray.actors     # not its own: left alone
    assert not any(n.startswith(again.names) for n in ray.actors)


def test_stop_sends_sigterm_and_kills_an_actor_still_there_after_kill_after(clock):
    ray = FakeRay(A, B)
    p = provider(ray, clock, kill_after=5.0, reap_period=0.0)
    quick, stubborn = p.start(2)
    ray.stubborn.add(stubborn)
    assert not p.stop("ray-not-mine-0")
    assert p.stop(quick) and p.stop(stubborn)
    assert ray.signals == [(quick, signal.SIGTERM), (stubborn, signal.SIGTERM)]
    assert not p.owns(quick) and not p.stop(quick)
    p.reap()
    assert quick in ray.forgotten and quick not in p.stopping and stubborn in p.stopping
    clock.now += 4.0
    p.reap()
    assert ray.kills == []
    clock.now += 1.5
    p.reap()
    assert ray.kills == [stubborn] and stubborn not in ray.actors
    clock.now += 1.0
    p.reap()
    assert ray.kills == [stubborn] and not p.stopping and stubborn in ray.forgotten


def test_reap_forgets_an_aggregator_lost_with_its_node_and_says_so(clock, caplog):
    ray = FakeRay(A, B)
    p = provider(ray, clock)
    names = p.start(2)
    on_b = next(n for n in names if ray.on(n) == B.node_id)
    on_a = next(n for n in names if ray.on(n) == A.node_id)
    assert p.where(on_b)["node_id"] == B.node_id
    ray.lose(B.node_id)
    with caplog.at_level(logging.WARNING, logger="autops.master.rayprovider"):
        clock.now += 1.0
        p.reap()
    assert not p.owns(on_b) and p.owns(on_a) and on_b in ray.forgotten
    assert f"aggregator {on_b} is gone with its Ray node {B.node_id} ({B.ip}), which left the cluster" in caplog.text
    assert p.capacity(1) == 2 and p.can_start(0) == 1
    ray.signal(on_a, signal.SIGTERM)                              # its aggregator exited by itself
    with caplog.at_level(logging.WARNING, logger="autops.master.rayprovider"):
        clock.now += 1.0
        p.reap()
    assert not p.owns(on_a) and f"aggregator {on_a} (Ray actor) exited" in caplog.text


def test_reap_asks_ray_at_most_once_per_period(clock):
    ray = FakeRay(A)
    p = provider(ray, clock, reap_period=1.0)
    before = ray.queries
    for _ in range(5):
        p.reap()
        clock.now += 0.1
    assert ray.queries == before + 1
    clock.now += 0.6
    p.reap()
    assert ray.queries == before + 2


def test_an_actor_ray_never_places_is_given_up_after_start_timeout(clock, caplog):
    ray = FakeRay(A)
    p = provider(ray, clock, start_timeout=30.0)
    (name,) = p.start(1)
    ray.actors[name]["node"] = None                               # e.g. the CPU was taken meanwhile
    clock.now += 29.0
    p.reap()
    assert p.owns(name) and not ray.kills
    with caplog.at_level(logging.WARNING, logger="autops.master.rayprovider"):
        clock.now += 2.0
        p.reap()
    assert not p.owns(name) and ray.kills == [name] and "placed its actor nowhere within 30 s" in caplog.text


def test_close_stops_every_aggregator_kills_the_stubborn_and_disconnects(clock):
    ray = FakeRay(A, B)
    p = provider(ray, clock, kill_after=2.0)
    names = p.start(3)
    ray.stubborn.add(names[2])
    t0 = clock.now
    p.close()
    assert {n for n, s in ray.signals if s == signal.SIGTERM} == set(names)
    assert ray.kills == [names[2]] and not ray.actors and ray.closed
    assert 2.0 <= clock.now - t0 < 2.5
    assert not p.actors and not p.stopping


def test_close_disconnects_even_when_ray_fails(clock):
    ray = FakeRay(A)
    p = provider(ray, clock)
    p.start(1)

    def broken(prefix):
        raise ConnectionError("GCS unreachable")
    ray.live_actors = broken
    p.close()
    assert ray.closed and not p.actors


def test_a_start_ray_refuses_starts_nothing_more_now(clock, caplog):
    ray = FakeRay(A, B)
    p = provider(ray, clock)
    ray.actors[f"{p.names}0"] = {"node": None, "near": None, "master": "", "options": {}}   # taken
    with caplog.at_level(logging.WARNING, logger="autops.master.rayprovider"):
        assert p.start(2) == []
    assert "could not be started through Ray: ValueError: The name" in caplog.text


def test_max_aggregators_must_be_positive(clock):
    with pytest.raises(ValueError, match="--max-aggregators >= 1"):
        provider(FakeRay(A), clock, max_aggregators=0)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bad_ray_address_is_one_line_at_once_without_ray_init():
    for bad in ("nohost", "host:notaport", "ray://10.0.0.1:10001"):
        with pytest.raises(ValueError, match="bad Ray address") as err:
            check_address(bad)
        assert "\n" not in str(err.value)
    port = closed_port()
    t0 = time.monotonic()
    for call in (lambda: connect(f"127.0.0.1:{port}"), lambda: ray_provider(MASTER, f"127.0.0.1:{port}")):
        with pytest.raises(RayUnreachable) as err:
            call()
        assert str(err.value) == (f"no Ray cluster at 127.0.0.1:{port}: connection refused; start one with "
                                  "`ray start --head` or give the address it printed")
    assert time.monotonic() - t0 < 5
    assert check_address(None) is None and check_address("auto") is None
