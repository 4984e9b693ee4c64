"""A small deterministic test video: coloured shapes moving over a texture, with a dark stretch.

Tests and `scripts/make_small_model.py` make their videos with this instead of shipping binary files.
The content depends only on (width, height, fps, seconds): the same arguments give the same pixels
(the encoded bytes may still differ between FFmpeg builds).

Odd sizes: H.264/HEVC cannot store 4:2:0 chroma for an odd width or height, so with `pix_fmt=None`
libx264/libx265 switch to yuv444p there (NVDEC does not decode 4:4:4 H.264: use mpeg4 or libvpx-vp9,
which take odd 4:2:0 sizes, to test the GPU path with odd sizes).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from stream.libc import mallopt

log = logging.getLogger(__name__)

DARK_LEVEL = 0  # black: also what letterboxing usually pads with, so a padded dark frame stays flat
_EVEN_ONLY_420 = {"libx264", "libx265", "h264", "hevc"}
_FORMATS = {".mp4": "mp4", ".mkv": "matroska", ".webm": "webm", ".mov": "mov", ".avi": "avi"}


def dark_frames(fps: int = 30, seconds: float = 4.0) -> range:
    """Indices of the plain dark frames: 10 frames starting half way through."""
    return _dark_range(max(1, round(fps * seconds)))


def _dark_range(total: int) -> range:
    start = total // 2
    return range(start, min(total, start + 10))


def _background(width: int, height: int) -> np.ndarray:
    # Texture so that the encoder has real work and a detector's features are not flat.
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = 90 + 40 * np.sin(x / 13.0) * np.cos(y / 17.0) + 30 * ((x // 24 + y // 24) % 2)
    noise = np.random.default_rng(0).integers(-12, 13, size=(height, width), dtype=np.int16)
    gray = np.clip(base + noise, 0, 255).astype(np.uint8)
    return np.stack([gray, (gray * 0.9).astype(np.uint8), (gray * 0.8).astype(np.uint8)], axis=-1)


def render_frame(index: int, total: int, background: np.ndarray) -> np.ndarray:
    """Frame `index` of `total` as an RGB uint8 array (H, W, 3)."""
    h, w = background.shape[:2]
    if index in _dark_range(total):
        return np.full_like(background, DARK_LEVEL)
    img = background.copy()
    t = index / max(1, total - 1)  # 0..1 over the clip
    y, x = np.ogrid[0:h, 0:w]
    # Red rectangle sweeping left to right.
    rx, rw, rh = int(-0.2 * w + 1.3 * w * t), max(2, w // 6), max(2, h // 4)
    img[h // 8 : h // 8 + rh, max(0, rx) : max(0, rx + rw)] = (220, 30, 30)
    # Green ellipse moving on a circle.
    cx, cy = w * (0.5 + 0.3 * np.cos(6.28 * t)), h * (0.55 + 0.25 * np.sin(6.28 * t))
    ax, ay = max(2.0, w / 10), max(2.0, h / 7)
    img[((x - cx) / ax) ** 2 + ((y - cy) / ay) ** 2 <= 1.0] = (30, 200, 60)
    # Blue rectangle that grows and shrinks in a corner.
    s = 0.05 + 0.2 * abs(np.sin(3.14 * 2 * t))
    img[int(h * (0.95 - s)) : int(h * 0.95), int(w * 0.05) : int(w * (0.05 + s))] = (40, 60, 230)
    # Yellow ellipse that is only there in the last third: the number of objects changes.
    if t > 0.66:
        cx2, cy2 = w * (1.1 - 0.6 * (t - 0.66) / 0.34), h * 0.3
        img[((x - cx2) / (w / 12)) ** 2 + ((y - cy2) / (h / 9)) ** 2 <= 1.0] = (240, 220, 40)
    return img


M_PERTURB = -6  # glibc's malloc.h


@contextlib.contextmanager
def zeroed_heap() -> Iterator[None]:
    """While inside, glibc zeroes the heap memory it hands out (M_PERTURB 0xFF: what MALLOC_PERTURB_ sets; memory
    handed out is filled with the byte's complement), as a fresh process's is, so that code reading memory it
    never wrote reads the same bytes every time; off again after. Left alone where MALLOC_PERTURB_ is set, and on
    C libraries without mallopt."""
    if mallopt(M_PERTURB, 0xFF, "MALLOC_PERTURB_") is None:
        yield
        return
    try:
        yield
    finally:
        mallopt(M_PERTURB, 0, "MALLOC_PERTURB_")


def make_sample_video(
    path: str | Path,
    *,
    width: int = 640,
    height: int = 360,
    fps: int = 30,
    seconds: float = 4.0,
    codec: str = "libx264",
    bframes: int = 0,
    pix_fmt: str | None = None,
) -> Path:
    """Write the sample video to `path` (atomically) and return the path.

    `pix_fmt=None` means yuv420p, or yuv444p where the codec needs even sizes for 4:2:0 (see module doc).
    """
    import av

    out = Path(path)
    odd = width % 2 or height % 2
    if pix_fmt is None:
        pix_fmt = "yuv444p" if odd and codec in _EVEN_ONLY_420 else "yuv420p"
    elif odd and codec in _EVEN_ONLY_420 and pix_fmt.endswith("420p"):
        raise ValueError(f"{codec} cannot encode {pix_fmt} at odd size {width}x{height}; use pix_fmt='yuv444p' or None")
    total = max(1, round(fps * seconds))
    # Temp name in the same folder (so the rename is atomic), hidden, and matched by .gitignore's *.mp4.tmp.
    tmp = out.with_name(f".{os.getpid()}.{out.name}.tmp")
    try:
        with av.open(
            str(tmp), "w", format=_FORMATS.get(out.suffix.lower(), out.suffix.lstrip(".") or "mp4")
        ) as container:
            stream = container.add_stream(codec, rate=fps)
            if not isinstance(stream, av.VideoStream):  # any codec name is accepted; this one must encode video
                raise ValueError(f"{codec} is not a video codec")
            stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
            # "bf" is FFmpeg's generic max_b_frames; set it always since x264 defaults to 3 B-frames.
            stream.codec_context.options = {"bf": str(bframes), "g": str(fps)}
            background = _background(width, height)
            # libx264 (through FFmpeg) reads heap memory it never wrote at some odd sizes: yuv444p 321x241 gave
            # other bytes now and then on later encodes in one process, whatever the threads; with the heap it
            # is handed zeroed, as a fresh process's is, the same arguments give the same file every time.
            with zeroed_heap():
                for i in range(total):
                    frame = av.VideoFrame.from_ndarray(render_frame(i, total, background), format="rgb24")
                    frame.pts = i
                    container.mux(stream.encode(frame))
                container.mux(stream.encode())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log.debug("wrote %s: %dx%d %s %s, %d frames, bframes=%d", out, width, height, codec, pix_fmt, total, bframes)
    return out
