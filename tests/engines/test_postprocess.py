"""`--postprocess device`: the graph ends at RetinaNet's head and stream.engines.postprocess finishes the job.

Checked here on the CPU (numpy): anchors rebuilt from metadata equal torchvision's; detections equal
torchvision's `postprocess_detections` on the same head outputs (tolerance in tests/postprocess_ref.py) on
real frames, at batch sizes 1, 3 and 4, in float32 and float16, with images that have no detection; the
pipeline gives the same detections with a head model as with the graph model of the same weights; bad head
metadata fails clearly. The CuPy side runs the same comparisons in tests/gpu/test_gpu_postprocess.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
ort = pytest.importorskip("onnxruntime")

from stream.engines.model import describe, load_info  # noqa: E402
from stream.engines.postprocess import HeadSpec, Level, Postprocessor, anchors  # noqa: E402
from stream.errors import ModelError  # noqa: E402
from stream.tools.export import build_model, export_model, head_spec  # noqa: E402
from stream.tools.sample import _background, render_frame  # noqa: E402
from tests.conftest import collect_run, detections_of, unmatched  # noqa: E402
from tests.postprocess_ref import assert_parity, compare, reference  # noqa: E402

HEIGHT, WIDTH = 256, 320


@pytest.fixture(scope="module")
def head_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("head")
    common = {
        "arch": "retinanet_tiny",
        "weights": "random",
        "input_size": (HEIGHT, WIDTH),
        "batch": 4,
        "score_thresh": 0.3,
    }
    return {
        "fp32": export_model(d / "tiny_head.onnx", postprocess="device", **common),
        "fp16": export_model(d / "tiny_head16.onnx", postprocess="device", fp16=True, **common),
    }


def frames(indices: list[int], dark: tuple[int, ...] = ()) -> np.ndarray:
    """Sample-video frames at the model size, float32 NCHW 0..1; positions in `dark` are black (no detections)."""
    bg = _background(WIDTH, HEIGHT)
    out = [render_frame(i, 120, bg).transpose(2, 0, 1).astype(np.float32) / 255.0 for i in indices]
    for k in dark:
        out[k][:] = 0.0
    return np.stack(out)


def head_outputs(path: Path, x: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
    info = load_info(path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cls, reg = sess.run(info.output_names, {info.input_name: x.astype(info.dtype)})
    return info, cls, reg


@pytest.mark.parametrize(
    ("height", "width", "arch"),
    [(256, 320, "retinanet_tiny"), (250, 330, "retinanet_tiny"), (800, 800, "retinanet_resnet50_fpn_v2")],
)
def test_anchors_equal_torchvisions(height: int, width: int, arch: str) -> None:
    """Including a size that is not a multiple of 32 (padded) and the full model's 5 levels at 800x800,
    whose strides are 8, 16, 32, 61 and 114 by torchvision's rule (size // grid), not powers of two."""
    model = build_model(arch, "random", score_thresh=0.05, max_detections=100, seed=0)
    spec = head_spec(model, height, width)  # raises if they differ
    if arch != "retinanet_tiny":
        assert [lv.stride[0] for lv in spec.levels] == [8, 16, 32, 61, 114]
        assert anchors(spec).shape == (120087, 4)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_detections_equal_torchvision(head_models: dict[str, Path], n: int, precision: str) -> None:
    x = frames([3, 40, 90, 130][:n], dark=(n - 1,) if n > 1 else ())
    info, cls, reg = head_outputs(head_models[precision], x)
    assert cls.shape[0] == n and cls.dtype == (np.float16 if precision == "fp16" else np.float32)
    ours = Postprocessor(info.head)(cls, reg, n)
    ref = reference(info.head, cls, reg)
    r = assert_parity(ours, ref)
    assert r["total"] > 0  # the test model sees the scene
    if n > 1:  # the black frame: nothing, in both
        assert r["per_image"][-1] == (0, 0)


def test_rows_past_valid_are_ignored(head_models: dict[str, Path]) -> None:
    info, cls, reg = head_outputs(head_models["fp32"], frames([3, 40, 90, 130]))
    boxes, scores, labels, bi = Postprocessor(info.head)(cls, reg, 2)
    assert set(bi.tolist()) <= {0, 1}
    assert compare((boxes, scores, labels, bi), reference(info.head, cls[:2], reg[:2]))["unmatched"] == 0


