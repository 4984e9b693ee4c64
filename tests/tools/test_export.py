"""Export torchvision RetinaNets to ONNX and check the files against the runtime's contract (stream.engines.model)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from stream.engines.model import ModelInfo, load_info  # noqa: E402
from stream.errors import ModelError  # noqa: E402
from stream.tools.export import add_arguments, export_model, run  # noqa: E402
from stream.tools.sample import _background, render_frame  # noqa: E402

HEIGHT, WIDTH, BATCH = 256, 320, 2
# retinanet_tiny's shipped threshold; the full model's random scores sit just above the 0.01 prior, so a
# threshold of 0 keeps max_detections per image and makes N predictable.
SETTINGS = {
    "retinanet_tiny": {"score_thresh": 0.3},
    "retinanet_resnet50_fpn_v2": {"score_thresh": 0.0, "max_detections": 20},
}


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each architecture exported once for the module (the full model takes ~10 s)."""
    paths: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in paths:
            out = tmp_path_factory.mktemp(arch) / f"{arch}.onnx"
            paths[arch] = export_model(
                out, arch=arch, weights="random", input_size=(HEIGHT, WIDTH), batch=BATCH, **SETTINGS[arch]
            )
        return paths[arch]

    return get


@pytest.fixture(params=sorted(SETTINGS))
def exported(request: pytest.FixtureRequest, export: Callable[[str], Path]) -> Path:
    return export(request.param)


def scene(index: int) -> np.ndarray:
    """A frame of the sample video at the model size, as float32 CHW in 0..1."""
    rgb = render_frame(index, 120, _background(WIDTH, HEIGHT))
    return rgb.transpose(2, 0, 1).astype(np.float32) / 255.0


def infer(info: ModelInfo, images: list[np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(info.path), providers=["CPUExecutionProvider"])
    batch = np.stack(images).astype(info.dtype)
    return dict(
        zip(["boxes", "scores", "labels", "batch_index"], session.run(info.output_names, {info.input_name: batch}))
    )


def check_outputs(out: dict[str, np.ndarray], info: ModelInfo) -> None:
    n = len(out["scores"])
    assert out["boxes"].shape == (n, 4) and out["labels"].shape == (n,) and out["batch_index"].shape == (n,)
    assert out["labels"].dtype == np.int64 and out["batch_index"].dtype == np.int64
    assert ((out["batch_index"] >= 0) & (out["batch_index"] < info.batch)).all()
    assert ((out["labels"] >= 0) & (out["labels"] < len(info.label_names))).all()
    boxes = out["boxes"]
    assert (boxes >= 0).all() and (boxes[:, [0, 2]] <= info.width).all() and (boxes[:, [1, 3]] <= info.height).all()
    assert (boxes[:, 2] >= boxes[:, 0]).all() and (boxes[:, 3] >= boxes[:, 1]).all()
    assert (out["scores"] >= (info.score_thresh or 0.0)).all()


def test_metadata_matches_export(exported: Path) -> None:
    info = load_info(exported)
    assert (info.batch, info.height, info.width, info.dtype) == (BATCH, HEIGHT, WIDTH, "float32")
    assert info.architecture == exported.stem
    assert info.input_name == "images" and info.batch_index == "batch_index"
    assert info.scale == pytest.approx(1 / 255) and info.mean == (0, 0, 0) and info.std == (1, 1, 1)
    assert len(info.label_names) == 91 and info.label_name(1) == "person"
    assert info.score_thresh == SETTINGS[exported.stem]["score_thresh"]


def test_two_images_give_consistent_dynamic_outputs(exported: Path) -> None:
    info = load_info(exported)
    out = infer(info, [scene(10), scene(100)])
    check_outputs(out, info)
    assert len(out["scores"]) > 0
    per_image = [out["scores"][out["batch_index"] == i] for i in range(BATCH)]
    assert not np.array_equal(np.sort(per_image[0]), np.sort(per_image[1]))  # the images differ, so do the results


def test_tiny_sees_nothing_in_a_dark_frame(export: Callable[[str], Path]) -> None:
    info = load_info(export("retinanet_tiny"))  # its random init is built to ignore flat images
    dark = np.zeros((3, HEIGHT, WIDTH), np.float32)
    empty = infer(info, [dark, dark])
    check_outputs(empty, info)
    assert empty["boxes"].shape == (0, 4)
    mixed = infer(info, [dark, scene(10)])
    check_outputs(mixed, info)
    assert len(mixed["scores"]) > 0 and (mixed["batch_index"] == 1).all()


def test_fp16_export_runs_on_cpu(tmp_path: Path) -> None:
    path = export_model(
        tmp_path / "tiny16.onnx",
        arch="retinanet_tiny",
        input_size=(HEIGHT, WIDTH),
        batch=BATCH,
        fp16=True,
        score_thresh=0.3,
    )
    info = load_info(path)
    assert info.dtype == "float16"
    out = infer(info, [scene(10), scene(100)])
    check_outputs(out, info)
    assert out["boxes"].dtype == np.float32  # postprocess stays float32


def test_weights_from_a_state_dict(tmp_path: Path) -> None:
    from stream.tools.export import build_model

    state = build_model("retinanet_tiny", "random", score_thresh=0.3, max_detections=10, seed=1).state_dict()
    torch.save(state, tmp_path / "tiny.pth")
    path = export_model(
        tmp_path / "tiny.onnx", arch="retinanet_tiny", weights=str(tmp_path / "tiny.pth"), input_size=(64, 64)
    )
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta["stream.weights"] == str((tmp_path / "tiny.pth").resolve())
    with pytest.raises(ModelError, match="does not fit"):
        export_model(tmp_path / "v2.onnx", arch="retinanet_resnet50_fpn_v2", weights=str(tmp_path / "tiny.pth"))
    assert not (tmp_path / "v2.onnx").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": "missing.pth"}, "no such file"),
        ({"arch": "retinanet_tiny", "weights": "default"}, "no pretrained weights"),
        ({"arch": "yolo"}, "unknown --arch"),
        ({"input_size": (16, 16)}, "bad export settings"),
    ],
)
def test_bad_requests_raise_model_error(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        export_model(tmp_path / "m.onnx", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_errors_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--weights", str(tmp_path / "nope.pth"), "--output", str(tmp_path / "m.onnx")])
    assert args.input_size == [800, 800] and args.score_thresh == 0.05
    assert args.batch == 8 and args.postprocess == "device", "the fastest measured configuration is the default"
    assert run(args) == 2
    assert "no such file" in capsys.readouterr().err
