"""AutoPS's settings that more than one of its processes relies on, in one place (DESIGN §2).

A leaf: it imports nothing of AutoPS, so that the worker, the aggregator and pMaster can all
read it.
"""
from __future__ import annotations

#: Seconds an aggregator that pMaster's local provider started waits without hearing from any
#: pMaster before it exits (``autops aggregator --orphan-timeout``; one started by hand: 0, never).
DEFAULT_ORPHAN_TIMEOUT = 300.0