def test_crowded_synthetic_heads_equal_torchvision() -> None:
    """Random head outputs over a small grid: thousands of candidates, heavy NMS, per-level top-k cut."""
    spec = HeadSpec(
        cls="c",
        reg="r",
        num_classes=3,
        image_size=(64, 96),
        topk_candidates=50,
        detections_per_img=40,
        score_thresh=0.2,
        levels=(
            Level((8, 12), (8, 8), (16.0, 20.0), (0.5, 1.0, 2.0)),
            Level((4, 6), (16, 16), (32.0,), (0.5, 1.0, 2.0, 4.0, 0.25, 1.5)),
        ),
    )
    rng = np.random.default_rng(0)
    a = anchors(spec).shape[0]
    cls = rng.normal(0, 1.5, (5, a, 3)).astype(np.float32)
    reg = rng.normal(0, 0.4, (5, a, 4)).astype(np.float32)
    cls[2] = -20.0  # an image with no score above the threshold
    ours = Postprocessor(spec)(cls, reg, 5)
    r = assert_parity(ours, reference(spec, cls, reg))
    assert r["per_image"][2] == (0, 0) and r["total"] > 100
    assert all(n == spec.detections_per_img for n, _ in np.array(r["per_image"])[[0, 1, 3, 4]].tolist())


CROWDED = HeadSpec(
    cls="c",
    reg="r",
    num_classes=3,
    image_size=(64, 96),
    topk_candidates=50,
    detections_per_img=40,
    score_thresh=0.2,
    levels=(
        Level((8, 12), (8, 8), (16.0, 20.0), (0.5, 1.0, 2.0)),
        Level((4, 6), (16, 16), (32.0,), (0.5, 1.0, 2.0, 4.0, 0.25, 1.5)),
    ),
)


