"""pMaster's messages held while an ASSIGN is allocated off the aggregator's loop."""
from __future__ import annotations

from hypothesis import given, strategies as st

from autops.aggregator.held import HeldMessages


def test_not_holding_hands_messages_straight_through():
    held = HeldMessages()
    assert not held.holding and not held.offer("release")
    assert held.resume(lambda m: None) == 0


def test_held_messages_come_back_in_arrival_order():
    held, handled = HeldMessages(), []
    held.hold()
    for m in ("cycle", "release", "migrate"):
        assert held.offer(m)
    assert held.resume(handled.append) == 3
    assert handled == ["cycle", "release", "migrate"] and not held.holding


def test_a_message_that_defers_again_keeps_the_rest_waiting_in_order():
    held, handled = HeldMessages(), []

    def handle(message: str) -> None:
        handled.append(message)
        if message.startswith("assign"):
            held.hold()                 # allocating again: what follows waits
            held.offer("late")          # arrives while the second allocation runs

    held.hold()
    for m in ("a", "assign-2", "b", "c"):
        held.offer(m)
    assert held.resume(handle) == 2 and handled == ["a", "assign-2"] and held.holding
    assert held.resume(handle) == 3 and handled == ["a", "assign-2", "b", "c", "late"]


@given(st.lists(st.sampled_from(["x", "assign"]), max_size=30))
def test_every_message_is_handled_once_in_order(messages):
    held, handled = HeldMessages(), []

    def handle(message: str) -> None:
        handled.append(message)
        if message == "assign":
            held.hold()

    held.hold()
    for m in messages:
        held.offer(m)
    while held.holding:
        held.resume(handle)
    assert handled == messages
