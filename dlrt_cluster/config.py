"""What ``dlrt cluster up`` lets a user choose: ``ClusterConfig``, from a TOML or YAML file.

Every key is optional; an unknown section or key, or a value of the wrong type, is a
``ConfigError`` naming it (one line). The file (``--config FILE``; TOML, or YAML when it ends
in ``.yaml``/``.yml``)::

    [cluster]
    state = "~/.dlrt/cluster"   # logs, the record of what runs, the Tiresias master's state
    host = "127.0.0.1"          # without --ray: the address every service binds
    start_timeout = 60.0        # seconds each service has to answer before `up` gives up

    [autops]                    # pMaster: local provider, or Ray provider with --ray
    port = 5555
    report_port = 5557
    max_aggregators = 16        # the most aggregators it starts (default: the CPUs there are)
    ray_resource = "autops"     # with --ray: only nodes with this custom resource lend aggregators
    orphan_timeout = 300.0
    args = []                   # more `autops master` options

    [infiniswap]                # one daemon per machine (with --ray: per node)
    port = 7300
    report_port = 5600
    ray_resource = "infiniswap" # with --ray: only nodes with this custom resource run one (default: all)
    headroom = "8G"
    capacity = ""               # most memory to lend (default: all above the headroom)
    args = []                   # more `infiniswap daemon` options

    [tiresias]                  # the master; its executor: local, or Ray with --ray
    port = 8470
    policy = "las"
    nodes = "2x4"               # without --ray: NODESxGPUS emulated here
    checkpoint_root = ""        # with --ray: a directory every node mounts
    args = []                   # more `tiresias master` options
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

__all__ = ["ConfigError", "ClusterSection", "AutoPSSection", "InfiniswapSection", "TiresiasSection",
           "ClusterConfig", "load"]

DEFAULT_STATE = "~/.dlrt/cluster"


class ConfigError(ValueError):
    """A config file that cannot be used; the message is one line naming the key."""


@dataclass(frozen=True)
class ClusterSection:
    state: str = DEFAULT_STATE
    host: str = "127.0.0.1"
    start_timeout: float = 60.0

    @property
    def state_dir(self) -> str:
        return os.path.abspath(os.path.expanduser(self.state))


@dataclass(frozen=True)
class AutoPSSection:
    port: int = 5555
    report_port: int = 5557
    max_aggregators: int = 0          # 0: as many as there are CPUs
    ray_resource: str = ""
    orphan_timeout: float = 300.0
    args: list = field(default_factory=list)


@dataclass(frozen=True)
class InfiniswapSection:
    port: int = 7300
    report_port: int = 5600
    ray_resource: str = ""
    headroom: str = "8G"
    capacity: str = ""
    args: list = field(default_factory=list)


@dataclass(frozen=True)
class TiresiasSection:
    port: int = 8470
    policy: str = "las"
    nodes: str = "2x4"
    checkpoint_root: str = ""
    args: list = field(default_factory=list)


@dataclass(frozen=True)
class ClusterConfig:
    cluster: ClusterSection = field(default_factory=ClusterSection)
    autops: AutoPSSection = field(default_factory=AutoPSSection)
    infiniswap: InfiniswapSection = field(default_factory=InfiniswapSection)
    tiresias: TiresiasSection = field(default_factory=TiresiasSection)


def _value(where: str, kind: type, value: Any) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise ConfigError(f"{where} must be a list of strings")
        return [str(v) for v in value]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where} must be {'a number' if kind in (int, float) else 'a ' + kind.__name__}, "
                          f"got {value!r}")
    if kind is int and (value < 0 or value > 65535 and where.endswith("port")):
        raise ConfigError(f"{where} out of range: {value}")
    if kind is float and value <= 0:
        raise ConfigError(f"{where} must be above 0, got {value}")
    return value


def _section(name: str, cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"[{name}] must be a table of keys")
    hints = get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in [{name}] (known: {', '.join(known)})")
    return cls(**{key: _value(f"[{name}] {key}", hints[key], value) for key, value in data.items()})


def from_dict(data: dict[str, Any]) -> ClusterConfig:
    """A ``ClusterConfig`` from parsed TOML/YAML (``ConfigError`` for what does not fit)."""
    hints = get_type_hints(ClusterConfig)
    known = [f.name for f in fields(ClusterConfig)]
    sections = {}
    for name, value in (data or {}).items():
        if name not in known:
            raise ConfigError(f"unknown section [{name}] (known: {', '.join(known)})")
        assert is_dataclass(hints[name])
        sections[name] = _section(name, hints[name], value)
    return ClusterConfig(**sections)


def load(path: str | None) -> ClusterConfig:
    """The config in file ``path`` (None: the defaults)."""
    if path is None:
        return ClusterConfig()
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            data = yaml.safe_load(raw.decode())
        else:
            data = tomllib.loads(raw.decode())
    except ImportError:
        raise ConfigError(f"{path}: YAML needs PyYAML (pip install pyyaml), or write the file as TOML") from None
    except Exception as exc:                 # tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError
        raise ConfigError(f"{path} is not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'TOML'}: "
                          f"{' '.join(str(exc).split())}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: expected sections ([cluster], [autops], ...), got {type(data).__name__}")
    try:
        return from_dict(data or {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
