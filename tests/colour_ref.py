"""Videos with known colour signalling, and the numpy reference every decode route is measured against.

The videos: H.264 (libx264, qp 0: lossless, so the decoded planes are the planes written) of saturated colour
blocks whose edges fall on odd columns and rows, so that 4:2:0 chroma changes between two chroma samples
and every route has to interpolate it. The planes are made from RGB with the matrix and range the stream is
tagged with (or, untagged, the one the default should pick).

The reference, written here from the formulas and not from stream/sources/colour.py: from the decoded Y, U,
V planes, chroma upsampled bilinearly at the MPEG-2 siting (chroma j at luma column 2j, chroma i between luma
rows 2i and 2i + 1, clamped at the edges), converted in float64 with Kr, Kb (BT.601 0.299/0.114, BT.709
0.2126/0.0722) and the range (limited: Y 16-235, C 16-240; full: 0-255), clipped to [0, 255], rounded to
8-bit levels (the RGB image a decoder hands out); then, for a model input, resized with OpenCV's INTER_LINEAR on float (half-pixel centres, no
antialias) and scaled as the model asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KR_KB = {"BT.601": (0.299, 0.114), "BT.709": (0.2126, 0.0722)}
AVCOL_SPC = {"BT.601": 6, "BT.709": 1}  # SMPTE170M (BT.601 525), BT709
COLOURS = np.array(
    [
        (230, 25, 25),
        (25, 210, 40),
        (30, 30, 235),
        (235, 230, 20),
        (20, 220, 225),
        (225, 30, 220),
        (128, 128, 128),
        (12, 12, 12),
        (245, 245, 245),
        (250, 120, 10),
        (90, 10, 160),
    ],
    np.float64,
)


@dataclass(frozen=True)
class Clip:
    """A test video: its size, the matrix and range its planes were made with, and the tags it carries."""

    name: str
    width: int
    height: int
    matrix: str  # the matrix the planes were made with (what a route must convert with)
    full_range: bool
    tag_matrix: bool = True  # tagged in the bitstream (VUI) and the container
    tag_range: bool = True
    yuvj: bool = False  # full range by pixel format (yuvj420p) rather than by tag
    container: str = "mp4"
    container_only: bool = False  # the tags in the container (MKV Colour) only, not in the bitstream


CLIPS = [
    Clip("bt601_limited_sd", 352, 288, "BT.601", False),
    Clip("bt709_limited_hd", 1280, 720, "BT.709", False),
    Clip("bt601_full_sd", 352, 288, "BT.601", True),
    Clip("bt709_full_yuvj", 640, 360, "BT.709", True, tag_range=False, yuvj=True),
    Clip("bt709_limited_sd", 640, 360, "BT.709", False),  # tagged: the tag wins over the size's default
    Clip("untagged_sd", 352, 288, "BT.601", False, tag_matrix=False, tag_range=False),  # default: BT.601
    Clip("untagged_hd", 1280, 720, "BT.709", False, tag_matrix=False, tag_range=False),  # default: BT.709
    Clip("container_tags", 352, 288, "BT.709", True, container="mkv", container_only=True),
]


def pattern_planes(clip: Clip, frame_no: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Y [H, W], U, V [H/2, W/2] uint8 of saturated blocks (edges on odd columns and rows), made from RGB with
    the clip's matrix and range. Chroma is taken at each 2x2 block's top-left pixel, so a block edge at an odd
    column or row falls between two chroma samples."""
    H, W = clip.height, clip.width
    bw, bh = 14 + 2 * (frame_no % 2), 10  # even block sizes: edges at x = bw - 1, 2 bw - 1, ... (odd)
    ys, xs = np.mgrid[0:H, 0:W]
    idx = ((ys + 1) // bh * 5 + (xs + 1) // bw + frame_no) % len(COLOURS)
    ramp = 0.75 + 0.25 * (xs % 37) / 36.0  # a little texture inside the blocks
    rgb = COLOURS[idx] * ramp[..., None]
    kr, kb = KR_KB[clip.matrix]
    kg = 1.0 - kr - kb
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    y = kr * r + kg * g + kb * b
    cb = (b - y) / (2.0 * (1.0 - kb))
    cr = (r - y) / (2.0 * (1.0 - kr))
    if clip.full_range:
        y8, cb8, cr8 = y, cb + 128.0, cr + 128.0
    else:
        y8, cb8, cr8 = 16.0 + y * 219.0 / 255.0, 128.0 + cb * 224.0 / 255.0, 128.0 + cr * 224.0 / 255.0

    def q(a: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(a), 0, 255).astype(np.uint8)

    return q(y8), q(cb8[0::2, 0::2]), q(cr8[0::2, 0::2])


def make_clip(d: Path, clip: Clip, frames: int = 3, qp: int = 0) -> Path:
    """Write `clip` losslessly (libx264 qp 0, no B-frames, a keyframe every 10 frames) with its tags; MKV remuxed for container-only tags."""
    import av

    path = d / f"{clip.name}.{clip.container}"
    raw = d / f"{clip.name}.raw.mkv" if clip.container_only else path
    with av.open(str(raw), "w") as out:
        s = out.add_stream("libx264", rate=25)
        s.width, s.height = clip.width, clip.height
        s.pix_fmt = "yuvj420p" if clip.yuvj else "yuv420p"
        s.options = {"qp": str(qp), "preset": "ultrafast", "bf": "0", "g": "10"}
        ctx = s.codec_context
        if clip.tag_matrix and not clip.container_only:
            ctx.colorspace = AVCOL_SPC[clip.matrix]
        if clip.tag_range and not clip.container_only:
            ctx.color_range = 2 if clip.full_range else 1
        for i in range(frames):
            f = av.VideoFrame(clip.width, clip.height, s.pix_fmt)
            for p, a in zip(f.planes, pattern_planes(clip, i)):
                np.frombuffer(memoryview(p), np.uint8).reshape(p.height, p.line_size)[:, : a.shape[1]] = a
            f.pts = i
            for pk in s.encode(f):
                out.mux(pk)
        for pk in s.encode():
            out.mux(pk)
    if clip.container_only:  # the same bitstream (no colour in its VUI), the tags in the MKV's Colour element
        with av.open(str(raw)) as src, av.open(str(path), "w") as out:
            ist = src.streams.video[0]
            ost = out.add_stream_from_template(ist)
            ost.codec_context.colorspace = AVCOL_SPC[clip.matrix]
            ost.codec_context.color_range = 2 if clip.full_range else 1
            for pk in src.demux(ist):
                if pk.size:
                    pk.stream = ost
                    out.mux(pk)
    return path


def decoded(path: Path) -> list[Any]:
    """Every frame of `path` as PyAV decodes it."""
    import av

    with av.open(str(path)) as c:
        return list(c.decode(video=0))


def yuv_planes(frame: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Y, U, V of a decoded planar YUV frame (4:2:0, 4:2:2 or 4:4:4, 8-bit), each at its own size."""
    out = []
    for p in frame.planes:
        rows = np.frombuffer(memoryview(p), np.uint8).reshape(p.height, p.line_size)
        out.append(rows[:, : p.width].copy())
    return out[0], out[1], out[2]


def frame_reference_rgb(frame: Any) -> np.ndarray:
    """reference_rgb of a decoded frame, with the matrix and range its signalling resolves to (tags, else the
    default by size: stream/sources/colour.py's rule, which tests/sources/test_colour.py checks on its own)."""
    from stream.sources.colour import frame_colour

    c = frame_colour(frame)
    return reference_rgb(*yuv_planes(frame), c.matrix, c.full_range)


def reference_rgb(y: np.ndarray, u: np.ndarray, v: np.ndarray, matrix: str, full_range: bool) -> np.ndarray:
    """HxWx3 float64 RGB in [0, 255], whole levels, from the planes (module docstring; chroma planes of the luma's size, 4:4:4,
    are taken as they are)."""
    H, W = y.shape
    hc, wc = u.shape

    def taps(pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.clip(pos, 0, n - 1)
        i0 = np.floor(pos).astype(np.int64)
        return i0, np.minimum(i0 + 1, n - 1), pos - i0

    # 4:2:0: chroma row i at luma row 2i + 0.5, chroma column j at luma column 2j; not subsampled: at its own
    r0, r1, ar = taps((np.arange(H) - 0.5) / 2.0 if hc < H else np.arange(H, dtype=np.float64), hc)
    c0, c1, ac = taps(np.arange(W) / 2.0 if wc < W else np.arange(W, dtype=np.float64), wc)
    ar, ac = ar[:, None], ac[None, :]

    def up(c: np.ndarray) -> np.ndarray:
        c = c.astype(np.float64)
        rows = c[r0] * (1 - ar) + c[r1] * ar
        return rows[:, c0] * (1 - ac) + rows[:, c1] * ac

    kr, kb = KR_KB[matrix]
    kg = 1.0 - kr - kb
    yy, cb, cr = y.astype(np.float64), up(u) - 128.0, up(v) - 128.0
    if not full_range:
        yy, cb, cr = (yy - 16.0) * 255.0 / 219.0, cb * 255.0 / 224.0, cr * 255.0 / 224.0
    r = yy + 2.0 * (1.0 - kr) * cr
    b = yy + 2.0 * (1.0 - kb) * cb
    g = (yy - kr * r - kb * b) / kg
    return np.floor(np.clip(np.stack([r, g, b], axis=-1), 0.0, 255.0) + 0.5)


def reference_row(rgb: np.ndarray, info: Any) -> np.ndarray:
    """The model input [3, h, w] float32 of a reference RGB image: OpenCV INTER_LINEAR on float, then scaling."""
    import cv2

    f = rgb.astype(np.float32)
    if f.shape[:2] != (info.height, info.width):
        f = cv2.resize(f, (info.width, info.height), interpolation=cv2.INTER_LINEAR)
    std = np.asarray(info.std, np.float32)
    a = np.float32(info.scale) / std
    b = -np.asarray(info.mean, np.float32) / std
    return f.transpose(2, 0, 1) * a[:, None, None] + b[:, None, None]


def levels(row: np.ndarray, ref: np.ndarray, info: Any) -> np.ndarray:
    """|row - ref| of model inputs [3, h, w], in 0..255 pixel levels."""
    a = np.float32(info.scale) / np.asarray(info.std, np.float32)
    return np.abs(row.astype(np.float32) - ref.astype(np.float32)) / a[:, None, None]


def stats(d: np.ndarray) -> tuple[float, float, float]:
    """(mean, 99.9th percentile, max) of a difference in levels."""
    return float(d.mean()), float(np.percentile(d, 99.9)), float(d.max())


MEAN_MAX, P999_MAX = 0.5, 3.0  # the tolerance every route is held to, in levels
