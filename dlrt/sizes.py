"""Byte sizes as users write them: ``4G``, ``512M``, ``64K``, ``1GiB``, ``4096``.

Owns parsing (``parse_size``, binary multiples: K = 1024) and formatting (``format_size``)
for the command line and the reports.
"""
from __future__ import annotations

import re

__all__ = ["parse_size", "format_size"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (``"4G"`` -> 4 GiB).  ``ValueError`` with the accepted forms otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"bad size {text}: must not be negative")
        return text
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"bad size {text!r}: expected a number with an optional K, M, G or T "
                         "suffix (e.g. 4G, 512M, 4096)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value != int(value):
        raise ValueError(f"bad size {text!r}: not a whole number of bytes")
    return int(value)


def format_size(n: int | float | None) -> str:
    """``1.5 GiB``-style text (``-`` for ``None``)."""
    if n is None:
        return "-"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
