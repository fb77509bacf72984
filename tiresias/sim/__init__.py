"""Trace-driven, event-driven simulation of a GPU cluster under a Tiresias policy."""
from .engine import PLACEMENTS, SimConfig, SimResult, simulate

__all__ = ["PLACEMENTS", "SimConfig", "SimResult", "simulate"]
