"""Turning a job's tensors into aggregation keys (pure).

Tensors larger than ``partition_bytes`` are split into near-equal contiguous partitions,
each its own key ``name#pI``; tensors smaller than ``small_bytes`` are marked for batching
(one message per aggregator carries all of them). Everything else is one key per tensor.
A job that sets no partition size gets ``auto_partition_bytes`` of what it declares first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_PARTITION_BYTES = 4 << 20          # the largest partition pMaster chooses (BytePS's default)
MIN_AUTO_PARTITION_BYTES = 1 << 20         # the smallest it chooses: per-message CPU grows below
PARTITIONS_PER_AGGREGATOR = 8              # partitions of the job each aggregator gets, at least
DEFAULT_SMALL_BYTES = 64 << 10
SUPPORTED_DTYPES = ("float32", "float64", "float16", "int32", "int64")


@dataclass(frozen=True)
class KeySpec:
    """One aggregation task: a contiguous slice ``[offset, offset+numel)`` of a flattened tensor."""

    key: str
    tensor: str
    offset: int
    numel: int
    dtype: str
    small: bool

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize

    def to_wire(self) -> list:
        return [self.key, self.tensor, self.offset, self.numel, self.dtype, self.small]

    @classmethod
    def from_wire(cls, item: list) -> "KeySpec":
        key, tensor, offset, numel, dtype, small = item[:6]
        return cls(str(key), str(tensor), int(offset), int(numel), str(dtype), bool(small))


def validate_tensor(name: object, shape: object, dtype: object) -> tuple[str, tuple[int, ...], str]:
    """Check one declared tensor; raises ValueError naming the problem."""
    if not isinstance(name, str) or not name or "#" in name:
        raise ValueError(f"bad tensor name {name!r}: a non-empty string without '#'")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {dtype!r} not supported (one of {', '.join(SUPPORTED_DTYPES)})")
    return name, tuple(shape), str(dtype)


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def auto_partition_bytes(model_bytes: int, aggregators: int) -> int:
    """The partition size for a job of ``model_bytes`` spread over ``aggregators`` that set none
    (0: the job asked for no number of aggregators, and pMaster packs it: taken as one).

    An aggregator answers a partition once all W workers sent it, and the W share its link:
    an iteration takes at least (its bytes + W x the partition) / rate, the pipeline's fill.
    The largest power of two that gives each aggregator ``PARTITIONS_PER_AGGREGATOR`` partitions
    keeps the fill at most 1/8 of its bytes; it stays within ``MIN_AUTO_PARTITION_BYTES`` (each
    message costs CPU, which on one host is the bottleneck) and ``DEFAULT_PARTITION_BYTES``.
    """
    share = max(0, int(model_bytes)) // (max(1, int(aggregators)) * PARTITIONS_PER_AGGREGATOR)
    if share < MIN_AUTO_PARTITION_BYTES:
        return MIN_AUTO_PARTITION_BYTES
    return min(DEFAULT_PARTITION_BYTES, 1 << (share.bit_length() - 1))


def plan_keys(
    tensors: list[tuple[str, tuple[int, ...], str]],
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    small_bytes: int = DEFAULT_SMALL_BYTES,
) -> list[KeySpec]:
    """Keys for ``tensors`` (name, shape, dtype), in declaration order."""
    if partition_bytes <= 0:
        raise ValueError("partition_bytes must be positive")
    keys: list[KeySpec] = []
    for name, shape, dtype in tensors:
        numel = int(math.prod(shape))
        itemsize = np.dtype(dtype).itemsize
        nbytes = numel * itemsize
        if nbytes > partition_bytes:
            per_part = max(1, partition_bytes // itemsize)      # whole elements per partition
            parts = math.ceil(numel / per_part)
            base, extra = divmod(numel, parts)
            offset = 0
            for i in range(parts):
                size = base + (1 if i < extra else 0)
                keys.append(KeySpec(f"{name}#p{i}", name, offset, size, dtype, False))
                offset += size
        else:
            keys.append(KeySpec(name, name, 0, numel, dtype, nbytes < small_bytes))
    return keys
