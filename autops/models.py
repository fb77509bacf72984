"""Model tensor shapes: the tensors a model's training job pushes and pulls.

Read from a tensor shapes JSON (``{model: {"tensors": [[name, shape], ...]}}``): the file
given, else ``$AUTOPS_TENSOR_SHAPES``, else ``shared/data/models/tensor_shapes.json`` next to
the repository. ``flat64m`` (one flat 64 MiB float32 tensor) needs no file. A missing file, a
file that is not shapes JSON, or an unknown model raises ``ValueError`` naming the file and
the model and listing the models it has. Files are read once per path.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib

from .config import SHAPES_ENV, tensor_shapes

__all__ = ["DEFAULT_SHAPES", "SHAPES_ENV", "SYNTHETIC", "Tensor", "shapes_path", "known_models",
           "model_tensors"]

DEFAULT_SHAPES = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "tensor_shapes.json"
Tensor = tuple[str, tuple[int, ...], str]
SYNTHETIC: dict[str, list[Tensor]] = {"flat64m": [("flat", (16 * 2**20,), "float32")]}


def shapes_path(shapes_file: str | os.PathLike | None = None) -> pathlib.Path:
    """The shapes file used for ``shapes_file`` (None: ``$AUTOPS_TENSOR_SHAPES`` or the default)."""
    return pathlib.Path(shapes_file or tensor_shapes() or DEFAULT_SHAPES)


@functools.lru_cache(maxsize=8)
def _read(path: pathlib.Path) -> dict[str, list[Tensor]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"tensor shapes file {path} not found; pass --shapes FILE "
                         f"(shared/data/models/tensor_shapes.json) or set ${SHAPES_ENV}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"tensor shapes file {path} cannot be read: {exc}") from None
    try:
        return {str(model): [(str(name), tuple(int(d) for d in shape), "float32")
                             for name, shape in entry["tensors"]]
                for model, entry in data.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ValueError(f"tensor shapes file {path} is not shapes JSON: expected "
                         '{"MODEL": {"tensors": [["NAME", [DIM, ...]], ...]}, ...}') from None


def known_models(shapes_file: str | os.PathLike | None = None) -> list[str]:
    """Every model name ``model_tensors`` accepts with this shapes file."""
    return [*SYNTHETIC, *_read(shapes_path(shapes_file))]


def model_tensors(model: str, shapes_file: str | os.PathLike | None = None) -> list[Tensor]:
    """``(name, shape, dtype)`` of a model's tensors, in definition order."""
    if model in SYNTHETIC:
        return list(SYNTHETIC[model])
    path = shapes_path(shapes_file)
    models = _read(path)
    if model not in models:
        raise ValueError(f"model {model!r} is not in {path} (known models: "
                         f"{', '.join([*SYNTHETIC, *models])})")
    return list(models[model])
