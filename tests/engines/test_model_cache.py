"""The model cache (stream/engines/model_cache.py): the second start reads the model's description and its
optimized graph from the cache, gets the same detections, and a damaged, unwritable or disabled cache only
costs time."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from stream.engines import model_cache
from stream.engines.cpu import CpuEngine
from stream.engines.model import ModelInfo, load_info
from stream.errors import ModelError
from stream.sources.host import HostBatchSource
from stream.sources.naming import Source


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(model_cache.ENV_OFF, raising=False)
    return tmp_path / "cache" / "stream" / "models"


@pytest.fixture
def model(tmp_path: Path, model_path: Path) -> Path:
    """A copy of the shipped model, so that the test can change it."""
    return Path(shutil.copy(model_path, tmp_path / "m.onnx"))


def entries(cache: Path) -> list[str]:
    return sorted(p.suffix for p in cache.glob("*")) if cache.exists() else []


def detections(info: ModelInfo, video: Path) -> list[tuple[int, np.ndarray, np.ndarray]]:
    engine = CpuEngine(info)
    out = []
    for batch in HostBatchSource(Source("v", str(video)), info):
        for r in engine.infer(batch):
            out.append((r.meta.index, np.round(r.boxes, 3), np.round(r.scores, 5)))
    engine.close()
    return out


def test_second_start_reads_the_cache_and_detects_the_same(
    cache: Path, model: Path, videos: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(model_cache.ENV_OFF, "0")
    info_plain = load_info(model)
    want = detections(info_plain, videos["plain"])
    assert entries(cache) == [] and want  # off: nothing written
    monkeypatch.delenv(model_cache.ENV_OFF)

    first = load_info(model)
    assert entries(cache) == [".json"]
    got_first = detections(first, videos["plain"])  # optimizes, and writes the optimized graph
    assert entries(cache) == [".json", ".onnx"]
    with caplog.at_level(logging.DEBUG, logger="stream.engines.model_cache"):
        second = load_info(model)
        got_second = detections(second, videos["plain"])
    assert "optimized graph from the cache" in caplog.text
    assert first == second == info_plain
    for a, b, c in zip(want, got_first, got_second, strict=True):
        assert a[0] == b[0] == c[0]
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[1], c[1])
        np.testing.assert_array_equal(a[2], c[2])


def test_reading_the_cache_skips_the_session(cache: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_info(model)
    import onnxruntime as ort

    def no_session(*a: object, **k: object) -> None:
        raise AssertionError("load_info made a session although the model's description was cached")

    monkeypatch.setattr(ort, "InferenceSession", no_session)
    assert load_info(model).input_name == "images"


def test_damaged_entries_are_replaced(cache: Path, model: Path, videos: dict[str, Path]) -> None:
    CpuEngine(load_info(model)).close()
    for p in cache.glob("*"):
        p.write_bytes(b"not what it was")
    info = load_info(model)  # the damaged description is removed and the model read again
    assert info.input_name == "images"
    assert detections(info, videos["plain"])  # the damaged graph is removed and optimized again
    assert entries(cache) == [".json", ".onnx"]
    assert all(p.stat().st_size > 100 for p in cache.glob("*"))


def test_a_changed_model_is_not_read_from_the_cache(cache: Path, model: Path) -> None:
    load_info(model)
    model.write_bytes(b"\x00" * 64)  # replaced in place by something that is not a model
    with pytest.raises(ModelError, match="cannot load it"):
        load_info(model)


def test_an_unwritable_cache_only_costs_time(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    info = load_info(model)
    engine = CpuEngine(info)
    engine.close()
    assert blocker.is_file()


def test_a_model_that_fails_its_checks_is_not_cached(cache: Path, tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(ModelError, match="rank 2"):
        load_info(path)
    assert entries(cache) == []
