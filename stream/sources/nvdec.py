"""Live feeds decoded on NVDEC frame by frame (PyNvVideoCodec), and model rows made from NV12 on the GPU.

Decision record:
- The route: PyAV opens the URL and demuxes (RTSP, TCP, UDP, ... as on the CPU route); the bitstream filter
  `h264_mp4toannexb` / `hevc_mp4toannexb` gives Annex-B (a no-op for feeds that are Annex-B already, such as
  RTSP and MPEG-TS; it inserts SPS/PPS for avcC/hvcC input); each packet goes to PyNvVideoCodec's decoder as a
  `PacketData` (`bsl_data` a pointer to the packet's bytes, which stay referenced until `Decode` returns,
  `bsl` its size, `pts`) through `Decode`. Measured on the H200 host (../shared/GPU-NOTES.md): 1.2 ms p50,
  4.2 ms p99 per packet, against 2.3 / 64 ms for PyAV on the CPU.
- Low latency: `latency=DisplayDecodeLatencyType.LOW` and `decode_flag=VideoPacketFlag.ENDOFPICTURE` on every
  packet (PyNvVideoCodec's samples/advanced/decode_with_low_latency.py): a frame leaves `Decode` with the packet
  that carries it, in display order. The sample says not to use LOW with B-frames: a feed whose codec context
  reports B-frames (`has_b_frames`) gets NATIVE latency (display order, a few frames later), and a feed whose
  packet timestamps go back (reordering the header did not announce) gets a NATIVE decoder from its next
  keyframe on.
- Frames never leave the device: a decoded frame is the decoder's NV12 surface, `[H*3/2, W]` uint8 (Y rows,
  then interleaved UV rows), taken as a CuPy array through DLPack (`cupy.from_dlpack(frame)`). The decoder runs
  on the source's own CUDA stream (`cudastream=`), so its copy of the surface and our kernels that read it are
  ordered on one stream (and `WaitOnCUStream` orders them where it did not). The decoder may reuse a surface
  on its next `Decode` call: a frame is consumed (its kernels enqueued on that stream) before the next packet
  is decoded, and that next `Decode` waits for those kernels on the host (about 0.1 ms, only after a call that
  gave frames), whatever stream PyNvVideoCodec writes on.
- A resolution change: the decoder is made for up to 1920x1088 (or the feed's size, if larger:
  `maxwidth`/`maxheight`, as samples/advanced/decode_reconfigure.py does) and NVDEC reconfigures itself for any
  size within that; a keyframe it cannot take (a larger size) goes to a new decoder once.
  A packet NVDEC cannot decode is lost, as on the CPU route (before the first frame: a feed joined mid-GOP);
  `max_errors` in a row, a frame it cannot hand over, or a broken decoder raise NvdecError, and the live
  source decodes the feed on the CPU from then on (stream/sources/live.py).
- Rows from NV12 (`nv12_to_row`, numpy or CuPy): bilinear resize with half-pixel centres and no antialias, the
  arithmetic of OpenCV's INTER_LINEAR on float, applied to the Y plane and to the UV plane at the output
  pixels' positions; then YUV -> RGB, clipped to [0, 255] and rounded to a level, then ((pixel * scale) - mean) / std in the model's
  dtype. The CPU routes do the same (stream/sources/colour.py `yuv420_to_row`, with OpenCV). Resampling before
  the colour conversion equals converting first (both are linear) up to the clipping.
- Chroma siting: the UV plane is sampled at the MPEG-2 / H.264 default siting ("left"): chroma sample (i, j)
  sits at luma x = 2j (on even columns) and luma y = 2i + 0.5 (between two rows). That is what the H.264 spec
  assumes without a chroma_loc tag, what FFmpeg's decoders tag their frames with, and what swscale's accurate
  path computes on the CPU (stream/sources/colour.py).
- Colours by the feed's own signalling (stream/sources/colour.py): the matrix and range its codec parameters
  tag, BT.709 for untagged HD and BT.601 for untagged SD, limited range unless tagged full or `yuvj420p`; the
  CPU routes convert by the same rule and the same arithmetic. The tags are read once from the feed's codec
  parameters; the default follows each frame's size.
- The resampling is gathers with precomputed taps (two luma rows and columns per output pixel, two chroma rows
  and columns per luma tap: colour.Taps), cached per (source size, model size, device); on CuPy a row is one
  kernel, with no Python loop over pixels.
- cupy and PyNvVideoCodec are imported lazily: this module imports on machines without either.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from stream.engines.model import ModelInfo
from stream.errors import DecodeError, first_line
from stream.sources.colour import Colour, Taps, make_taps, resolve, rgb_at_taps, yuv_to_rgb
from stream.sources.pyav import ANNEXB_FILTERS, sequence_parameter_sets

if TYPE_CHECKING:
    import av
    from av.video.codeccontext import VideoCodecContext
    from av.video.stream import VideoStream

log = logging.getLogger(__name__)
_T = TypeVar("_T")

NVDEC_CODECS = ANNEXB_FILTERS  # codec -> bitstream filter to Annex-B
NVDEC_PIX_FMTS = {"yuv420p", "yuvj420p", "nv12"}  # 4:2:0 8-bit: NVDEC's NV12 output
_NVC_NAMES = ("CreateDecoder", "PacketData", "DisplayDecodeLatencyType", "VideoPacketFlag", "cudaVideoCodec")


class NvdecError(DecodeError):
    """NVDEC (PyNvVideoCodec) cannot decode this feed, or failed on it."""


# -- availability ---------------------------------------------------------------------------------------------
_reasons: dict[int, str | None] = {}
_reasons_lock = threading.Lock()


def nvdec_unavailable_reason(device: str, device_id: int = 0) -> str | None:
    """Why live feeds cannot be decoded on NVDEC here (device, cupy, a GPU, PyNvVideoCodec), or None."""
    if device != "cuda":
        return f"the device is {device}, not cuda"
    with _reasons_lock:
        if device_id not in _reasons:
            _reasons[device_id] = _probe(device_id)
        return _reasons[device_id]


def _probe(device_id: int) -> str | None:
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        return "cupy is not installed (install the 'gpu' extra)"
    except Exception as exc:
        return f"no CUDA device is usable ({first_line(exc)})"
    if count <= device_id:
        return f"CUDA device {device_id} does not exist ({count} found)"
    try:
        import PyNvVideoCodec as nvc
    except Exception as exc:  # ImportError, or RuntimeError from its driver check (no libnvcuvid / old driver)
        return f"PyNvVideoCodec cannot be imported ({first_line(exc)}); pip install pynvvideocodec"
    missing = [n for n in _NVC_NAMES if not hasattr(nvc, n)]
    if missing:
        return f"PyNvVideoCodec {getattr(nvc, '__version__', '?')} has no {', '.join(missing)} (2.2 or later is needed)"
    return None


def pix_fmt_name(ctx: VideoCodecContext) -> str | None:
    p = getattr(ctx, "pix_fmt", None)
    return p if isinstance(p, str) or p is None else getattr(p, "name", str(p))


def nvdec_refusal(codec: str | None, pix_fmt: str | None) -> str | None:
    """Why NVDEC does not take a feed of this codec and pixel format (None: it does; an unknown format is tried)."""
    if codec not in NVDEC_CODECS:
        return f"NVDEC decodes {'/'.join(sorted(NVDEC_CODECS))} here, not {codec}"
    if pix_fmt is not None and pix_fmt not in NVDEC_PIX_FMTS:
        return f"NVDEC decodes 4:2:0 8-bit {codec} here, not {pix_fmt}"
    return None


# -- NV12 -> model row ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Consts:
    m: Any  # [3, 3] float32
    offset: Any  # [3] float32
    a: Any  # [3, 1, 1] scale/std
    b: Any  # [3, 1, 1] -mean/std
    plain: float | None  # a single factor when mean is 0 and std equal (out = rgb * plain)


_cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_cache_lock = threading.Lock()
_CACHE_SIZE = 32


def _cached(key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    value = make()
    with _cache_lock:
        _cache[key] = value
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return value


def _xp_key(xp: Any) -> tuple[str, int]:
    if xp is np:
        return ("numpy", -1)
    return (xp.__name__, int(xp.cuda.runtime.getDevice()))


def _make_plan(xp: Any, H: int, W: int, Hc: int, Wc: int, h: int, w: int, siting: str) -> Taps:
    return make_taps(xp, H, W, Hc, Wc, h, w, siting)


def _make_consts(xp: Any, info: ModelInfo, colorspace: int | None, full_range: bool) -> _Consts:
    m, offset = yuv_to_rgb(colorspace, full_range)
    std = np.asarray(info.std, np.float64)
    a = np.float64(info.scale) / std
    b = -np.asarray(info.mean, np.float64) / std
    plain = float(a[0]) if np.all(b == 0) and np.all(a == a[0]) else None
    f32 = np.float32
    return _Consts(
        xp.asarray(m.astype(f32)),
        xp.asarray(offset.astype(f32)),
        xp.asarray(a.astype(f32).reshape(3, 1, 1)),
        xp.asarray(b.astype(f32).reshape(3, 1, 1)),
        plain,
    )


def nv12_to_row(
    xp: Any,
    y: Any,
    uv: Any,
    out: Any,
    info: ModelInfo,
    *,
    colorspace: int | None = None,
    full_range: bool = False,
    siting: str = "left",
    fused: bool = True,
) -> None:
    """Write one model-input row `out` [3, h, w] (the model's dtype) from an NV12 frame, with numpy or CuPy (`xp`).

    y: [H, W] uint8; uv: [H/2, W/2, 2] or [H/2, W] uint8 (interleaved U, V). colorspace/full_range: the
    conversion (an AVColorSpace and the range, as stream.sources.colour.resolve gives them). siting: "left"
    (MPEG-2, FFmpeg's default for H.264 4:2:0) or "center" (chroma x at 2j + 0.5). The arithmetic is
    colour.rgb_at_taps: every luma tap converted, clipped and rounded to a level, then blended (converting first, resizing
    second). On CuPy everything runs on the current stream, in one kernel (`_row_kernel`, the same taps,
    weights and arithmetic as the array code, which `fused=False` runs instead): the array code is about 30
    CuPy calls a frame, each holding the GIL while it launches, and 16 live feeds' readers share the GIL with
    the engine's threads (bench/RESULTS-archive.md: a 1-ms ticker thread woke 11.7 ms late at p99 beside 16
    readers).
    """
    H, W = int(y.shape[0]), int(y.shape[1])
    uv2 = uv.reshape(int(uv.shape[0]), -1)  # [Hc, 2 * Wc] bytes
    Hc, Wc = int(uv2.shape[0]), int(uv2.shape[1]) // 2
    h, w = info.height, info.width
    xk = _xp_key(xp)
    plan: Taps = _cached(("plan", *xk, H, W, Hc, Wc, h, w, siting), lambda: _make_plan(xp, H, W, Hc, Wc, h, w, siting))
    consts: _Consts = _cached(
        ("consts", *xk, info.scale, tuple(info.mean), tuple(info.std), int(colorspace or 0), bool(full_range)),
        lambda: _make_consts(xp, info, colorspace, full_range),
    )
    if fused and hasattr(xp, "ElementwiseKernel"):  # CuPy (not numpy, nor the CPU tests' stand-in)
        k = _row_kernel(xp)
        plain = consts.plain is not None
        if not (out.flags.c_contiguous and out.dtype in (np.float16, np.float32)):
            raise ValueError(f"a model row must be C-contiguous float16 or float32, not {out.dtype}")
        flat = [a.reshape(-1) for a in (*plan.arrays(), consts.m, consts.offset, consts.a, consts.b)]
        # 1-D views (the arrays are contiguous): a raw n-d array's flat index is unravelled by its shape per access
        k(
            xp.ascontiguousarray(y).reshape(-1),
            xp.ascontiguousarray(uv2).reshape(-1),
            *flat,
            np.float32(consts.plain if plain else 0.0),
            np.int32(plain),
            np.int64(h),
            np.int64(w),
            np.int64(W),
            np.int64(2 * Wc),
            out.reshape(-1),
            size=h * w,
        )
        return
    rgb = rgb_at_taps(xp, y, uv2.reshape(Hc, Wc, 2), plan, consts.m, consts.offset)
    if consts.plain is not None:
        xp.multiply(rgb, xp.float32(consts.plain), out=out)
    else:
        out[...] = rgb * consts.a + consts.b


@functools.cache
def _row_kernel(cp: Any) -> Any:
    """nv12_to_row in one CuPy ElementwiseKernel over the row's pixels (made once per process, compiled by CuPy
    per device and per type of the plan's indices and of the output, its template parameters)."""
    from stream.engines.kernels import ROW

    return cp.ElementwiseKernel(*ROW, "stream_nv12_to_row")


def split_nv12(nv12: Any, height: int) -> tuple[Any, Any]:
    """The Y [H, W] and UV [H/2, W] planes of an NV12 frame stored as [H*3/2, W] rows."""
    return nv12[:height], nv12[height : height + (height + 1) // 2]


# -- the decoder ------------------------------------------------------------------------------------------------
@dataclass
class NvdecFrame:
    """One decoded frame on the device: NV12 rows, valid until the decoder's next `decode` call."""

    data: Any  # cupy [H*3/2, W] uint8
    width: int
    height: int
    colorspace: int | None
    full_range: bool
    owner: Any = None  # PyNvVideoCodec's frame: keeps the surface referenced

    @property
    def y(self) -> Any:
        return self.data[: self.height]

    @property
    def uv(self) -> Any:
        return self.data[self.height : self.height + self.height // 2]


class NvdecDecoder:
    """One feed's PyNvVideoCodec decoder: PyAV packets in, device NV12 frames with their pts (seconds) out.

    `vs` is the feed's PyAV video stream (codec, time base, B-frames, colour tags, and the parameters the
    bitstream filter needs). `cuda_stream`: the CuPy stream the decoder and the frames' consumers work on.
    Call `decode` and `flush` from one thread, and consume each call's frames before the next call.
    """

    def __init__(self, vs: VideoStream, *, stream_id: str, device_id: int = 0, cuda_stream: Any = None) -> None:
        import cupy as cp
        import PyNvVideoCodec as nvc
        from av.bitstream import BitStreamFilterContext

        self._cp, self._nvc = cp, nvc
        self.stream_id = stream_id
        self.device_id = device_id
        ctx = vs.codec_context
        self.codec = ctx.name
        self.pix_fmt = pix_fmt_name(ctx)
        why = nvdec_refusal(self.codec, self.pix_fmt)
        if why is not None:
            raise NvdecError(f"stream {stream_id}: {why}", stream=stream_id)
        self.time_base = vs.time_base
        self.tags = (int(getattr(ctx, "colorspace", 0) or 0), int(getattr(ctx, "color_range", 0) or 0))
        self._colour_size = (0, 0)
        self.colour = self.colour_for(int(ctx.width or 0), int(ctx.height or 0))
        self.low_latency = not bool(getattr(ctx, "has_b_frames", 0))
        self.max_size = (int(ctx.width or 0), int(ctx.height or 0))
        try:
            self._bsf = BitStreamFilterContext(NVDEC_CODECS[self.codec], vs)
        except Exception as exc:
            raise NvdecError(
                f"stream {stream_id}: bitstream filter {NVDEC_CODECS[self.codec]}: {first_line(exc)}", stream=stream_id
            ) from exc
        self._device = cp.cuda.Device(device_id)
        with self._device:
            self.stream = cuda_stream if cuda_stream is not None else cp.cuda.Stream(non_blocking=True)
        self._dec: Any = None
        self._on_our_stream = True  # the decoder was made with cudastream = our stream
        self._handed_out = False  # the last Decode gave frames (their surfaces may be read by our kernels still)
        self._wait_ok = True  # WaitOnCUStream works (belt and braces: the decoder runs on our stream anyway)
        self._pending: dict[int, float | None] = {}  # timestamps given to the decoder, not yet out -> pts_s
        self._synthetic = -1  # timestamps for packets without one
        self._last_ts: int | None = None
        self._reordered = False  # a packet's pts went back while decoding with LOW latency
        self._flushed = False
        self._errors = 0  # packets in a row that failed
        self.max_errors = 30  # that many in a row, after frames came, and the feed goes to the CPU (sources/live.py)
        self.packets = 0
        self.frames = 0
        self.lost = (
            0  # packets NVDEC could not decode (a file's route gives up at the first: stream/sources/nvdec_file.py)
        )
        self._sps: bytes | None = None  # the sequence parameter sets last seen (Annex-B NAL units)
        self._create()

    def colour_for(self, width: int, height: int) -> Colour:
        """The conversion for frames of this size: the feed's tags, else the default for the size (colour.py)."""
        self._colour_size = (width, height)
        self.colour = resolve(self.tags[0], self.tags[1], width, height, pix_fmt=self.pix_fmt)
        return self.colour

    # -- decoder lifetime ------------------------------------------------------------------------------------
    def _create(self) -> None:
        nvc, cp = self._nvc, self._cp
        codec = getattr(nvc.cudaVideoCodec, "H264" if self.codec == "h264" else "HEVC")
        latency = nvc.DisplayDecodeLatencyType.LOW if self.low_latency else nvc.DisplayDecodeLatencyType.NATIVE
        with self._device:
            try:
                cp.cuda.runtime.free(0)  # makes the device's primary context (CuPy's) current on this thread
                ctx = int(cp.cuda.driver.ctxGetCurrent())
            except Exception:
                ctx = 0
            base = dict(
                gpuid=self.device_id, codec=codec, usedevicememory=True, latency=latency, cudastream=self.stream.ptr
            )
            # Surfaces for up to 1080p (or the feed's own size, if larger): NVDEC reconfigures itself for a
            # resolution change within them; beyond them a new decoder is made (`_call`).
            big = dict(maxwidth=max(self.max_size[0], 1920), maxheight=max(self.max_size[1], 1088))
            attempts = [dict(base, cudacontext=ctx, **big), dict(base, **big), dict(base, cudacontext=ctx), base]
            if not ctx:
                attempts = [a for a in attempts if "cudacontext" not in a]
            # last resort: the decoder on a stream of its own (then ordered by host syncs, see _call)
            attempts.append({k: v for k, v in base.items() if k != "cudastream"})
            errors = []
            for kwargs in attempts:
                try:
                    self._dec = nvc.CreateDecoder(**kwargs)
                    self._on_our_stream = "cudastream" in kwargs
                    break
                except Exception as exc:
                    errors.append(first_line(exc))
            else:
                raise NvdecError(
                    f"stream {self.stream_id}: PyNvVideoCodec cannot make an NVDEC decoder for "
                    f"{self.codec} on device {self.device_id} ({'; '.join(errors)})",
                    stream=self.stream_id,
                )
        self._pending.clear()
        self._last_ts = None
        self._reordered = False
        self._flushed = False
        if errors and self._on_our_stream:
            log.info(
                "stream %s: PyNvVideoCodec refused %d decoder setting(s) (%s); made it with %s",
                self.stream_id,
                len(errors),
                "; ".join(errors),
                ", ".join(sorted(k for k in kwargs if k not in base)) or "the basics",
            )
        if not self._on_our_stream:
            log.warning(
                "stream %s: PyNvVideoCodec took no CUDA stream (%s); NVDEC frames are ordered by host syncs instead",
                self.stream_id,
                "; ".join(errors),
            )
        log.debug(
            "stream %s: NVDEC decoder for %s, %s latency",
            self.stream_id,
            self.codec,
            "LOW" if self.low_latency else "NATIVE",
        )

    def close(self) -> None:
        self._dec = None

    # -- decoding ---------------------------------------------------------------------------------------------
    def decode(self, packet: av.Packet) -> list[tuple[NvdecFrame, float | None]]:
        """The frames that leave the decoder with this packet (display order), each with its pts in seconds.

        An empty packet (PyAV's end of stream) flushes the decoder. Raises NvdecError.
        """
        if packet.size == 0:
            return self.flush()
        key = bool(packet.is_keyframe)  # read before the filter, which takes the packet's contents
        ts = packet.pts if packet.pts is not None else packet.dts
        if ts is not None and self.low_latency:
            if self._last_ts is not None and ts < self._last_ts and not self._reordered:
                self._reordered = True
                log.warning(
                    "stream %s: the feed reorders frames (B-frames); NVDEC switches to NATIVE latency "
                    "(display order, a few frames later) at the next keyframe",
                    self.stream_id,
                )
            self._last_ts = ts if self._last_ts is None else max(self._last_ts, ts)
        if key and (self._flushed or (self._reordered and self.low_latency)):
            if self._reordered:
                self.low_latency = False
            self._create()
        try:
            filtered = self._bsf.filter(packet)
        except Exception as exc:
            raise NvdecError(
                f"stream {self.stream_id}: bitstream filter failed ({first_line(exc)})", stream=self.stream_id
            ) from exc
        out: list[tuple[NvdecFrame, float | None]] = []
        for fp in filtered:
            if key:
                # A new sequence parameter set may change the resolution; measured on the H200, NVDEC's own
                # reconfiguration (maxwidth/maxheight) kept the old output size. A new decoder gets it right.
                sps = sequence_parameter_sets(bytes(fp), self.codec)
                if sps and self._sps is not None and sps != self._sps:
                    log.info(
                        "stream %s: new sequence parameters (the resolution may change): new NVDEC decoder",
                        self.stream_id,
                    )
                    out += self.flush()
                    self._create()
                if sps:
                    self._sps = sps
            out += self._decode_one(fp, key)
        return out

    def flush(self) -> list[tuple[NvdecFrame, float | None]]:
        """The frames the decoder still holds (NATIVE latency), at the end of the feed."""
        if self._dec is None or self._flushed:
            return []
        pd = self._nvc.PacketData()  # no data: end of stream
        frames = self._call(pd, key=False, retry=False)
        self._flushed = True
        return frames

    def _decode_one(self, fp: Any, key: bool) -> list[tuple[NvdecFrame, float | None]]:
        self.packets += 1
        try:
            data = np.frombuffer(fp, np.uint8)  # the packet's own bytes, no copy; `fp` stays referenced
        except (TypeError, ValueError, BufferError):
            data = np.frombuffer(bytes(fp), np.uint8)
        if data.size == 0:
            return []
        pd = self._nvc.PacketData()
        pd.bsl_data = int(data.ctypes.data)
        pd.bsl = int(data.size)
        if fp.pts is not None:
            ts = int(fp.pts)
            pts_s: float | None = (
                float(fp.pts * fp.time_base)
                if fp.time_base is not None
                else (float(fp.pts * self.time_base) if self.time_base is not None else None)
            )
        else:
            ts, pts_s = self._synthetic, None
            self._synthetic -= 1
        pd.pts = ts
        if self.low_latency:
            pd.decode_flag = self._nvc.VideoPacketFlag.ENDOFPICTURE
        self._pending[ts] = pts_s
        if len(self._pending) > 64:  # frames the decoder never gave back (damaged packets): forget the oldest
            for k in list(self._pending)[: len(self._pending) - 64]:
                del self._pending[k]
        frames = self._call(pd, key=key, retry=True)
        del data, fp
        return frames

    def _call(self, pd: Any, *, key: bool, retry: bool) -> list[tuple[NvdecFrame, float | None]]:
        cp = self._cp
        with self._device, self.stream:
            if self._handed_out:
                # The decoder may write into the surfaces of the frames it handed out last time. Our kernels that
                # read them were enqueued on our stream; a decoder working on our stream is ordered after them
                # anyway, but nothing says every write of PyNvVideoCodec's is: wait for them (the previous
                # frame's row kernels, about 0.1 ms) rather than risk a torn frame.
                self.stream.synchronize()
                self._handed_out = False
            try:
                raw = list(self._dec.Decode(pd))
            except Exception as exc:
                err: BaseException = exc
                raw = None
                if retry and key:
                    # a keyframe the decoder cannot take: typically a resolution above the one its surfaces
                    # were made for. A new decoder starts from this keyframe.
                    log.info(
                        "stream %s: NVDEC failed at a keyframe (%s); making a new decoder",
                        self.stream_id,
                        first_line(exc),
                    )
                    pending = dict(self._pending)
                    self._create()
                    self._pending.update(pending)
                    try:
                        raw = list(self._dec.Decode(pd))
                    except Exception as exc2:
                        err = exc2
                if raw is None:
                    return self._bad_packet(err)
            self._errors = 0
            if raw and self._wait_ok and hasattr(self._dec, "WaitOnCUStream"):
                try:  # our stream waits for the decoder's post-processing (a no-op when it ran on our stream)
                    self._dec.WaitOnCUStream(self.stream.ptr)
                except Exception as exc:
                    self._wait_ok = False
                    log.debug("stream %s: WaitOnCUStream unavailable (%s)", self.stream_id, first_line(exc))
            if raw and not self._on_our_stream and not self._wait_ok:
                cp.cuda.runtime.deviceSynchronize()  # the decoder's copies are done before our kernels read them
            out = []
            for f in raw or ():
                out.append((self._wrap(f, cp), self._pts_of(f)))
        self.frames += len(out)
        self._handed_out = bool(out)
        return out

    def _bad_packet(self, exc: BaseException) -> list[tuple[NvdecFrame, float | None]]:
        """A packet NVDEC could not decode is lost, as on the CPU route (live feeds lose some; a feed joined
        mid-GOP starts with packets that reference frames never seen). Many in a row after frames came: NvdecError."""
        self._errors += 1
        self.lost += 1
        if self.frames and self._errors >= self.max_errors:
            raise NvdecError(
                f"stream {self.stream_id}: NVDEC failed on {self._errors} packets in a row (last: {first_line(exc)})",
                stream=self.stream_id,
            ) from exc
        log.debug("stream %s: NVDEC could not decode a packet (%s)", self.stream_id, first_line(exc))
        return []

    def _pts_of(self, f: Any) -> float | None:
        ts = None
        for name in ("getPTS", "timestamp"):
            v = getattr(f, name, None)
            try:
                ts = int(v() if callable(v) else v) if v is not None else None
            except Exception:
                ts = None
            if ts is not None:
                break
        if ts is not None and ts in self._pending:
            return self._pending.pop(ts)
        if not self._pending:
            return None
        # The decoder does not hand timestamps back: display order is pts order, so this frame is the one with
        # the lowest pts not yet out (packets without a pts: the first one given).
        real = [k for k in self._pending if k >= 0]
        return self._pending.pop(min(real) if real else next(iter(self._pending)))

    def _wrap(self, f: Any, cp: Any) -> NvdecFrame:
        fmt = str(getattr(f, "format", "")).upper()
        if any(k in fmt for k in ("YUV444", "P016", "P010", "NV16", "P216", "RGB")):
            raise NvdecError(
                f"stream {self.stream_id}: NVDEC gave {fmt} frames; only 4:2:0 8-bit (NV12) is converted here",
                stream=self.stream_id,
            )
        try:
            arr = cp.from_dlpack(f)
        except Exception as exc:
            arr = self._from_pointer(f, cp, exc)
        if arr.dtype != np.uint8 or arr.ndim != 2 or (2 * int(arr.shape[0])) % 3:
            raise NvdecError(
                f"stream {self.stream_id}: NVDEC frame of shape {tuple(arr.shape)} {arr.dtype} is not "
                f"NV12 [H*3/2, W] uint8",
                stream=self.stream_id,
            )
        height, width = 2 * int(arr.shape[0]) // 3, int(arr.shape[1])
        colour = self.colour if (width, height) == self._colour_size else self.colour_for(width, height)
        return NvdecFrame(arr, width, height, colour.colorspace, colour.full_range, owner=f)

    def _from_pointer(self, f: Any, cp: Any, why: BaseException) -> Any:
        """The NV12 surface by its device pointer, where DLPack fails (sizes from the decoder)."""
        try:
            width, height = int(self._dec.GetWidth()), int(self._dec.GetHeight())
            ptr = int(f.GetPtrToPlane(0))
        except Exception as exc:
            raise NvdecError(
                f"stream {self.stream_id}: a decoded frame cannot be read on the device "
                f"(DLPack: {first_line(why)}; pointer: {first_line(exc)})",
                stream=self.stream_id,
            ) from exc
        n = height * 3 // 2 * width
        mem = cp.cuda.UnownedMemory(ptr, n, f, self.device_id)
        return cp.ndarray((height * 3 // 2, width), np.uint8, cp.cuda.MemoryPointer(mem, 0))


# -- device rows of live batches ------------------------------------------------------------------------------------
class DeviceRows:
    """The live source's row strategy for NVDEC frames: rows of CuPy batches, written on the source's stream.

    Counterpart of live.HostRows (PyAV frames, numpy rows). `ready()` records the event a handed-out batch
    carries as Batch.ready; the inference stream waits on it.
    """

    device = True

    def __init__(self, info: ModelInfo, device_id: int = 0) -> None:
        import cupy as cp

        self._cp = cp
        self.info = info
        self.device_id = device_id
        self._device = cp.cuda.Device(device_id)
        with self._device:
            self.stream = cp.cuda.Stream(non_blocking=True)

    def new_batch(self) -> Any:
        """A batch buffer of its own allocation (cudaMalloc, not CuPy's pool): freed to the driver whenever its
        last reference goes, even after `retire` (a consumer, such as a suspended iterator, may hold the last
        batch handed out a while longer; from the pool it came back cached on this stream, where nothing
        allocates again: one batch lost per feed, seen on an H100)."""
        cp, i = self._cp, self.info
        dtype = np.dtype(i.dtype)
        shape = (i.batch, 3, i.height, i.width)
        with self._device, self.stream:
            mem = cp.cuda.Memory(int(np.prod(shape)) * dtype.itemsize)
            data = cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))
            data.fill(0)
        self.stream.synchronize()  # zeroed before anyone else's stream touches it
        return data

    def fill(self, data: Any, row: int, frame: NvdecFrame) -> None:
        with self._device, self.stream:
            nv12_to_row(
                self._cp,
                frame.y,
                frame.uv,
                data[row],
                self.info,
                colorspace=frame.colorspace,
                full_range=frame.full_range,
            )

    def shift(self, data: Any, src: int, n: int) -> None:
        """Rows src..src+n-1 to rows 0..n-1 (the stale-drop). A device copy through a temporary: a kernel
        reading and writing overlapping rows races."""
        with self._device, self.stream:
            data[:n] = data[src : src + n].copy()

    def ready(self) -> Any:
        cp = self._cp
        with self._device:
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)
        return ev

    def retire(self) -> None:
        """The owner has let go of every batch: give the device memory CuPy's pool keeps for this stream back
        to the driver (blocks freed on a stream are reused only on that stream; nothing else allocates on it)."""
        cp = self._cp
        with self._device:
            self.stream.synchronize()
            cp.get_default_memory_pool().free_all_blocks(stream=self.stream)

    def warm_up(self) -> None:
        """Compile the row kernels once (CuPy compiles on first use), before the first frame waits on it."""
        cp = self._cp
        with self._device, self.stream:
            nv12 = cp.full((96, 64), 128, dtype=cp.uint8)
            y, uv = split_nv12(nv12, 64)
            out = cp.empty((3, self.info.height, self.info.width), dtype=np.dtype(self.info.dtype))
            nv12_to_row(cp, y, uv, out, self.info)
        self.stream.synchronize()
