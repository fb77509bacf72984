"""The state of one key while it migrates (live migration, thesis §4.3.2, Fig. 4.5).

``KeyState`` holds one slot per phase, None while the key is not in it, so that the data
path tells a key that moves from one that stays with one attribute test:

* ``handover`` (``Handover``): the old owner's, from MIGRATE_INIT until the key's followers
  hold its state (``precopy``) and its cutover is decided;
* ``move`` (``Move``): the old owner's, from then on -- it serves the key up to the cutover
  iteration, redirects anything later, and hands the key over once the cutover is complete;
* ``arrival`` (``Arrival``): the new owner's, from MIGRATE_PREPARE until the key's first
  iteration here is complete (the workers' switch).

Plain data: the store takes a copy over (``Arrival.copy_missing``), ``moves_out.MovesOut``
runs the old side and ``moves_in.MovesIn`` the new one.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..wire import protocol as wire

__all__ = ["Handover", "Move", "Arrival", "NOT_YET"]

NOT_YET = 1 << 62       # an iteration no key reaches: the first one served here, before the hand-over


@dataclass
class Move:
    """An old owner's key handed over after iteration ``cutover`` to aggregator ``to`` (reached
    through ``info``: ``agg``, endpoints, host) in migration ``mid``; ``sent``: its hand-over
    (TENSOR_COPY) is due or gone."""
    mid: int
    to: str
    info: dict
    cutover: int
    sent: bool = False

    def past(self, iteration: int) -> bool:
        """Whether ``iteration`` of the key belongs to the aggregator it moves to."""
        return iteration > self.cutover

    def notice(self, key: str) -> wire.Move:
        """What the workers are told of the move of ``key`` (pull replies up to the cutover, REDIRECT after)."""
        return wire.Move(key, self.to, self.cutover + 1, self.info)


@dataclass
class Handover:
    """An old owner's key to hand over (migration ``mid``, to ``to`` through ``info``) ``lead``
    iterations after its open one, once its followers hold its state."""
    mid: int
    to: str
    info: dict
    lead: int

    def move(self, open_iteration: int) -> Move:
        """The move it becomes, its cutover decided now that ``open_iteration`` is open."""
        return Move(self.mid, self.to, self.info, open_iteration + self.lead)


@dataclass
class Arrival:
    """A key migrating here in migration ``mid``. ``copy_missing``: its hand-over has not come
    -- pushes are held (``KeyState.held``), pulls wait; ``precopied`` (server mode): the old
    owner's state arrived ahead and follows its steps; ``hp``: hyper-parameters pushed
    meanwhile; ``whole_at``: when the held pushes first made an iteration whole
    (``time.monotonic``); ``first``: the first iteration served here, and ``waited``: how long
    it waited here, whole, for the hand-over (s) -- both known at the hand-over."""
    mid: int
    copy_missing: bool = True
    precopied: bool = False
    hp: dict | None = None
    whole_at: float | None = None
    first: int = NOT_YET
    waited: float = 0.0
