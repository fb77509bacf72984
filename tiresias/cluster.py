"""Cluster shape and per-model skew for the Tiresias simulator.

Owns ``ClusterSpec`` / ``parse_cluster`` (``"48x8"``, ``"16x4x8"`` with CPUs per node for
aggregators, or a Tiresias ``n*g*.csv`` spec file)
and the model-skew table ``MODEL_SKEW`` with its lookup ``skew_of``.
"""
from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import dataclass

__all__ = ["ClusterSpec", "parse_cluster", "MODEL_SKEW", "MODEL_ALIASES", "skew_of", "model_key"]


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    gpus_per_node: int
    cpus_per_node: int | None = None    # CPUs a node gives aggregators (None: one per GPU)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "cpus_per_node"):
            v = getattr(self, name)
            if v is None and name == "cpus_per_node":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ClusterSpec.{name} must be an integer >= 1, got {v!r}")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def total_cpus(self) -> int:
        """CPUs for aggregators (the second resource Optimus allocates)."""
        return self.nodes * (self.gpus_per_node if self.cpus_per_node is None else self.cpus_per_node)


_ACCEPTED = ("accepted forms: 'NODESxGPUS' (e.g. '48x8' = 48 nodes of 8 GPUs), 'NODESxGPUSxCPUS' "
             "(CPUs each node gives aggregators; default one per GPU) or the path "
             "of a Tiresias cluster spec CSV with header "
             "num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node")
_SHAPE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?$")
_SPEC_COLS = ("num_switch", "num_node_p_switch", "num_gpu_p_node")


def parse_cluster(text: str | os.PathLike) -> ClusterSpec:
    """``"48x8"`` -> 48 nodes of 8 GPUs; or a spec CSV path (nodes = num_switch *
    num_node_p_switch, gpus_per_node = num_gpu_p_node, one data row). Bad input ->
    ``ValueError`` naming the accepted forms."""
    if isinstance(text, os.PathLike):
        text = os.fspath(text)
    if not isinstance(text, str):
        raise ValueError(f"cluster must be a string, got {type(text).__name__}; {_ACCEPTED}")
    m = _SHAPE.match(text)
    if m:
        nodes, gpus = int(m.group(1)), int(m.group(2))
        cpus = int(m.group(3)) if m.group(3) is not None else None
        if nodes < 1 or gpus < 1 or (cpus is not None and cpus < 1):
            raise ValueError(f"cluster {text!r}: nodes, GPUs and CPUs per node must be >= 1; {_ACCEPTED}")
        return ClusterSpec(nodes, gpus, cpus)
    path = text.strip()
    if not path or not os.path.isfile(path):
        what = "no such file" if path and (os.sep in path or path.endswith(".csv")) else \
            "not understood"
        raise ValueError(f"cluster {text!r}: {what}; {_ACCEPTED}")
    return _read_spec(path)


def _read_spec(path: str) -> ClusterSpec:
    try:
        with open(path, "r", encoding="utf-8-sig", newline="") as fh:
            rows = [r for r in csv.reader(fh) if any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"cluster spec {path}: cannot read: {e}; {_ACCEPTED}") from None
    if not rows:
        raise ValueError(f"cluster spec {path}: empty file; {_ACCEPTED}")
    header = [h.strip().lower() for h in rows[0]]
    missing = [c for c in _SPEC_COLS if c not in header]
    if missing:
        raise ValueError(f"cluster spec {path}: header lacks {', '.join(missing)}; {_ACCEPTED}")
    if len(rows) != 2:
        raise ValueError(f"cluster spec {path}: expected exactly one data row, got "
                         f"{len(rows) - 1}; {_ACCEPTED}")
    row = rows[1]
    vals: dict[str, int] = {}
    for c in _SPEC_COLS:
        i = header.index(c)
        s = row[i].strip() if i < len(row) else ""
        try:
            v = int(s)
        except ValueError:
            raise ValueError(f"cluster spec {path}:2: {c} is not an integer: {s!r}") from None
        if v < 1:
            raise ValueError(f"cluster spec {path}:2: {c} must be >= 1, got {v}")
        vals[c] = v
    return ClusterSpec(vals["num_switch"] * vals["num_node_p_switch"], vals["num_gpu_p_node"])


# Largest tensor's share of the model ("skew", S_J in the thesis), per model.
# Source for the first ten: Gu's thesis, Table 3.3 "Characteristics of the DL models (in
# TensorFlow) used the experiments", column "Largest tensor ratio"
# (/work/shared/papers/gu-thesis-infiniswap-tiresias-autops.txt). These are exactly the ten
# model names of the Tiresias 60_job.csv trace.
# bert-base / bert-large are not in the table; their values are `largest_tensor_share` from
# /work/shared/data/models/tensor_shapes.json (PyTorch shapes). That file also has vgg19
# (0.7153), resnet50 (0.0923) and alexnet (0.6178); the table's TensorFlow values are kept
# for those (they agree within a percent, except AlexNet 61.0% vs 61.8%).
MODEL_SKEW: dict[str, float] = {
    "vgg19": 0.715,
    "vgg16": 0.743,
    "vgg11": 0.773,
    "alexnet": 0.610,
    "resnet152": 0.039,
    "resnet101": 0.053,
    "resnet50": 0.092,
    "inception4": 0.036,
    "inception3": 0.086,
    "googlenet": 0.146,
    "bert-base": 0.21410683595805127,    # tensor_shapes.json
    "bert-large": 0.09325759959912859,   # tensor_shapes.json
}

# Assumed aliases (after normalisation: lower case, '-', '_', '.', ' ' removed):
# Inception v3/v4 are the TF-benchmark "inception3"/"inception4"; GoogLeNet is Inception v1.
# BERT names without the size suffix are not mapped (ambiguous).
MODEL_ALIASES: dict[str, str] = {
    "inceptionv3": "inception3",
    "inceptionv4": "inception4",
    "inceptionv1": "googlenet",
    "inception1": "googlenet",
    "bertbaseuncased": "bert-base",
    "bertbasecased": "bert-base",
    "bertlargeuncased": "bert-large",
    "bertlargecased": "bert-large",
}


def model_key(name: str) -> str:
    """A model name as the tables are keyed: lower case, without '-', '_', '.' and blanks."""
    return re.sub(r"[\s\-_.]", "", name.strip().lower())


_LOOKUP: dict[str, float] = {model_key(k): v for k, v in MODEL_SKEW.items()}
_LOOKUP.update({a: MODEL_SKEW[t] for a, t in MODEL_ALIASES.items()})


def skew_of(job_model: str | None, trace_skew: float | None, default: float = 0.0) -> float:
    """The job's skew: ``trace_skew`` when given, else ``MODEL_SKEW`` for the model (names
    matched case-insensitively ignoring '-', '_', '.', blanks; see ``MODEL_ALIASES``), else
    ``default``. A given skew outside [0, 1] raises ``ValueError``."""
    if trace_skew is not None:
        s = float(trace_skew)
        if not (math.isfinite(s) and 0.0 <= s <= 1.0):
            raise ValueError(f"skew must be in [0, 1], got {trace_skew!r}")
        return s
    if job_model:
        v = _LOOKUP.get(model_key(job_model))
        if v is not None:
            return v
    return default
