"""AutoPS's setting of its TCP data links' retransmission-timeout floor
(``TransportConfig.tcp_rto_min_us``, ``$AUTOPS_TCP_RTO_MIN_US``; the mechanism and why:
``dlrt/tcpopts.py``): the names the transport uses, from one place."""
from __future__ import annotations

from dlrt.tcpopts import KERNEL_RTO_MIN_US, RTO_MIN_US, TCP_RTO_MIN_US, set_rto_min

from ..config import RTO_MIN_ENV

__all__ = ["RTO_MIN_ENV", "RTO_MIN_US", "KERNEL_RTO_MIN_US", "TCP_RTO_MIN_US", "set_rto_min"]
