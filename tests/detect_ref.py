"""A plain reference for what the pipeline publishes per frame: PyAV decode, numpy preprocessing, `session.run`.

Independent of the pipeline: frames decoded here with PyAV, converted to RGB from their planes by the numpy
reference of tests/colour_ref.py (the stream's matrix and range, bilinear chroma), resized with numpy in
float64 (`bilinear`), run through the shipped model with onnxruntime directly; each detection list is keyed by the frame's position in
decode order, which is the `frame` number of the pipeline's messages.

Tolerance (the CPU path against this reference): the pipeline converts and resizes in float32, so the inputs
differ by float rounding only. Every detection scoring at least 0.001 over the model's threshold must be
found in the other set with the same label, IoU >= 0.99 and a score within 0.001 (`unmatched` in conftest).
Detections closer to the threshold may exist on one side only.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import av
import numpy as np

from stream.messages import detection_list
from tests.colour_ref import frame_reference_rgb
from tests.conftest import unmatched

MIN_IOU = 0.99
SCORE_TOL = 0.001
FLOOR_OVER_THRESH = 0.001


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
    """The detections of every frame of `path`, in decode order (index = the messages' `frame`)."""
    return [list(d) for d in _reference(str(path), path.stat().st_mtime_ns, str(info.path))]


def _as_the_cpu_route_rounds(rgb: np.ndarray, info: Any, codec: str) -> np.ndarray:
    """The CPU route converts a frame of up to SWSCALE_MAX_RATIO times the model's pixels whole, to uint8 RGB,
    where its decoder sites chroma as the conversion does (H.264, HEVC: stream/sources/colour.py): the
    reference rounds those the same way, the others it leaves in float."""
    from stream.sources.colour import LEFT_SITED_CODECS, SWSCALE_MAX_RATIO

    small = rgb.shape[0] * rgb.shape[1] <= SWSCALE_MAX_RATIO * info.width * info.height
    return np.clip(np.rint(rgb), 0, 255) if small and codec in LEFT_SITED_CODECS else rgb


@functools.lru_cache(maxsize=16)
def _reference(path: str, mtime_ns: int, model: str) -> tuple[tuple[dict[str, Any], ...], ...]:
    import onnxruntime as ort

    from stream.engines.model import load_info

    info = load_info(Path(model))
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    with av.open(path) as c:
        codec = c.streams.video[0].codec_context.name
        rgbs = [_as_the_cpu_route_rounds(frame_reference_rgb(f), info, codec) for f in c.decode(video=0)]
    out: list[tuple[dict[str, Any], ...]] = []
    for start in range(0, len(rgbs), info.batch):  # the model's fixed batch; rows past the end stay zero
        group = rgbs[start : start + info.batch]
        x = np.zeros((info.batch, 3, info.height, info.width), np.float32)
        for row, rgb in enumerate(group):
            x[row] = bilinear(rgb, info.width, info.height, rnd=False).transpose(2, 0, 1) / 255.0
        boxes, scores, labels, bi = sess.run(info.output_names, {info.input_name: x})
        for row, rgb in enumerate(group):
            keep = bi == row
            h, w = rgb.shape[:2]
            sx, sy = w / info.width, h / info.height
            b = np.clip(boxes[keep] * np.array([sx, sy, sx, sy], np.float32), 0, [w, h, w, h])
            dets = detection_list(b.tolist(), scores[keep].tolist(), labels[keep].tolist(), info.label_names)
            out.append(tuple(dets))
    return tuple(out)


def floor_of(info: Any) -> float:
    return (info.score_thresh or 0.0) + FLOOR_OVER_THRESH


def differences(a: list[dict[str, Any]], b: list[dict[str, Any]], info: Any) -> list[dict[str, Any]]:
    """Detections of either list (over the floor) with no match in the other one."""
    kw = {"min_iou": MIN_IOU, "score_tol": SCORE_TOL, "floor": floor_of(info)}
    return unmatched(a, b, **kw) + unmatched(b, a, **kw)


def assert_matches_reference(
    msgs: list[dict[str, Any]], ref: list[list[dict[str, Any]]], info: Any, sid: str = ""
) -> None:
    """The detections of each published frame equal the reference's for that frame number (not position)."""
    got = {m["frame"]: m["detections"] for m in msgs if m["type"] == "detections"}
    assert sorted(got) == list(range(len(ref))), f"{sid}: frame numbers are not 0..{len(ref) - 1}"
    floor = floor_of(info)
    compared = 0
    for i, r in enumerate(ref):
        diff = differences(r, got[i], info)
        assert not diff, f"{sid} frame {i}: published {got[i]}, the reference has {r}; unmatched: {diff}"
        compared += sum(d["score"] >= floor for d in r)
    assert compared > 0, f"{sid}: no detection was compared: the test would pass on anything"


def assert_neighbours_differ(ref: list[list[dict[str, Any]]], info: Any, frames: range) -> None:
    """Frames i and i+1 (i in `frames`) have detections that the tolerance tells apart: a test comparing
    with `assert_matches_reference` sees detections moved to a neighbouring frame there."""
    same = [i for i in frames if not differences(ref[i], ref[i + 1], info)]
    assert not same, f"the reference cannot tell frame i from frame i+1 for i in {same}: pick another video"
