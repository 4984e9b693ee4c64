"""The pipeline's detections equal a plain reference: PyAV decode, numpy preprocessing, `session.run` called directly.

Tolerance: the reference resizes with numpy in float64, the pipeline with OpenCV in float32, so inputs
differ by float rounding only. Every detection scoring at least 0.001 over the model's threshold must be
found in the other set with the same label, IoU >= 0.99 and a score within 0.001.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import av
import numpy as np
import onnxruntime as ort
import pytest

from stream.messages import detection_list

from tests.conftest import collect_run, detections_of, unmatched


def bilinear(img: np.ndarray, out_w: int, out_h: int, rnd: bool = True) -> np.ndarray:
    """Half-pixel-centre bilinear resize without antialiasing (OpenCV INTER_LINEAR, torch align_corners=False)."""
    h, w = img.shape[:2]

    def axis(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        src = np.clip(src, 0, n_in - 1)
        i0 = np.floor(src).astype(np.int64)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, src - i0

    y0, y1, fy = axis(out_h, h)
    x0, x1, fx = axis(out_w, w)
    f = img.astype(np.float64)
    top = f[y0][:, x0] * (1 - fx)[None, :, None] + f[y0][:, x1] * fx[None, :, None]
    bot = f[y1][:, x0] * (1 - fx)[None, :, None] + f[y1][:, x1] * fx[None, :, None]
    out = top * (1 - fy)[:, None, None] + bot * fy[:, None, None]
    if not rnd:
        return out
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def reference(path: Path, info: Any) -> list[list[dict[str, Any]]]:
    sess = ort.InferenceSession(str(info.path), providers=["CPUExecutionProvider"])
    out = []
    with av.open(str(path)) as c:
        for frame in c.decode(video=0):
            rgb = frame.to_ndarray(format="rgb24")
            x = np.zeros((info.batch, 3, info.height, info.width), np.float32)
            x[0] = bilinear(rgb, info.width, info.height, rnd=False).transpose(2, 0, 1) / 255.0
            boxes, scores, labels, bi = sess.run(info.output_names, {info.input_name: x})
            keep = bi == 0
            sx, sy = rgb.shape[1] / info.width, rgb.shape[0] / info.height
            b = boxes[keep] * np.array([sx, sy, sx, sy], np.float32)
            b = np.clip(b, 0, [rgb.shape[1], rgb.shape[0], rgb.shape[1], rgb.shape[0]])
            out.append(detection_list(b.tolist(), scores[keep].tolist(), labels[keep].tolist(), info.label_names))
    return out


def test_bilinear_matches_opencv() -> None:
    import cv2

    img = np.random.default_rng(1).integers(0, 256, (241, 321, 3), dtype=np.uint8)
    for size in ((320, 320), (97, 61), (640, 480)):
        ref = bilinear(img, *size, rnd=False)
        got = cv2.resize(img.astype(np.float32), size, interpolation=cv2.INTER_LINEAR)
        assert np.abs(ref - got).max() < 1e-3, size


@pytest.mark.parametrize("name", ["odd_bframes", "bframes"])
def test_pipeline_equals_reference(name: str, videos: dict[str, Path], model_info: Any, endpoint: str) -> None:
    _, by = collect_run([str(videos[name])], endpoint)
    got = detections_of(by[name])
    ref = reference(videos[name], model_info)
    assert len(got) == len(ref)
    floor = (model_info.score_thresh or 0.0) + 0.001
    compared = 0
    for i, (g, r) in enumerate(zip(got, ref)):
        assert not unmatched(r, g, min_iou=0.99, score_tol=0.001, floor=floor), (i, r, g)
        assert not unmatched(g, r, min_iou=0.99, score_tol=0.001, floor=floor), (i, g, r)
        compared += sum(d["score"] >= floor for d in r)
    assert compared > 0, "no detection was compared: the test would pass on anything"
