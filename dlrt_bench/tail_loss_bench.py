"""What the tail-loss benchmarks (``bench/autops_tail_loss.py``, ``bench/infiniswap_tail_loss.py``)
share: their options (the link, the blackout, the trials, the floor asked for), the check that
emulated hosts can be made here, and the report (a line per row, JSON lines to ``--json``)."""
from __future__ import annotations

import argparse
import sys
import uuid
from typing import Callable

from dlrt import cli, tcpopts

from .testbed import available


def parser(description: str, prefix: str, size_help: str, at_help: str, idle_help: str) -> argparse.ArgumentParser:
    """The shared options; ``prefix``: the testbed's name prefix, a few letters (a random
    suffix is added)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--link", default="10gbit")
    p.add_argument("--size", type=cli.size, default="32M", metavar="SIZE", help=size_help)
    p.add_argument("--blackout", type=float, default=30.0, metavar="MS", help="ms of dropped packets (default 30)")
    p.add_argument("--at", type=float, default=10.0, metavar="MS", help=at_help)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--idle", type=float, default=0.3, help=idle_help)
    p.add_argument("--rto-min-us", type=int, default=tcpopts.RTO_MIN_US, help="the floor asked for")
    p.add_argument("--prefix", default=f"{prefix}{uuid.uuid4().hex[:4]}")
    cli.add_json(p, "write the rows as JSON lines to FILE (-: stdout)")
    return p


def run_and_report(args: argparse.Namespace, run: Callable[[argparse.Namespace], list[dict]],
                   line: Callable[[dict], str]) -> int:
    """``run(args)`` on emulated hosts (exit 2, saying why, where they cannot be made), each
    row's ``line`` on stderr, the rows to ``--json``."""
    reason = available()
    if reason:
        print(f"emulated hosts unavailable: {reason}", file=sys.stderr)
        return 2
    rows = run(args)
    for row in rows:
        print(line(row), file=sys.stderr)
    if args.json:
        cli.write_json(args.json, rows, lines=True)
    return 0
