"""AutoPS's settings (``autops/config.py``): the defaults, what each variable sets, a bad value
refused with one line naming it, and the command line filling them (its options win)."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from autops import cli as autops_cli
from autops.config import (DEFAULT_TIMEOUT, HANDSHAKE_S, RESERVE_SHARED, WARM_BYTES, AgentConfig, AggregatorConfig,
                           MasterConfig, TransportConfig, log_level, master_address, tensor_shapes)
from dlrt.limits import half_open_files
from dlrt.tcpopts import RTO_MIN_US


def test_an_empty_environment_gives_the_defaults():
    assert AgentConfig.from_env({}) == AgentConfig()
    assert AggregatorConfig.from_env({}) == AggregatorConfig()
    assert MasterConfig.from_env({}) == MasterConfig()
    transport = TransportConfig.from_env({})
    assert transport == TransportConfig()
    assert (transport.tcp_stream, transport.tcp_lanes, transport.tcp_rto_min_us, transport.malloc_tuning) == \
        (True, 1, RTO_MIN_US, True)
    assert (transport.stream_max_connections, transport.stream_handshake_s) == (half_open_files(), HANDSHAKE_S)
    agent = AgentConfig()
    assert (agent.master, agent.job, agent.secret, agent.aggregators, agent.transport, agent.timeout) == \
        (None, None, None, 0, "auto", DEFAULT_TIMEOUT)
    assert (agent.fault_tolerant, agent.partition_bytes, agent.warm_bytes, agent.coalesce) == \
        (True, None, WARM_BYTES, True)
    assert MasterConfig().state_dir == str(Path.home() / ".dlrt" / "autops")
    assert (master_address({}), log_level({}), tensor_shapes({})) == (None, "INFO", None)


def test_each_variable_sets_its_field():
    env = {"AUTOPS_MASTER": "tcp://10.0.0.1:5555", "AUTOPS_JOB": "j1", "AUTOPS_JOB_SECRET": "s" * 32,
           "AUTOPS_AGGREGATORS": "3", "AUTOPS_TRANSPORT": "ipc", "AUTOPS_TIMEOUT": "2.5",
           "AUTOPS_FAULT_TOLERANT": "No", "AUTOPS_PARTITION_BYTES": "262144", "AUTOPS_WARM_BYTES": "0",
           "AUTOPS_COALESCE": "0", "AUTOPS_TCP_STREAM": " 0 ", "AUTOPS_TCP_LANES": "3",
           "AUTOPS_TCP_RTO_MIN_US": "0", "AUTOPS_STREAM_MAX_CONNECTIONS": "8", "AUTOPS_STREAM_HANDSHAKE_S": "4",
           "AUTOPS_STREAM_IDLE_S": "30", "AUTOPS_MALLOC_TUNING": "0", "AUTOPS_RUNTIME_DIR": "/run/x",
           "AUTOPS_RDMA_DEVICE": "mlx5_1", "AUTOPS_RDMA_PORT": "2", "AUTOPS_RDMA_GID_INDEX": "3",
           "AUTOPS_AGGREGATOR_RESERVE": "3G", "AUTOPS_AGGREGATOR_RESERVE_SHARED": "0.67",
           "AUTOPS_STATE_DIR": "/var/lib/autops", "AUTOPS_LOG": "debug", "AUTOPS_TENSOR_SHAPES": "/s.json"}
    agent = AgentConfig.from_env(env)
    assert dataclasses.replace(agent, transport_config=TransportConfig()) == AgentConfig(
        master="tcp://10.0.0.1:5555", job="j1", secret="s" * 32, aggregators=3, transport="ipc", timeout=2.5,
        fault_tolerant=False, partition_bytes=262144, warm_bytes=0, coalesce=False)
    assert agent.transport_config == TransportConfig(
        tcp_stream=False, tcp_lanes=3, tcp_rto_min_us=0, stream_max_connections=8, stream_handshake_s=4.0,
        stream_idle_s=30.0, malloc_tuning=False, runtime_dir="/run/x", rdma_device="mlx5_1", rdma_port=2,
        rdma_gid_index=3)
    aggregator = AggregatorConfig.from_env(env)
    assert (aggregator.reserve, aggregator.reserve_shared) == (3 << 30, 0.67)
    assert aggregator.transport_config == agent.transport_config
    assert MasterConfig.from_env(env) == MasterConfig(state_dir="/var/lib/autops", log_level="DEBUG")
    assert (master_address(env), tensor_shapes(env)) == ("tcp://10.0.0.1:5555", "/s.json")


@pytest.mark.parametrize("name, value, read", [
    ("AUTOPS_TIMEOUT", "soon", AgentConfig.from_env),
    ("AUTOPS_AGGREGATORS", "two", AgentConfig.from_env),
    ("AUTOPS_PARTITION_BYTES", "1M", AgentConfig.from_env),
    ("AUTOPS_WARM_BYTES", "32M", AgentConfig.from_env),
    ("AUTOPS_TCP_RTO_MIN_US", "5ms", AgentConfig.from_env),
    ("AUTOPS_RDMA_PORT", "one", TransportConfig.from_env),
    ("AUTOPS_RDMA_GID_INDEX", "x", TransportConfig.from_env),
    ("AUTOPS_AGGREGATOR_RESERVE", "lots", AggregatorConfig.from_env),
    ("AUTOPS_AGGREGATOR_RESERVE_SHARED", "1.5", AggregatorConfig.from_env),
    ("AUTOPS_AGGREGATOR_RESERVE_SHARED", "half", AggregatorConfig.from_env),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, value, read):
    with pytest.raises(ValueError) as caught:
        read({name: value})
    message = str(caught.value)
    assert message.startswith(f"${name}") and repr(value) in message and "\n" not in message


def test_the_transports_old_fallbacks_stay(caplog):
    """Settings that always fell back to their default on a bad value still do: the tcp
    framing and lanes silently, the stream limits with a warning naming the variable."""
    assert TransportConfig.from_env({"AUTOPS_TCP_STREAM": "yes", "AUTOPS_TCP_LANES": "many"}) == TransportConfig()
    assert TransportConfig.from_env({"AUTOPS_TCP_LANES": "0"}).tcp_lanes == 1
    with caplog.at_level(logging.WARNING, logger="dlrt.limits"):
        assert TransportConfig.from_env({"AUTOPS_STREAM_HANDSHAKE_S": "-1"}).stream_handshake_s == HANDSHAKE_S
    assert "AUTOPS_STREAM_HANDSHAKE_S" in caplog.text
    assert AgentConfig.from_env({"AUTOPS_FAULT_TOLERANT": "off", "AUTOPS_COALESCE": "false"}).fault_tolerant
    assert AgentConfig.from_env({"AUTOPS_COALESCE": "false"}).coalesce          # only "0" turns it off


def _aggregator(argv: list[str]) -> AggregatorConfig:
    parser, _ = autops_cli._parser()
    return autops_cli._aggregator_config(parser.parse_args(["aggregator", "--master", "127.0.0.1:1", *argv]))


def test_the_aggregator_command_fills_its_config_options_first(monkeypatch):
    monkeypatch.setenv("AUTOPS_AGGREGATOR_RESERVE", "1G")
    monkeypatch.delenv("AUTOPS_AGGREGATOR_RESERVE_SHARED", raising=False)
    monkeypatch.setenv("AUTOPS_TCP_LANES", "2")
    config = _aggregator(["--bind", "0.0.0.0:7000", "--orphan-timeout", "9"])
    assert (config.bind_host, config.port, config.orphan_timeout) == ("0.0.0.0", 7000, 9.0)
    assert (config.reserve, config.reserve_shared, config.transport_config.tcp_lanes) == (1 << 30, RESERVE_SHARED, 2)
    config = _aggregator(["--reserve", "2G", "--reserve-shared", "0.5"])
    assert (config.reserve, config.reserve_shared) == (2 << 30, 0.5)
    assert dataclasses.replace(_aggregator([]), reserve=0, transport_config=TransportConfig()) == AggregatorConfig()


def test_a_bad_variable_is_a_usage_error_of_the_command_that_reads_it(monkeypatch, capsys):
    monkeypatch.setenv("AUTOPS_AGGREGATOR_RESERVE", "lots")
    assert autops_cli.main(["aggregator", "--master", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autops aggregator: error: $AUTOPS_AGGREGATOR_RESERVE: bad size 'lots'")
    assert err.count("\n") == 1


def test_the_master_command_defaults_come_from_its_config(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPS_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPS_MASTER", "10.1.2.3:6000")
    parser, _ = autops_cli._parser()
    args = parser.parse_args(["master"])
    defaults = MasterConfig()
    assert (args.state_dir, args.heartbeat_timeout, args.report_period, args.aggregator_orphan_timeout) == \
        (str(tmp_path), defaults.heartbeat_timeout, defaults.report_period, defaults.aggregator_orphan_timeout)
    assert parser.parse_args(["status"]).master == "tcp://10.1.2.3:6000"
