"""A Ray cluster's node table as one of its hosts sees it: a small Ray driver.

``python -m dlrt_bench.raynodes --address HEAD:PORT [--expect IP ...] [--timeout S]`` connects
to the cluster (a driver needs a raylet on its own host, so ``RayBed`` runs it inside the head's
emulated host), and prints, as the last line of its output, ``{"alive": [NODE, ...], "seen_at":
UNIX_TIME}`` with each alive node as ``{"id", "ip", "resources", "labels"}``. With
``--expect`` it first polls (every 0.1 s) until the alive nodes' addresses are exactly those (a
node brought up or marked dead by the GCS; ``seen_at`` is when it first saw that), and exits 3,
still printing what it saw, when ``--timeout`` passes first. Imports Ray only when run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

__all__ = ["alive_nodes", "main", "TIMED_OUT"]

TIMED_OUT = 3          # exit status: the alive nodes never matched --expect in time
POLL_S = 0.1


def alive_nodes() -> list[dict[str, Any]]:
    """The nodes the connected driver's GCS reports alive: id, ip, resources, labels."""
    import ray
    return [{"id": node["NodeID"], "ip": node["NodeManagerAddress"], "resources": node["Resources"],
             "labels": node.get("Labels", {})} for node in ray.nodes() if node["Alive"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrt_bench.raynodes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the cluster's GCS, HEAD_ADDR:PORT")
    parser.add_argument("--expect", nargs="*", default=None, metavar="IP",
                        help="wait until the alive nodes' addresses are exactly these")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for --expect")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    import ray
    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        while True:
            nodes, seen_at = alive_nodes(), time.time()
            if args.expect is None or sorted(n["ip"] for n in nodes) == sorted(args.expect):
                status = 0
                break
            if time.monotonic() >= deadline:
                print(f"alive nodes {sorted(n['ip'] for n in nodes)} after {args.timeout:g} s, "
                      f"expected {sorted(args.expect)}", file=sys.stderr)
                status = TIMED_OUT
                break
            time.sleep(POLL_S)
    finally:
        ray.shutdown()
    print(json.dumps({"alive": nodes, "seen_at": seen_at}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
