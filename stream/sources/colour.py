"""Colour: which YUV -> RGB conversion a stream gets, and the arithmetic every decode route shares.

Decision record:
- The matrix and range are the stream's own signalling: the frame's tags (`colorspace`, `color_range`, which
  FFmpeg's decoders fill from the bitstream's VUI, or from the container where the bitstream says nothing),
  else the stream's codec parameters, else the default below. `yuvj420p` is full range whatever its tags say.
  AVColorSpace 1 is BT.709; 5 and 6 BT.601; 9 and 10 BT.2020; 4 FCC and 7 SMPTE-240M, with swscale's own
  (Kr, Kb) for each. Limited range is Y 16-235, Cb/Cr 16-240; full range 0-255 around 128.
- The default where the stream signals no matrix: BT.709 for HD (width >= 1280 or height > 576), BT.601 for
  SD. That is how players such as mpv guess for untagged video, and what cameras encode: HD video is made to
  BT.709 (SMPTE 274M/296M), SD to BT.601, and H.264 and HEVC leave an untagged matrix to the application.
  FFmpeg's swscale takes BT.601 for every untagged stream, which shifts the colours of untagged HD video
  (most of what cameras send). The default range is limited, as H.264 and HEVC (video_full_range_flag 0),
  FFmpeg and players have it.
- Chroma (4:2:0) is upsampled bilinearly at the MPEG-2 / H.264 default siting: chroma sample (i, j) sits at
  luma column 2j (left, co-sited) and between luma rows 2i and 2i + 1. This is what H.264 and HEVC assume
  without a chroma_loc tag, what FFmpeg's decoders tag their frames with, and what swscale's accurate path
  (`BILINEAR | ACCURATE_RND | FULL_CHR_H_INT`) computes from such frames (measured: within 1 level of the
  float formula, mean 0.004). swscale's default (unscaled) yuv420p -> rgb24, what PyAV's
  `to_ndarray(format="rgb24")` runs, repeats each chroma sample over its 2x2 block and uses tables that come
  out about 0.8 level off the formula: it is not used for model input.
- The model row is made from the planes by one arithmetic on every route (`rgb_at_taps`): each output pixel
  reads the four luma samples of a bilinear resize with half-pixel centres and no antialiasing (OpenCV's
  INTER_LINEAR taps); each of those samples is converted on its own (its chroma interpolated where it sits,
  the matrix applied in float, clipped to [0, 255], rounded to the nearest level), and the four RGB values are
  blended with the bilinear weights, then scaled into the model's dtype. That is exactly converting the whole
  frame to 8-bit RGB first and resizing the RGB image second (what a model's training pipeline does to a
  decoded frame), at the cost of 4 luma
  samples per output pixel, whatever the source's size. The NVDEC routes run it as one CUDA kernel
  (stream/sources/nvdec.py `nv12_to_row`), the CPU routes with OpenCV and numpy (`yuv420_to_row`), DALI on
  its YCbCr output (stream/sources/dali.py). Resizing the planes first and converting second, as the NVDEC
  kernel once did, differs where the conversion clips: up to 22 levels at the 99.9th percentile on saturated
  colour edges (tests/sources/test_colour.py's pattern).
- Rounded to 8-bit levels before the resize, on every route: a decoder's RGB frame and the images a model is
  trained on are whole levels, and swscale (below) rounds too, so the CPU routes' two ways agree. Kept in float
  (as until 2026-12-07), the planes came out within half a level of swscale's, mean 0.12, and the shipped
  model (random weights, sensitive to its input) matched 19% of its detections between the two on the 640x360
  sample clip (IoU >= 0.9, score within 0.01); rounded, 100%. On an H100 the GPU route against the CPU route
  matched 59.7% because of it, while the two engines on identical input matched 99.65%.
- On the CPU the cost decides how: a frame of up to SWSCALE_MAX_RATIO times the model's pixels is converted
  whole by swscale's accurate path (its integer arithmetic rounds to the same levels but for a sample near a half level: mean 0.005, max 1) and the RGB image
  resized with OpenCV's INTER_LINEAR on float; a larger one from its planes (`yuv420_to_row`, the kernel's
  arithmetic in float, whose cost follows the model's size, not the frame's). Measured on this project's
  2-core CI machine, to the shipped 320x320 model: 640x360 2.3 ms whole against 20 ms from the planes; 1080p
  17 ms whole against 12 ms from the planes (swscale's default conversion took 1.1 and 5.6 ms). On a 2-core
  machine converting every frame of a 30 fps feed from the planes cost the CPU engine most of its throughput.
- 8-bit 4:2:2 and 4:4:4 frames (CPU routes only: not decoded on NVDEC here) take the same arithmetic, their
  chroma read where it sits. Frames of other pixel formats (10-bit, RGB, ...) are converted to RGB by
  swscale's accurate path with the signalled matrix and range, then resized as RGB (stream/sources/host.py).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import av

    from stream.engines.model import ModelInfo

log = logging.getLogger(__name__)

# AVColorSpace -> (name, Kr, Kb), as swscale's sws_getCoefficients picks them
MATRICES: dict[int, tuple[str, float, float]] = {
    1: ("BT.709", 0.2126, 0.0722),
    4: ("FCC", 0.30, 0.11),
    5: ("BT.601", 0.299, 0.114),
    6: ("BT.601", 0.299, 0.114),
    7: ("SMPTE-240M", 0.212, 0.087),
    9: ("BT.2020", 0.2627, 0.0593),
    10: ("BT.2020", 0.2627, 0.0593),
}
AVCOL_SPC_BT709 = 1
AVCOL_SPC_SMPTE170M = 6  # BT.601
AVCOL_RANGE_MPEG = 1
AVCOL_RANGE_JPEG = 2
# 8-bit YUV pixel formats converted from their planes (others: swscale, `to_rgb`)
PLANAR = {"yuv420p", "yuvj420p", "nv12", "yuv422p", "yuvj422p", "yuv444p", "yuvj444p"}
# the CPU routes convert a frame of up to this many times the model's pixels with swscale (`to_rgb`, whole
# frame, then resize), a larger one from its planes (`yuv420_to_row`): whichever costs less (module docstring)
SWSCALE_MAX_RATIO = 8
CHROMA = "bilinear, MPEG-2 siting (left, rows centred)"


def default_colorspace(width: int, height: int) -> int:
    """The AVColorSpace taken for a stream that signals none: BT.709 for HD, BT.601 for SD (module docstring)."""
    return AVCOL_SPC_BT709 if width >= 1280 or height > 576 else AVCOL_SPC_SMPTE170M


@dataclass(frozen=True)
class Colour:
    """The conversion a stream gets: the matrix (an AVColorSpace we convert with) and range, and where they
    came from ("frame" / "stream" tags, or "default")."""

    colorspace: int
    full_range: bool
    matrix_from: str = "default"
    range_from: str = "default"
    tags: tuple[int, int] = (2, 0)  # the AVColorSpace and AVColorRange the stream signalled
    # the decoder tags its frames' chroma as sited "left" (FFmpeg's H.264 and HEVC decoders), the siting this
    # module converts with: only then may swscale's accurate path stand in for the conversion from the planes
    # (it takes the siting from the frame's tag; an MPEG-4 Part 2 frame, untagged, came out 31 levels off at
    # p99.9 on its chroma edges)
    left_sited: bool = False

    @property
    def matrix(self) -> str:
        return MATRICES.get(self.colorspace, MATRICES[AVCOL_SPC_SMPTE170M])[0]

    @property
    def range(self) -> str:
        return "full" if self.full_range else "limited"

    def found(self) -> str:
        """What the stream signals, in words: 'BT.709, limited range (tagged)', 'untagged', ..."""
        cs, cr = self.tags
        matrix = MATRICES[cs][0] if cs in MATRICES else None
        rng = {1: "limited range", 2: "full range"}.get(cr)
        yuvj = "full range (yuvj pixel format)" if self.range_from == "pix_fmt" else None
        if matrix and rng:
            return f"{matrix}, {rng} (tagged)"
        if not matrix and not rng:
            return f"untagged, {yuvj}" if yuvj else "untagged"
        return f"{matrix + ' (tagged)' if matrix else 'no matrix tag'}, {rng + ' (tagged)' if rng else yuvj or 'no range tag'}"

    def describe(self) -> str:
        """'colour BT.709, limited range (tagged), converted BT.709 limited range, chroma bilinear, ...'"""
        how = f"{self.matrix} {self.range} range"
        if self.matrix_from == "default":
            how += " (default for its size)" if self.range_from == "default" else " (matrix: default for its size)"
        elif self.range_from == "default":
            how += " (range: default)"
        return f"colour {self.found()}, converted {how}, chroma {CHROMA}"


def resolve(
    colorspace: int | None,
    color_range: int | None,
    width: int,
    height: int,
    *,
    pix_fmt: str | None = None,
    stream_colorspace: int | None = None,
    stream_color_range: int | None = None,
) -> Colour:
    """The conversion for a frame with these tags (AVColorSpace, AVColorRange) and size: its own tags, else its
    stream's, else the default (module docstring)."""
    cs_tag = int(colorspace or 0) if int(colorspace or 0) in MATRICES else int(stream_colorspace or 0)
    cs_from = "frame" if int(colorspace or 0) in MATRICES else "stream"
    cr_tag = int(color_range or 0) if int(color_range or 0) in (1, 2) else int(stream_color_range or 0)
    cr_from = "frame" if int(color_range or 0) in (1, 2) else "stream"
    if cs_tag in MATRICES:
        cs = cs_tag
    else:
        cs, cs_from = default_colorspace(width, height), "default"
    if pix_fmt is not None and pix_fmt.startswith("yuvj"):
        full, cr_from = True, "pix_fmt"
    elif cr_tag in (1, 2):
        full = cr_tag == AVCOL_RANGE_JPEG
    else:
        full, cr_from = False, "default"
    return Colour(cs, full, cs_from, cr_from, (cs_tag, cr_tag))