def crowded_heads(seed: int = 0, images: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = anchors(CROWDED).shape[0]
    cls = rng.normal(0, 1.5, (images, a, 3)).astype(np.float32)
    reg = rng.normal(0, 0.4, (images, a, 4)).astype(np.float32)
    cls[2] = -20.0  # an image with no score above the threshold
    return cls, reg


def test_packed_rows_equal_pack_detections_of_the_detections() -> None:
    """Postprocessor.packed (the CUDA engine's one download: a count, then the rows) holds exactly the rows
    frames.pack_detections makes of the detections __call__ returns, in the same order, at every batch size,
    with the detections_per_img cap reached and an image without detections; nothing at all gives a count of 0."""
    from stream.core.frames import pack_detections, unpack_counted

    cls, reg = crowded_heads()
    sizes = np.array([[1920, 1080], [640, 360], [1280, 720], [96, 64], [3840, 2160]], np.int64)
    post = Postprocessor(CROWDED)
    for n in range(1, 6):
        want = pack_detections(np, *post(cls, reg, n), sizes[:n], (96, 64), n)
        got = post.packed(cls, reg, n, sizes[:n], (96, 64))
        assert got.shape[1] == 7 and int(got[0, 0]) == len(want)
        np.testing.assert_array_equal(unpack_counted(got), want)
    assert n == 5 and len(want) == 4 * CROWDED.detections_per_img  # capped on four images, none on the third
    blank = np.full_like(cls, -20.0)
    assert len(unpack_counted(post.packed(blank, reg, 5, sizes, (96, 64)))) == 0


def test_warm_up_outputs_are_full_of_detections() -> None:
    """The CUDA engine's warm-up replaces a blank batch's outputs with stream.engines.cuda.synthetic_outputs, so
    that the code that runs only on detections (top-k, NMS, packing) compiles its kernels at start. Checked here
    with numpy: every image of every batch size has detections, from a head model's outputs and a graph model's."""
    from stream.core.frames import pack_detections
    from stream.engines.cuda import synthetic_outputs

    spec = HeadSpec(
        cls="c",
        reg="r",
        num_classes=3,
        image_size=(64, 96),
        topk_candidates=50,
        detections_per_img=40,
        score_thresh=0.3,
        levels=(Level((8, 12), (8, 8), (16.0, 20.0), (0.5, 1.0, 2.0)),),
    )
    a = anchors(spec).shape[0]
    blank = [np.zeros((4, a, 3), np.float16), np.zeros((4, a, 4), np.float16)]
    cls, reg = synthetic_outputs(np, blank, 4, head=True)
    assert cls.shape == blank[0].shape and cls.dtype == np.float16 and reg.dtype == np.float16
    sizes = np.array([[1920, 1080]] * 4, np.int64)
    for n in range(1, 5):
        boxes, scores, labels, bi = Postprocessor(spec)(cls, reg, n)
        assert sorted(set(bi.tolist())) == list(range(n)), f"batch of {n}: images without detections"
        packed = pack_detections(np, boxes, scores, labels, bi, sizes[:n], (96, 64), n)
        assert len(packed) == len(scores) > 10 * n
    graph = [
        np.zeros((0, 4), np.float32),
        np.zeros((0,), np.float32),
        np.zeros((0,), np.int64),
        np.zeros((0,), np.int64),
    ]
    made = synthetic_outputs(np, graph, 4, head=False)
    assert [m.dtype for m in made] == [g.dtype for g in graph] and len(made[0]) == 32
    assert (made[0][:, 2:] > made[0][:, :2]).all() and sorted(set(made[3].tolist())) == [0, 1, 2, 3]
    assert len(pack_detections(np, *made, sizes, (96, 64), 4)) == 32


def test_pipeline_with_a_head_model_equals_the_graph_model(tmp_path: Path, videos: dict[str, Path]) -> None:
    """Same weights exported both ways: `stream run` publishes the same detections, frame by frame."""
    common = {
        "arch": "retinanet_tiny",
        "weights": "random",
        "input_size": (HEIGHT, WIDTH),
        "batch": 4,
        "score_thresh": 0.3,
    }
    graph = export_model(tmp_path / "graph.onnx", **common)
    head = export_model(tmp_path / "head.onnx", postprocess="device", **common)
    from tests.conftest import free_port

    got = {}
    for name, model in (("graph", graph), ("head", head)):
        _, msgs = collect_run([f"v={videos['plain']}"], f"tcp://127.0.0.1:{free_port()}", model=str(model))
        got[name] = detections_of(msgs["v"])
    assert len(got["graph"]) == len(got["head"]) > 0
    total = sum(len(d) for d in got["graph"])
    missing = sum(
        len(unmatched(a, b, min_iou=0.999, score_tol=1e-4, floor=0.0)) for a, b in zip(got["graph"], got["head"])
    )
    extra = sum(
        len(unmatched(b, a, min_iou=0.999, score_tol=1e-4, floor=0.0)) for a, b in zip(got["graph"], got["head"])
    )
    assert total > 0 and missing <= max(1, total // 100) and extra <= max(1, total // 100), (total, missing, extra)


def test_bad_head_metadata_fails_clearly(head_models: dict[str, Path]) -> None:
    info = load_info(head_models["fp32"])
    sess = ort.InferenceSession(str(info.path), providers=["CPUExecutionProvider"])
    meta = dict(sess.get_modelmeta().custom_metadata_map)
    inputs, outputs = sess.get_inputs(), sess.get_outputs()
    broken = {**meta, "stream.head": "{not json"}
    with pytest.raises(ModelError, match="stream.head is malformed"):
        describe(info.path, broken, inputs, outputs)
    renamed = json.loads(meta["stream.head"])
    renamed["cls"] = "logits"
    with pytest.raises(ModelError, match="no output 'logits'"):
        describe(info.path, {**meta, "stream.head": json.dumps(renamed)}, inputs, outputs)
    resized = json.loads(meta["stream.head"])
    resized["image_size"] = [800, 800]
    with pytest.raises(ModelError, match="is for 800x800"):
        describe(info.path, {**meta, "stream.head": json.dumps(resized)}, inputs, outputs)
    wrong = Postprocessor(HeadSpec.from_json(meta["stream.head"]))
    with pytest.raises(ModelError, match="Re-export"):
        wrong(np.zeros((1, 10, 91), np.float32), np.zeros((1, 10, 4), np.float32), 1)


def test_export_reports_postprocess(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from stream.tools.export import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--arch",
            "retinanet_tiny",
            "--weights",
            "random",
            "--input-size",
            "64",
            "96",
            "--postprocess",
            "device",
            "--output",
            str(tmp_path / "h.onnx"),
        ]
    )
    assert run(args) == 0
    assert "postprocess device" in capsys.readouterr().out
    info = load_info(tmp_path / "h.onnx")
    assert info.dynamic_batch and info.postprocess == "device"


def test_the_batch_axis_a_padded_engine_fixes(head_models: dict[str, Path]) -> None:
    """With pad_partial every run of a dynamic-batch model is at its full batch, so the CUDA engine fixes the axis
    (ORT's free dimension override, which folds the graph's shape arithmetic): the axis is found by name, the
    fixed session gives the dynamic one's outputs at the full batch, and refuses any other batch (it is fixed)."""
    from dataclasses import replace

    from stream.engines.cpu import session_options
    from stream.engines.cuda import conv_algo_choice, fixed_batch_dim

    info = load_info(head_models["fp32"])
    assert info.dynamic_batch and info.batch_dim == "batch" and info.batch == 4
    assert fixed_batch_dim(info, pad_partial=True) == "batch"
    assert fixed_batch_dim(info, pad_partial=False) is None
    assert fixed_batch_dim(replace(info, dynamic_batch=False, batch_dim=None), pad_partial=True) is None
    assert conv_algo_choice("auto", info, fixed=True) == "EXHAUSTIVE" and conv_algo_choice("auto", info) == "HEURISTIC"
    so = session_options()
    so.add_free_dimension_override_by_name(info.batch_dim, info.batch)
    fixed = ort.InferenceSession(str(info.path), so, providers=["CPUExecutionProvider"])
    assert fixed.get_inputs()[0].shape[0] in ("batch", 4)  # the declared shape; the override acts inside
    x = frames([3, 10, 20, 40])
    got = fixed.run(info.output_names, {info.input_name: x})
    _, cls, reg = head_outputs(info.path, x)
    np.testing.assert_allclose(got[0], cls, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], reg, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="(?i)dimension|shape|invalid"):
        fixed.run(info.output_names, {info.input_name: x[:2]})
