"""``autops.models``: model tensor shapes from a shapes file; bad input is a ``ValueError``
naming the file and the model and listing the models the file has (never ``SystemExit``)."""
from __future__ import annotations

import json

import pytest

from autops.models import DEFAULT_SHAPES, known_models, model_tensors


@pytest.fixture
def shapes(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"tiny": {"tensors": [["w", [2, 3]], ["b", [3]]]}, "one": {"tensors": [["x", [1]]]}}))
    return path


def test_tensors_in_definition_order(shapes):
    assert model_tensors("tiny", shapes) == [("w", (2, 3), "float32"), ("b", (3,), "float32")]
    assert known_models(shapes) == ["flat64m", "tiny", "one"]
    assert model_tensors("flat64m", "/nonexistent.json") == [("flat", (16 * 2**20,), "float32")]


def test_unknown_model_names_the_file_and_lists_the_known_ones(shapes):
    with pytest.raises(ValueError, match=r"model 'vgg99' is not in .*shapes.json \(known models: flat64m, tiny, one\)"):
        model_tensors("vgg99", shapes)


@pytest.mark.parametrize("text, match", [(None, "not found"), ("{nope", "cannot be read"),
                                         ('{"m": {"layers": []}}', "is not shapes JSON")])
def test_bad_shapes_file_is_a_value_error(tmp_path, text, match):
    path = tmp_path / "bad.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match):
        model_tensors("m", path)


def test_environment_variable_chooses_the_file(shapes, monkeypatch):
    monkeypatch.setenv("AUTOPS_TENSOR_SHAPES", str(shapes))
    assert model_tensors("one") == [("x", (1,), "float32")]
    monkeypatch.delenv("AUTOPS_TENSOR_SHAPES")
    assert DEFAULT_SHAPES.name == "tensor_shapes.json"
    assert model_tensors("vgg19")                          # the shared data beside the project
