"""AutoPS's setting of its TCP data links' retransmission-timeout floor:
``$AUTOPS_TCP_RTO_MIN_US`` (the mechanism and why: ``dlrt/tcpopts.py``)."""
from __future__ import annotations

from dlrt import tcpopts as _shared
from dlrt.tcpopts import KERNEL_RTO_MIN_US, RTO_MIN_US, TCP_RTO_MIN_US, set_rto_min

__all__ = ["RTO_MIN_ENV", "RTO_MIN_US", "KERNEL_RTO_MIN_US", "TCP_RTO_MIN_US", "rto_min_us_from_env",
           "set_rto_min"]

RTO_MIN_ENV = "AUTOPS_TCP_RTO_MIN_US"


def rto_min_us_from_env(strict: bool = True) -> int:
    """``$AUTOPS_TCP_RTO_MIN_US`` (microseconds, 0..``KERNEL_RTO_MIN_US``), else ``RTO_MIN_US``;
    a bad value: ``ValueError``, or with ``strict`` off ``RTO_MIN_US``."""
    return _shared.rto_min_us_from_env(RTO_MIN_ENV, strict)
