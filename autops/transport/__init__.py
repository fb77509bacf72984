"""Transports between agents and aggregators behind one small interface.

An aggregator advertises ``endpoints`` (a map kind -> address); an agent picks one with
``choose_endpoint``. Payloads travel as ZeroMQ frames (``tcp``, ``ipc``); an RDMA or
shared-memory path can be added as another kind without touching agent or aggregator logic.
"""
from __future__ import annotations

from .zmq import TRANSPORTS, choose_endpoint, ipc_address, make_context

__all__ = ["TRANSPORTS", "choose_endpoint", "ipc_address", "make_context"]
