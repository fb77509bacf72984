"""A Ray driver for test_raybed, run inside the head's emulated host: where Ray places work.

``python raybed_probe.py HEAD:PORT NODE_ID`` starts an actor that needs the custom resource
``lender`` and a task pinned to node ``NODE_ID`` (``NodeAffinitySchedulingStrategy``), and prints
one JSON line: where each ran (``ray.util.get_node_ip_address()``, ``DLRT_HOST_ID``, Ray node id,
pid) and the port of a TCP socket the actor listens on at its node's address. It then waits for
one connection to that socket (from another host) and prints a second line: the peer's address
and what it sent.
"""
from __future__ import annotations

import json
import os
import socket
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ACCEPT_S = 30.0


def whereabouts() -> dict:
    return {"ip": ray.util.get_node_ip_address(), "host_id": os.environ.get("DLRT_HOST_ID"),
            "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


@ray.remote
def where() -> dict:
    return whereabouts()


@ray.remote
class Probe:
    def __init__(self) -> None:
        self.sock: socket.socket | None = None

    def where(self) -> dict:
        return whereabouts()

    def listen(self) -> int:
        self.sock = socket.create_server((ray.util.get_node_ip_address(), 0))
        self.sock.settimeout(ACCEPT_S)
        return self.sock.getsockname()[1]

    def accept(self) -> dict:
        conn, peer = self.sock.accept()
        with conn:
            conn.settimeout(ACCEPT_S)
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
        self.sock.close()
        return {"peer": peer[0], "data": data.decode()}


def main(address: str, node_id: str) -> None:
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        probe = Probe.options(resources={"lender": 1}).remote()
        pinned = where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        placed = {"lender": ray.get(probe.where.remote()), "pinned": ray.get(pinned),
                  "port": ray.get(probe.listen.remote())}
        print(json.dumps(placed), flush=True)
        print(json.dumps(ray.get(probe.accept.remote())), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
