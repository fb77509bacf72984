"""The aggregation modes and the server optimizers' names and hyper-parameters, as workers,
pMaster and aggregators all check them (no numpy math here: the update rules live in the
aggregator's ``optim``).

A job or tensor aggregates in ``sum`` mode (the aggregator sums, workers apply their own
optimizer) or ``server`` mode (the aggregator applies one of ``SUPPORTED_OPTIMIZERS``).
Hyper-parameters take ``torch.optim``'s keyword names and defaults; ``hyperparameters``
checks a set of them (unknown keys and bad values raise ``ValueError`` naming the key), and
``hp_from_torch_group`` / ``optimizer_name_of`` translate a torch optimizer for the worker.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

MODES = ("sum", "server")

#: Names the aggregator's ``make_optimizer`` accepts.
SUPPORTED_OPTIMIZERS = ("sgd", "adam", "adamw")

_TORCH_CLASSES = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}


# --- value checks -------------------------------------------------------------------------

def is_real(value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)))


def _real(key: str, value: Any) -> float:
    if not is_real(value):
        raise ValueError(f"hyper-parameter {key!r} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"hyper-parameter {key!r} must be finite, got {value!r}")
    return v


def _nonneg(key: str, value: Any) -> float:
    v = _real(key, value)
    if v < 0.0:
        raise ValueError(f"invalid {key!r}: {value!r} (must be >= 0)")
    return v


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"hyper-parameter {key!r} must be a bool, got {value!r}")
    return bool(value)


def _betas(key: str, value: Any) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"hyper-parameter {key!r} must be a pair (beta1, beta2), got {value!r}")
    out = []
    for i, b in enumerate(value):
        v = _real(f"{key}[{i}]", b)
        if not 0.0 <= v < 1.0:
            raise ValueError(f"invalid {key!r}: beta at index {i} is {b!r} (must be in [0, 1))")
        out.append(v)
    return out[0], out[1]


def plain(value: Any) -> Any:
    """A plain Python value from a torch/numpy scalar (duck-typed: no torch import)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return tuple(plain(v) for v in value)
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    return value


# --- each optimizer's hyper-parameters ----------------------------------------------------

def _sgd(hp: dict[str, Any]) -> dict[str, Any]:
    out = {
        "lr": _nonneg("lr", hp["lr"]),
        "momentum": _nonneg("momentum", hp["momentum"]),
        "dampening": _real("dampening", hp["dampening"]),
        "weight_decay": _nonneg("weight_decay", hp["weight_decay"]),
        "nesterov": _flag("nesterov", hp["nesterov"]),
        "maximize": _flag("maximize", hp["maximize"]),
    }
    if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
        raise ValueError("invalid 'nesterov': Nesterov momentum requires a momentum > 0 "
                         "and zero dampening")
    return out


def _adam(hp: dict[str, Any]) -> dict[str, Any]:
    out = {
        "lr": _nonneg("lr", hp["lr"]),
        "betas": _betas("betas", hp["betas"]),
        "eps": _nonneg("eps", hp["eps"]),
        "weight_decay": _nonneg("weight_decay", hp["weight_decay"]),
        "amsgrad": _flag("amsgrad", hp["amsgrad"]),
        "maximize": _flag("maximize", hp["maximize"]),
    }
    if "decoupled_weight_decay" in hp:
        out["decoupled_weight_decay"] = _flag("decoupled_weight_decay", hp["decoupled_weight_decay"])
    return out


class _Spec:
    """One optimizer's hyper-parameters: defaults, required keys, the check of a full set."""

    def __init__(self, defaults: dict[str, Any], required: tuple[str, ...],
                 check: Callable[[dict[str, Any]], dict[str, Any]], group_keys: tuple[str, ...]) -> None:
        self.defaults, self.required, self.check, self.group_keys = defaults, required, check, group_keys


_SPECS = {
    "sgd": _Spec({"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False},
                 ("lr",), _sgd, ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")),
    "adam": _Spec({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                   "maximize": False, "decoupled_weight_decay": False}, (), _adam,
                  ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")),
    "adamw": _Spec({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
                    "maximize": False}, (), _adam,
                   ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")),
}


def check_name(name: Any) -> str:
    if name not in _SPECS:
        raise ValueError(f"unknown server optimizer {name!r}; supported: {', '.join(SUPPORTED_OPTIMIZERS)}")
    return name


def hyperparameters(name: str, hp: Mapping[str, Any], current: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Optimizer ``name``'s full, checked hyper-parameters: ``hp`` over ``current`` (a set
    checked before: a change) or over the defaults (then the required keys must be in
    ``hp``). ``ValueError`` names an unknown key or a bad value."""
    spec = _SPECS[check_name(name)]
    if not isinstance(hp, Mapping):
        raise ValueError(f"{name}: hyper-parameters must be a dict, got {type(hp).__name__}")
    allowed = set(spec.defaults) | set(spec.required)
    for key in hp:
        if key not in allowed:
            raise ValueError(f"{name}: unknown hyper-parameter {key!r} (accepted: {', '.join(sorted(allowed))})")
    if current is None:
        for key in spec.required:
            if key not in hp:
                raise ValueError(f"{name}: hyper-parameter {key!r} is required")
    merged = dict(spec.defaults if current is None else current)
    merged.update(hp)
    return spec.check(merged)


def hp_from_torch_group(name: str, group: Mapping[str, Any]) -> dict[str, Any]:
    """The hyper-parameters of server optimizer ``name`` picked out of a torch param group
    (``params`` and torch-only options such as ``foreach`` are dropped; 1-element tensors
    become Python numbers). The result is validated."""
    spec = _SPECS[check_name(name)]
    if not isinstance(group, Mapping):
        raise ValueError(f"param group must be a dict, got {type(group).__name__}")
    hp = {key: plain(group[key]) for key in spec.group_keys if key in group}
    hyperparameters(name, hp)                 # raises ValueError naming a bad key
    return hp


def optimizer_name_of(torch_optimizer_class_name: str) -> str:
    """``"SGD"`` -> ``"sgd"``, ``"Adam"`` -> ``"adam"``, ``"AdamW"`` -> ``"adamw"`` (a dotted
    path such as ``"torch.optim.adam.Adam"`` is accepted too)."""
    short = str(torch_optimizer_class_name).rsplit(".", 1)[-1]
    try:
        return _TORCH_CLASSES[short]
    except KeyError:
        raise ValueError(f"server mode supports only SGD/Adam/AdamW optimizers, "
                         f"got {torch_optimizer_class_name!r}") from None
