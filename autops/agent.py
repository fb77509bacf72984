"""The agent's public names at their documented import path (``from autops.agent import
Agent``: numpy arrays, explicit iterations, below ``autops.torch``). The agent itself lives
in ``autops.worker.agent``."""
from .worker.agent import Agent, AuthRefused, AutoPSError, Handle, MasterUnreachable, PoolBusy

__all__ = ["Agent", "AuthRefused", "AutoPSError", "Handle", "MasterUnreachable", "PoolBusy"]