def yuv_to_rgb(colorspace: int | None = None, full_range: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(M [3, 3], offset [3]): rgb = M @ [Y, U, V] + offset, in 0..255 units.

    colorspace is the AVColorSpace to convert with (1 BT.709, 5/6 BT.601, 4 FCC, 7 SMPTE-240M, 9/10 BT.2020;
    anything else BT.601: resolve the stream's own with `resolve` first); full_range: JPEG range (0-255)
    instead of limited range (Y 16-235, C 16-240).
    """
    _, kr, kb = MATRICES.get(int(colorspace or 0), MATRICES[AVCOL_SPC_SMPTE170M])
    kg = 1.0 - kr - kb
    ys, cs, yo = (1.0, 1.0, 0.0) if full_range else (255.0 / 219.0, 255.0 / 224.0, 16.0)
    rv, bu = cs * 2.0 * (1.0 - kr), cs * 2.0 * (1.0 - kb)
    gu, gv = -bu * kb / kg, -rv * kr / kg
    m = np.array([[ys, 0.0, rv], [ys, gu, gv], [ys, bu, 0.0]], np.float64)
    offset = -m @ np.array([yo, 128.0, 128.0])
    return m, offset


# -- frames --------------------------------------------------------------------------------------------------
LEFT_SITED_CODECS = {"h264", "hevc"}  # FFmpeg's decoders of these tag their frames' chroma location "left"


def frame_colour(frame: av.VideoFrame, ctx: Any = None) -> Colour:
    """The conversion for a PyAV frame: its tags, else its stream's (`ctx`: the codec context), else the default."""
    fmt = frame.format.name
    colour = resolve(
        _int(getattr(frame, "colorspace", None)),
        _int(getattr(frame, "color_range", None)),
        frame.width,
        frame.height,
        pix_fmt=fmt,
        stream_colorspace=_int(getattr(ctx, "colorspace", None)) if ctx is not None else None,
        stream_color_range=_int(getattr(ctx, "color_range", None)) if ctx is not None else None,
    )
    if ctx is not None and getattr(ctx, "name", None) in LEFT_SITED_CODECS:
        colour = replace(colour, left_sited=True)
    return colour


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def planes(frame: av.VideoFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(Y [H, W], U, V) of a planar YUV frame, each at its own size, or (Y, UV [Hc, Wc, 2], None) of an nv12 one:
    views of the frame's memory without the line padding."""
    rows = [np.frombuffer(memoryview(p), np.uint8).reshape(p.height, p.line_size) for p in frame.planes]
    if len(rows) == 2:
        wc = (frame.width + 1) // 2
        return rows[0][:, : frame.width], rows[1][:, : 2 * wc].reshape(rows[1].shape[0], wc, 2), None
    w = [p.width for p in frame.planes]
    return rows[0][:, : w[0]], rows[1][:, : w[1]], rows[2][:, : w[2]]


def to_rgb(frame: av.VideoFrame, colour: Colour, *, exact: bool = True) -> np.ndarray:
    """HxWx3 uint8 RGB of any PyAV frame, converted by swscale with `colour`'s matrix and range. exact: its
    accurate path (bilinear chroma at the frame's chroma siting, H.264/HEVC frames being tagged left; within
    half a level of the formula), else its fast default path (chroma repeated over 2x2 blocks, about 0.8 level
    off: for pictures people look at, such as the annotated video)."""
    from av.video.reformatter import ColorRange, Colorspace, Interpolation

    sws = {
        1: Colorspace.ITU709,
        4: Colorspace.FCC,
        7: Colorspace.SMPTE240M,
        9: Colorspace.BT2020,
        10: Colorspace.BT2020,
    }
    flags = Interpolation.BILINEAR | (Interpolation.ACCURATE_RND | Interpolation.FULL_CHR_H_INT if exact else 0)
    return (
        _reformatter()
        .reformat(
            frame,
            format="rgb24",
            src_colorspace=sws.get(colour.colorspace, Colorspace.ITU601),
            src_color_range=ColorRange.JPEG if colour.full_range else ColorRange.MPEG,
            interpolation=flags,
            threads=1,
        )
        .to_ndarray()
    )


_local = threading.local()


def _reformatter() -> Any:
    """This thread's swscale reformatter: one per thread, so that its context is made once and reused while
    the frames keep their size and format (`frame.reformat` makes a new one per frame), and on one thread
    (swscale's default slices every frame over threads it starts and ends per context: on 2 cores that was two
    thread starts per frame and a tenth of the CPU time in the kernel)."""
    r = getattr(_local, "reformatter", None)
    if r is None:
        from av.video.reformatter import VideoReformatter

        r = _local.reformatter = VideoReformatter()
    return r


# -- resampling -----------------------------------------------------------------------------------------------
def axis_taps(n_src: int, n_dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """OpenCV INTER_LINEAR along one axis (half-pixel centres, no antialias): (i0, i1, weight of i1 (float32),
    source position before clamping)."""
    f = (np.arange(n_dst, dtype=np.float64) + 0.5) * (n_src / n_dst) - 0.5
    return (*clamped_taps(f, n_src), f)


def clamped_taps(f: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps (i0, i1, weight of i1) at positions f in [0, n), clamped to the edge samples."""
    i0 = np.floor(f).astype(np.int64)
    a = f - i0
    low, high = i0 < 0, i0 >= n - 1
    i0[low], a[low] = 0, 0.0
    i0[high], a[high] = n - 1, 0.0
    return i0, np.minimum(i0 + 1, n - 1), a.astype(np.float32)


def chroma_taps(f: np.ndarray, n_luma: int, n_chroma: int, centred: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps in a chroma plane for luma positions f: chroma j sits at luma 2j (+ 0.5 if centred)."""
    lum = np.clip(f, 0.0, n_luma - 1.0)  # the luma grid's edge, as a converted RGB image has it
    return clamped_taps((lum - (0.5 if centred else 0.0)) / 2.0, n_chroma)


@dataclass(frozen=True)
class Taps:
    """Where a model row of size (h, w) reads a 4:2:0 frame of size (H, W): two luma rows and two luma columns
    per output pixel (OpenCV INTER_LINEAR's taps, no antialias), and for each of those luma rows (columns) the
    two chroma rows (columns) that chroma is interpolated from there. numpy or CuPy arrays.

    ly [2, h] luma rows, lay [h] the weight of the second; lx [2, w], lax [w] the same for columns;
    cy [2 (luma row tap), 2, h] chroma rows, cay [2, h] the weight of the second; cx [2, 2, w], cax [2, w].
    """

    ly: Any
    lay: Any
    lx: Any
    lax: Any
    cy: Any
    cay: Any
    cx: Any
    cax: Any

    def arrays(self) -> tuple[Any, ...]:
        return (self.ly, self.lay, self.lx, self.lax, self.cy, self.cay, self.cx, self.cax)


def make_taps(xp: Any, H: int, W: int, Hc: int, Wc: int, h: int, w: int, siting: str = "left") -> Taps:
    """The taps of a model row (h, w) in a frame (H, W) with chroma planes (Hc, Wc). Chroma row i sits between
    luma rows 2i and 2i + 1; chroma column j at luma column 2j ("left", MPEG-2 / H.264's default) or 2j + 0.5
    ("center")."""
    y0, y1, ay, _ = axis_taps(H, h)
    x0, x1, ax, _ = axis_taps(W, w)
    # a chroma plane of the luma's height (4:2:2, 4:4:4) or width (4:4:4) is read at the luma's own rows / columns
    cy = [
        chroma_taps(r.astype(np.float64), H, Hc, centred=True) if Hc < H else clamped_taps(r.astype(np.float64), Hc)
        for r in (y0, y1)
    ]
    cx = [
        chroma_taps(c.astype(np.float64), W, Wc, centred=(siting == "center"))
        if Wc < W
        else clamped_taps(c.astype(np.float64), Wc)
        for c in (x0, x1)
    ]
    itype = np.int64 if xp is np or max(H * W, Hc * 2 * Wc) >= 2**31 else np.int32
    return Taps(
        xp.asarray(np.stack([y0, y1]).astype(itype)),
        xp.asarray(ay),
        xp.asarray(np.stack([x0, x1]).astype(itype)),
        xp.asarray(ax),
        xp.asarray(np.stack([np.stack(t[:2]) for t in cy]).astype(itype)),
        xp.asarray(np.stack([t[2] for t in cy])),
        xp.asarray(np.stack([np.stack(t[:2]) for t in cx]).astype(itype)),
        xp.asarray(np.stack([t[2] for t in cx])),
    )


def rgb_at_taps(xp: Any, y: Any, uv: Any, taps: Taps, m: Any, offset: Any) -> Any:
    """The model row's RGB [3, h, w] float32 (0..255), with numpy or CuPy: each luma sample the row reads is
    converted (its chroma interpolated at its position, the matrix applied, clipped to [0, 255]) and the four
    converted samples are blended with the bilinear weights. That is converting the whole frame first and
    resizing the RGB image second, reading only 4 luma samples per output pixel.

    y [H, W] uint8; uv [Hc, Wc, 2] uint8 (U, V interleaved); m [3, 3], offset [3] float32 (`yuv_to_rgb`).
    Every float operation comes in the order the CUDA kernel (stream/engines/kernels.py ROW) follows.
    """
    h, w = int(taps.lay.shape[0]), int(taps.lax.shape[0])
    f32 = xp.float32
    rows = xp.concatenate([taps.ly[0], taps.ly[1]])  # [2h]: the luma rows read, tap 0 then tap 1
    cols = xp.concatenate([taps.lx[0], taps.lx[1]])  # [2w]
    lum = y[rows][:, cols].astype(f32)  # [2h, 2w]
    cr0 = xp.concatenate([taps.cy[0, 0], taps.cy[1, 0]])
    cr1 = xp.concatenate([taps.cy[0, 1], taps.cy[1, 1]])
    cra = xp.concatenate([taps.cay[0], taps.cay[1]])[:, None, None]
    cc0 = xp.concatenate([taps.cx[0, 0], taps.cx[1, 0]])
    cc1 = xp.concatenate([taps.cx[0, 1], taps.cx[1, 1]])
    cca = xp.concatenate([taps.cax[0], taps.cax[1]])[None, :, None]
    c0 = uv[cr0].astype(f32)
    ch = c0 + (uv[cr1].astype(f32) - c0) * cra  # [2h, Wc, 2]: chroma at the luma rows
    ch = ch[:, cc0] + (ch[:, cc1] - ch[:, cc0]) * cca  # [2h, 2w, 2]: and at the luma columns
    rgb = xp.empty((3, 2 * h, 2 * w), f32)
    for k in range(3):
        rgb[k] = lum * m[k, 0] + ch[..., 0] * m[k, 1] + ch[..., 1] * m[k, 2] + offset[k]
    xp.clip(rgb, 0.0, 255.0, out=rgb)
    rgb += 0.5  # rounded to an 8-bit level, as a decoder's RGB frame is (module docstring)
    xp.floor(rgb, out=rgb)
    ay = taps.lay[None, :, None]
    half = rgb[:, :h] + (rgb[:, h:] - rgb[:, :h]) * ay  # [3, h, 2w]: rows blended, a + (b - a) * t
    ax = taps.lax[None, None, :]
    return half[..., :w] + (half[..., w:] - half[..., :w]) * ax


@dataclass(frozen=True)
class _HostPlan:
    rows: np.ndarray  # [2h] luma rows read (tap 0 of every output row, then tap 1)
    cols: np.ndarray  # [2w]
    map_x: np.ndarray  # [2h, 2w] float32: chroma column position of each luma sample read
    map_y: np.ndarray  # [2h, 2w] float32: chroma row position
    ay: np.ndarray  # [h, 1, 1] weight of the second row tap
    ax: np.ndarray  # [1, w, 1]


@functools.lru_cache(maxsize=32)
def _host_plan(H: int, W: int, Hc: int, Wc: int, h: int, w: int) -> _HostPlan:
    t = make_taps(np, H, W, Hc, Wc, h, w)
    cy = np.concatenate([t.cy[0, 0] + t.cay[0], t.cy[1, 0] + t.cay[1]]).astype(np.float32)
    cx = np.concatenate([t.cx[0, 0] + t.cax[0], t.cx[1, 0] + t.cax[1]]).astype(np.float32)
    return _HostPlan(
        np.concatenate([t.ly[0], t.ly[1]]),
        np.concatenate([t.lx[0], t.lx[1]]),
        np.ascontiguousarray(np.broadcast_to(cx[None, :], (2 * h, 2 * w))),
        np.ascontiguousarray(np.broadcast_to(cy[:, None], (2 * h, 2 * w))),
        t.lay.reshape(h, 1, 1),
        t.lax.reshape(1, w, 1),
    )


def yuv420_to_row(
    y: np.ndarray, u: np.ndarray, v: np.ndarray | None, out: np.ndarray, info: ModelInfo, colour: Colour
) -> None:
    """Write one model row `out` [3, h, w] (the model's dtype) from YUV planes (4:2:0, or 4:2:2 / 4:4:4), on the
    CPU: `rgb_at_taps`'s arithmetic (the NVDEC routes' kernel) with OpenCV doing the gathers. u, v: [Hc, Wc]
    planes, or u [Hc, Wc, 2] interleaved (NV12) and v None.

    Chroma at the luma samples read is `cv2.remap` (bilinear) of the chroma plane in float32: its positions are
    multiples of 1/4 (rows between two chroma rows, columns on or halfway between) and its weights 0, 1/4,
    1/2, 3/4, which OpenCV's 1/32-step interpolation table holds exactly, so it is the exact interpolation.
    """
    import cv2

    uv = (u if v is None else np.stack([u, v], axis=-1)).astype(np.float32)  # [Hc, Wc, 2]: a quarter frame
    h, w = info.height, info.width
    plan = _host_plan(int(y.shape[0]), int(y.shape[1]), int(uv.shape[0]), int(uv.shape[1]), h, w)
    lum = np.take(np.take(y, plan.rows, axis=0), plan.cols, axis=1).astype(np.float32)  # [2h, 2w]
    chroma = cv2.remap(uv, plan.map_x, plan.map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    m, offset = yuv_to_rgb(colour.colorspace, colour.full_range)
    matrix = np.concatenate([m, offset[:, None]], axis=1).astype(np.float32)
    rgb = cv2.transform(cv2.merge([lum, chroma]), matrix)  # [2h, 2w, 3]
    np.clip(rgb, 0.0, 255.0, out=rgb)
    np.add(rgb, 0.5, out=rgb)  # rounded to an 8-bit level (module docstring)
    np.floor(rgb, out=rgb)
    top = rgb[:h]
    half = rgb[h:] - top  # [h, 2w, 3]: the two row taps blended, a + (b - a) * t
    half *= plan.ay
    half += top
    left = half[:, :w]
    res = half[:, w:] - left  # [h, w, 3]
    res *= plan.ax
    res += left
    res = res.transpose(2, 0, 1)  # [3, h, w]
    std = np.asarray(info.std, np.float32)
    a = (np.float32(info.scale) / std).reshape(3, 1, 1)
    b = (-np.asarray(info.mean, np.float32) / std).reshape(3, 1, 1)
    if np.all(b == 0) and np.all(a == a.flat[0]):
        np.multiply(res, a.flat[0], out=out, casting="unsafe")
    else:
        out[...] = res * a + b


class StreamColour:
    """One stream's conversion, resolved per frame from its tags and size (the stream's codec context `ctx`
    gives tags the frames lack) and logged at INFO when first found and whenever it changes.

    `where` names the stream in the log line ("stream cam1"); `quiet` resolves without logging.
    """

    def __init__(self, where: str, ctx: Any = None, *, quiet: bool = False) -> None:
        self.where = where
        self.ctx = ctx
        self.quiet = quiet
        self.colour: Colour | None = None
        self._key: tuple[Any, ...] | None = None

    def of(self, frame: av.VideoFrame) -> Colour:
        key = (frame.colorspace, frame.color_range, frame.width, frame.height, frame.format.name)
        if key != self._key or self.colour is None:
            self._key = key
            colour = frame_colour(frame, self.ctx)
            if colour != self.colour and not self.quiet:
                log.info("%s: %s", self.where, colour.describe())
            self.colour = colour
        return self.colour
