"""What RayBed asks ``ray start`` for, checked without starting Ray or building hosts."""
from __future__ import annotations

import json

import pytest

from dlrt_bench.raybed import RAY_ENV, NodeSpec, RayBed
from dlrt_bench.testbed import Testbed


def test_node_spec_gives_ray_start_its_resources_and_labels():
    assert NodeSpec().start_args() == ["--num-cpus", "1", "--num-gpus", "0"]
    args = NodeSpec(num_cpus=2, num_gpus=4, resources={"lender": 1.0}, labels={"zone": "a", "rack": "r1"}).start_args()
    assert args[:4] == ["--num-cpus", "2", "--num-gpus", "4"]
    assert json.loads(args[args.index("--resources") + 1]) == {"lender": 1.0}
    assert args[args.index("--labels") + 1] == "zone=a,rack=r1"


@pytest.mark.parametrize("labels", [{"zone": "a,b"}, {"k=v": "x"}, {"zone": "a b"}])
def test_node_spec_refuses_labels_ray_start_would_misread(labels):
    with pytest.raises(ValueError, match="labels"):
        NodeSpec(labels=labels).start_args()


def test_raybed_checks_its_nodes_against_the_testbed():
    tb = Testbed(3, prefix="rbspec")          # not brought up: only its hosts' addresses are used
    rb = RayBed(tb, {0: NodeSpec(), 2: NodeSpec(num_cpus=2)}, head=2, port=6380,
                env={"RAY_health_check_period_ms": "200"})
    assert rb.address == f"{tb.hosts[2].addr}:6380"
    assert rb.env["RAY_health_check_period_ms"] == "200"
    assert rb.env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == RAY_ENV["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"
    with pytest.raises(ValueError, match="head"):
        RayBed(tb, {1: NodeSpec()}, head=0)
    with pytest.raises(ValueError, match=r"hosts \[3\]"):
        RayBed(tb, {0: NodeSpec(), 3: NodeSpec()})
    rb.down()                                 # never up: nothing to do, twice
    rb.down()
