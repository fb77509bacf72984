"""Trace-driven, event-driven simulation of a GPU cluster under a Tiresias policy."""
from .engine import SimResult, simulate

__all__ = ["SimResult", "simulate"]
