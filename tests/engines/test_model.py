"""Reading what the runtime needs from a model: metadata, and clear errors for models that do not fit."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

from stream.engines.model import describe, load_info, metadata_for
from stream.errors import ModelError

OUTS = [NS(name=n) for n in ("boxes", "scores", "labels", "batch_index")]


def inp(shape: list[Any], type_: str = "tensor(float)", name: str = "images") -> NS:
    return NS(name=name, shape=shape, type=type_)


def meta(**kw: Any) -> dict[str, str]:
    args = dict(
        input_name="images",
        batch=4,
        height=320,
        width=320,
        dtype="float32",
        labels=["bg", "person"],
        score_thresh=0.3,
        architecture="x",
        weights="random",
    )
    args.update(kw)
    return metadata_for(**args)


def test_shipped_model_describes_itself(model_info: Any) -> None:
    assert (model_info.batch, model_info.height, model_info.width, model_info.dtype) == (4, 320, 320, "float32")
    assert model_info.label_names[1] == "person" and len(model_info.label_names) == 91
    assert model_info.output_names == ["boxes", "scores", "labels", "batch_index"]
    assert 0 < (model_info.score_thresh or 0) < 1 and model_info.scale == pytest.approx(1 / 255)


def test_metadata_fills_dynamic_dims() -> None:
    info = describe(Path("m.onnx"), meta(), [inp(["n", 3, "h", "w"])], OUTS)
    assert (info.batch, info.height, info.width) == (4, 320, 320)
    assert info.label_name(1) == "person" and info.label_name(7) == "7"


def test_graph_without_metadata() -> None:
    info = describe(Path("m.onnx"), {}, [inp([1, 3, 224, 320])], OUTS[:3])
    assert (info.batch, info.height, info.width, info.batch_index) == (1, 224, 320, None)


@pytest.mark.parametrize(
    "inputs, outputs, md, words",
    [
        ([inp([1, 3, 8, 8]), inp([1], name="extra")], OUTS, {}, "2 inputs"),
        ([inp([1, 3, 8, 8], "tensor(int64)")], OUTS, {}, "type tensor(int64)"),
        ([inp([3, 8, 8])], OUTS, {}, "rank 3"),
        ([inp([1, 1, 8, 8])], OUTS, {}, "1 channels"),
        ([inp([1, 3, "h", "w"])], OUTS, {}, "dynamic height"),
        ([inp([1, 3, 8, 8])], OUTS[:2], {}, "no output 'labels'"),
        ([inp([2, 3, 8, 8])], OUTS[:3], {}, "no batch_index"),
        ([inp([4, 3, 320, 320], name="pixels")], OUTS, meta(), "names input 'images'"),
        ([inp([2, 3, 320, 320])], OUTS, meta(), "batch 4"),
        ([inp([4, 3, 320, 320])], OUTS, {"stream.input": "{oops"}, "not JSON"),
    ],
)
def test_models_that_do_not_fit(inputs: list[NS], outputs: list[NS], md: dict[str, str], words: str) -> None:
    with pytest.raises(ModelError) as err:
        describe(Path("bad.onnx"), md, inputs, outputs)
    assert words in str(err.value) and "bad.onnx" in str(err.value) and "stream export-model" in str(err.value)


def test_unreadable_model_file(tmp_path: Path) -> None:
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="junk.onnx.*cannot load"):
        load_info(p)
    with pytest.raises(ModelError, match="no such file"):
        load_info(tmp_path / "missing.onnx")


def test_metadata_round_trip_is_json() -> None:
    m = meta()
    assert json.loads(m["stream.input"])["scale"] == pytest.approx(1 / 255)
    assert json.loads(m["stream.labels"]) == ["bg", "person"]
