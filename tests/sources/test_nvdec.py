"""Live feeds on NVDEC (stream/sources/nvdec.py, stream/sources/live.py): NV12 -> model rows, the route choice, end to end.

CPU tests (everywhere): the NV12 conversion with numpy on frames PyAV decoded from real videos, against the
CPU route's own rows (stream/sources/colour.py, from the same planes) and against an exact float
reference; the route choice (`live_decode`); a live feed end to end on the CPU route, served as MPEG-TS over
tcp:// by a PyAV process at real-time pace (no RTSP server needed: the GPU host has no GStreamer).

GPU tests (`pytest -m gpu`, skipped without CUDA, onnxruntime-gpu, DALI, cupy and PyNvVideoCodec): the decoder
on PyAV-demuxed H.264 (1280x720, GOP 30, no B-frames; 640x360 with B-frames; HEVC; resolution changes) yields
every frame in order and its device rows match the CPU route's; per-packet latency; the same paced feed end to
end with `device = "cuda"`, `live_decode = "nvdec"`, no frame-sized host copy, and detections that match the
CPU route's on the same frames.

Run `python -m tests.sources.test_nvdec VIDEO PORT` to serve VIDEO once on tcp://127.0.0.1:PORT yourself.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


# -- the paced feed (a separate process: PyAV holds the GIL while it blocks on a socket) ----------------------
def serve_ts(path: str, port: int) -> None:
    """Accept one client on tcp://127.0.0.1:port and send `path`'s video packets as MPEG-TS at their pace."""
    import av

    with av.open(path) as src:
        ist = src.streams.video[0]
        out = av.open(f"tcp://127.0.0.1:{port}?listen=1", "w", format="mpegts")
        try:
            ost = out.add_stream_from_template(ist)
            t0 = None
            sent = 0
            for p in src.demux(ist):
                if p.size == 0 or p.dts is None:
                    continue
                t = float(p.dts * p.time_base)
                now = time.monotonic()
                t0 = now - t if t0 is None else t0
                if t0 + t > now:
                    time.sleep(t0 + t - now)
                p.stream = ost
                out.mux(p)  # the mpegts muxer inserts h264_mp4toannexb itself
                sent += 1
            print(f"served {sent} packets", flush=True)
        finally:
            out.close()


class PacedFeed:
    """`path` served once as a live MPEG-TS feed on tcp://127.0.0.1:PORT (a child process)."""

    def __init__(self, path: Path) -> None:
        from tests.conftest import free_port

        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sources.test_nvdec", str(path), str(self.port)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(1.0)  # no probe connection: the server takes exactly one client (the daemon retries if early)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=30)
        return out

    def __enter__(self) -> PacedFeed:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- helpers ---------------------------------------------------------------------------------------------------
def nv12_planes(frame: Any) -> tuple[np.ndarray, np.ndarray]:
    """Y [H, W] and UV [H/2, W] (interleaved) of a PyAV frame converted to NV12, without the line padding."""
    n = frame.reformat(format="nv12")
    yp, cp = n.planes
    y = np.frombuffer(yp, np.uint8).reshape(yp.height, yp.line_size)[:, : frame.width]
    uv = np.frombuffer(cp, np.uint8).reshape(cp.height, cp.line_size)[:, : 2 * ((frame.width + 1) // 2)]
    return y, uv


def cpu_route_row(pre: Any, frame: Any) -> np.ndarray:
    """The model row the CPU route makes of a PyAV frame (stream/sources/live.py HostRows, host.py fill_frame)."""
    from stream.sources.colour import frame_colour

    out = pre.new_batch()
    pre.fill_frame(out, 0, frame, frame_colour(frame))
    return out[0]


def tags_of(frame: Any) -> dict[str, Any]:
    """nv12_to_row's colour arguments for a PyAV frame, as NvdecDecoder resolves them (colour.resolve)."""
    from stream.sources.colour import frame_colour

    c = frame_colour(frame)
    return {"colorspace": c.colorspace, "full_range": c.full_range}


def float_reference_row(y: np.ndarray, uv: np.ndarray, info: Any, siting: str = "left") -> np.ndarray:
    """Convert first, resize second, all in float: chroma upsampled bilinearly (left siting: chroma j at luma
    2j; rows centred), BT.601 limited range, clipped and rounded to 8-bit levels, then OpenCV INTER_LINEAR on
    float, then the scaling."""
    import cv2

    from stream.sources.nvdec import yuv_to_rgb

    H, W = y.shape
    uv3 = uv.reshape(uv.shape[0], -1, 2).astype(np.float64)
    hc, wc = uv3.shape[:2]

    def taps(pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.clip(pos, 0, n - 1)
        i0 = np.floor(pos).astype(np.int64)
        return i0, np.minimum(i0 + 1, n - 1), pos - i0

    y0, y1, ay = taps((np.arange(H) - 0.5) / 2, hc)
    x0, x1, ax = taps((np.arange(W) - (0.5 if siting == "center" else 0.0)) / 2, wc)
    ay, ax = ay[:, None, None], ax[None, :, None]
    up = (uv3[y0][:, x0] * (1 - ax) + uv3[y0][:, x1] * ax) * (1 - ay) + (
        uv3[y1][:, x0] * (1 - ax) + uv3[y1][:, x1] * ax
    ) * ay
    m, off = yuv_to_rgb()
    yuv = np.stack([y.astype(np.float64), up[..., 0], up[..., 1]])
    rgb = np.clip(np.tensordot(m, yuv, 1) + off[:, None, None], 0, 255)
    rgb = np.floor(rgb + 0.5).astype(np.float32).transpose(1, 2, 0)  # an 8-bit level, as decoded RGB is
    if (H, W) != (info.height, info.width):
        rgb = cv2.resize(rgb, (info.width, info.height), interpolation=cv2.INTER_LINEAR)
    a = np.float32(info.scale) / np.asarray(info.std, np.float32)
    b = -np.asarray(info.mean, np.float32) / np.asarray(info.std, np.float32)
    return rgb.transpose(2, 0, 1) * a[:, None, None] + b[:, None, None]


def levels(diff: np.ndarray, info: Any) -> np.ndarray:
    """A difference of model-input values in 0..255 pixel levels."""
    a = np.float32(info.scale) / np.asarray(info.std, np.float32)
    return np.abs(diff) / a[:, None, None]


def first_frames(path: Path, n: int) -> list[Any]:
    import av

    with av.open(str(path)) as c:
        return [f for _, f in zip(range(n), c.decode(video=0))]


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from stream.tools.sample import make_sample_video

    d = tmp_path_factory.mktemp("nvdec")
    return {
        "hd": make_sample_video(d / "hd.mp4", width=1280, height=720, seconds=1.0),
        "vga": make_sample_video(d / "vga.mp4", width=640, height=360, seconds=1.0, bframes=2),
        "qvga": make_sample_video(d / "qvga.mp4", width=320, height=240, seconds=1.0),
        "qcif": make_sample_video(d / "qcif.mp4", width=176, height=144, seconds=1.0),  # upscaled to the model
    }


# -- the conversion, on the CPU ----------------------------------------------------------------------------------
@pytest.mark.parametrize("clip", ["hd", "vga", "qvga", "qcif"])
def test_nv12_rows_match_the_cpu_route(clips: dict[str, Path], model_info: Any, clip: str) -> None:
    """nv12_to_row (numpy) on PyAV's NV12 planes against the CPU route's rows of the same frames: the same
    conversion (stream/sources/colour.py), the CPU route rounding to uint8 where it converts whole frames with
    swscale, so within the fidelity tolerance (mean <= 0.5, p99.9 <= 3 levels). Before both converted by the
    stream's signalling, the CPU route (swscale's default conversion) was 1-2 levels darker on average and up
    to 111 levels apart at colour edges."""
    from stream.sources.host import HostPreprocessor
    from stream.sources.nvdec import nv12_to_row

    info = model_info
    pre = HostPreprocessor(info)
    out = pre.new_batch()
    diffs = []
    for f in first_frames(clips[clip], 30):
        y, uv = nv12_planes(f)
        nv12_to_row(np, y, uv, out[0], info, **tags_of(f))
        diffs.append(levels(out[0] - cpu_route_row(pre, f), info))
    d = np.stack(diffs)
    p999 = float(np.percentile(d, 99.9))
    print(f"{clip}: mean {d.mean():.4f} p99.9 {p999:.4f} max {d.max():.4f} levels")
    assert d.mean() <= 0.5 and p999 <= 3.0, f"{clip}: mean {d.mean():.4f} p99.9 {p999:.4f} levels"


@pytest.mark.parametrize("clip", ["hd", "vga", "qcif"])
def test_nv12_rows_equal_the_float_reference(clips: dict[str, Path], model_info: Any, clip: str) -> None:
    """Against a float reference on the same NV12 (chroma upsampled, converted and clipped first, resized
    second): the same arithmetic (each luma tap converted and clipped, then blended), so equal within float
    rounding at the model's own size and resized to 320x320."""
    from stream.sources.nvdec import nv12_to_row

    frames = first_frames(clips[clip], 8)
    w, h = frames[0].width, frames[0].height
    for info, mean_max, p99_max in (
        (dataclasses.replace(model_info, width=w, height=h), 1e-3, 1e-3),
        (model_info, 1e-3, 1e-3),
    ):
        out = np.zeros((3, info.height, info.width), np.float32)
        ds = []
        for f in frames:
            y, uv = nv12_planes(f)
            nv12_to_row(np, y, uv, out, info)
            ds.append(levels(out - float_reference_row(y, uv, info), info))
        d = np.stack(ds)
        print(
            f"{clip} -> {info.width}x{info.height}: mean {d.mean():.4f} p99 {np.percentile(d, 99):.3f} max {d.max():.2f}"
        )
        assert d.mean() <= mean_max and np.percentile(d, 99) <= p99_max


def test_nv12_rows_model_dtype_and_normalization(clips: dict[str, Path], model_info: Any) -> None:
    """float16 and a mean/std model: the same ((pixel * scale) - mean) / std as the CPU route."""
    from stream.sources.host import HostPreprocessor
    from stream.sources.nvdec import nv12_to_row

    info = dataclasses.replace(model_info, dtype="float16", mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    pre = HostPreprocessor(info)
    out = pre.new_batch()
    f = first_frames(clips["hd"], 1)[0]
    y, uv = nv12_planes(f)
    nv12_to_row(np, y, uv, out[0], info, **tags_of(f))
    assert out.dtype == np.float16
    d = levels(out[0].astype(np.float32) - cpu_route_row(pre, f).astype(np.float32), info)
    print(f"float16 mean/std model: mean {d.mean():.3f} p99 {np.percentile(d, 99):.2f} levels")
    assert d.mean() <= 2.0 and np.percentile(d, 99) <= 5.0


@pytest.mark.parametrize("colorspace, color_range", [(1, 1), (5, 2), (1, 2)])
def test_colour_tags_as_swscale_reads_them(model_info: Any, colorspace: int, color_range: int) -> None:
    """A frame tagged BT.709 and/or full range: the conversion follows the tags as PyAV (swscale) does."""
    import av

    from stream.sources.nvdec import nv12_to_row

    H, W = 64, 96
    rng = np.random.default_rng(1)
    xx = np.mgrid[0:H, 0:W][1]
    planes = [
        (40 + 150 * (xx / W)).astype(np.uint8),
        np.clip(128 + 90 * np.sin(np.mgrid[0 : H // 2, 0 : W // 2][1] / 20.0), 0, 255).astype(np.uint8),
        np.clip(128 + 90 * np.cos(np.mgrid[0 : H // 2, 0 : W // 2][0] / 12.0), 0, 255).astype(np.uint8),
    ]
    planes[0] = np.clip(planes[0].astype(int) + rng.integers(-5, 6, planes[0].shape), 0, 255).astype(np.uint8)
    f = av.VideoFrame(W, H, "yuv420p")
    for p, a in zip(f.planes, planes):
        np.frombuffer(p, np.uint8).reshape(p.height, p.line_size)[:, : a.shape[1]] = a
    f.colorspace, f.color_range = colorspace, color_range
    ref = f.to_ndarray(format="rgb24").astype(np.float32).transpose(2, 0, 1)
    info = dataclasses.replace(model_info, width=W, height=H, scale=1.0, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    uv = np.stack(planes[1:], axis=-1)
    out = np.zeros((3, H, W), np.float32)
    nv12_to_row(np, planes[0], uv, out, info, colorspace=colorspace, full_range=color_range == 2)
    tagged = np.abs(out - ref)
    nv12_to_row(np, planes[0], uv, out, info)  # as if untagged: BT.601 limited
    untagged = np.abs(out - ref)
    print(
        f"colorspace {colorspace} range {color_range}: tags followed {tagged.mean():.2f}, ignored {untagged.mean():.2f}"
    )
    assert tagged.mean() <= 2.5
    assert untagged.mean() > tagged.mean() + 1.0


# -- the route choice ---------------------------------------------------------------------------------------------
def _live_source(cfg_keys: dict[str, Any], device: str, info: Any) -> Any:
    from stream import config
    from stream.sources.live import LiveBatchSource
    from stream.sources.naming import Source

    cfg = config.load(None, cfg_keys)
    return LiveBatchSource(Source("cam", "tcp://127.0.0.1:9/x", live=True), info, cfg, pool=2, device=device)


def test_auto_on_the_cpu_takes_the_cpu_route(model_info: Any) -> None:
    src = _live_source({}, "cpu", model_info)
    assert src.route == "cpu" and all(isinstance(a, np.ndarray) for a in src._free)
    assert _live_source({"live_decode": "cpu"}, "cuda", model_info).route == "cpu"  # forced: nothing probed


def test_auto_on_cuda_without_nvdec_falls_back_to_the_cpu_route(model_info: Any) -> None:
    from stream.sources.nvdec import nvdec_unavailable_reason

    if nvdec_unavailable_reason("cuda") is None:
        pytest.skip("NVDEC is usable here: the GPU tests cover it")
    assert _live_source({"live_decode": "auto"}, "cuda", model_info).route == "cpu"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_nvdec_required_without_it_is_a_clear_error(model_info: Any, device: str) -> None:
    from stream.errors import SourceError
    from stream.sources.nvdec import nvdec_unavailable_reason

    if nvdec_unavailable_reason(device) is None:
        pytest.skip("NVDEC is usable here")
    with pytest.raises(SourceError) as err:
        _live_source({"live_decode": "nvdec"}, device, model_info)
    text = str(err.value)
    assert "stream cam" in text and 'live_decode = "nvdec"' in text and "auto" in text, text
    assert err.value.stream == "cam"


def test_live_decode_is_validated() -> None:
    from stream import config
    from stream.errors import ConfigError

    assert config.load().live_decode == "auto"
    with pytest.raises(ConfigError) as err:
        config.load(None, {"live_decode": "gpu"})
    assert "'live_decode'" in str(err.value) and "auto, nvdec, cpu" in str(err.value)


def test_make_one_pass_hands_the_device_to_the_live_source(model_info: Any) -> None:
    from stream import config
    from stream.sources.naming import Source
    from stream.sources.registry import make_one_pass

    src = make_one_pass(Source("cam", "udp://127.0.0.1:9", live=True), model_info, "cpu", config.load())
    assert type(src).__name__ == "LiveBatchSource" and src.route == "cpu"


def test_stale_rows_shift_through_the_row_strategy(model_info: Any) -> None:
    """`_fresh` drops the stale prefix through the batch's own row strategy and hands its event on."""
    from stream.core.frames import FrameMeta

    src = _live_source({"max_staleness_ms": 1000}, "cpu", model_info)

    class Rows:  # a stand-in for DeviceRows: numpy data, a recorded shift, an event
        def __init__(self) -> None:
            self.shifts: list[tuple[int, int]] = []

        def shift(self, data: np.ndarray, s: int, n: int) -> None:
            self.shifts.append((s, n))
            data[:n] = data[s : s + n].copy()

        def ready(self) -> str:
            return "event"

    from stream.sources.live import Pending

    rows = Rows()
    data = np.arange(4, dtype=np.float32).reshape(4, 1, 1, 1) * np.ones((1, 3, 2, 2), np.float32)
    now = time.time()
    metas = [FrameMeta(i, None, now - (5.0 if i < 2 else 0.0), 2, 2) for i in range(3)]
    batch = src._fresh(Pending(data, rows, metas))
    assert batch is not None and [m.index for m in batch.frames] == [2] and rows.shifts == [(2, 1)]
    assert batch.ready == "event" and float(batch.data[0, 0, 0, 0]) == 2.0
    assert src.dropped == {"stale": 2}
    free = len(src._free)
    batch.done()
    assert len(src._free) == free, "a buffer of another route is not put into this route's pool"


# -- end to end on a paced feed --------------------------------------------------------------------------------
def run_paced(path: Path, seconds: float, **settings: Any) -> tuple[Any, list[dict[str, Any]], str]:
    """`path` served as a live feed, read by the daemon (in process) for `seconds`; (result, messages, server log)."""
    from tests.conftest import collect_run, free_port

    settings.setdefault("reconnect_initial_s", 0.2)
    settings.setdefault("reconnect_max_s", 0.5)
    settings.setdefault("live_workers", 0)  # the feed read in this process (its logs in caplog); "auto" on CUDA is
    # a decode worker process (tests/gpu/test_gpu_live_workers.py)
    with PacedFeed(path) as feed:
        result, msgs = collect_run(
            [f"cam={feed.url}"], f"tcp://127.0.0.1:{free_port()}", duration_s=seconds, **settings
        )
        log_text = feed.close()
    return result, msgs["cam"], log_text


def check_live_messages(msgs: list[dict[str, Any]], size: tuple[int, int], min_frames: int) -> list[dict[str, Any]]:
    dets = [m for m in msgs if m["type"] == "detections"]
    states = [m["state"] for m in msgs if m["type"] == "status"]
    assert states[0] == "connecting" and "streaming" in states, states  # (a refused first try reconnects)
    assert len(dets) >= min_frames, f"{len(dets)} frames published; states {states}"
    assert [m["frame"] for m in dets] == sorted({m["frame"] for m in dets}), "frames count up, never repeat"
    pts = [m["pts_s"] for m in dets]
    assert None not in pts and all(b > a for a, b in zip(pts, pts[1:])), "pts_s increases"
    for m in dets:
        assert (m["width"], m["height"]) == size, m
        assert m["captured_at"] <= m["published_at"]
    assert sum(len(m["detections"]) for m in dets) > 0, "no detections at all"
    eos = msgs[-1]
    assert {k: eos[k] for k in ("v", "type", "stream", "frames")} == {
        "v": 1,
        "type": "eos",
        "stream": "cam",
        "frames": len(dets),
    }
    assert eos["read"] == eos["frames"] + eos["dropped"], eos  # every frame decoded: published or counted
    return dets


def test_paced_tcp_feed_end_to_end_on_the_cpu_route(tmp_path: Path) -> None:
    """The harness of the GPU end-to-end test, on the CPU route: a 3 s feed of 90 frames. The staleness budget is
    generous (2 s) so that what is checked is the route, not this machine's speed: with the default 100 ms a slow
    2-core machine drops most frames as stale, as it should (tests/sources/test_live_drops.py checks that policy)."""
    from stream.tools.sample import make_sample_video

    video = make_sample_video(tmp_path / "feed.mp4", width=320, height=240, seconds=3.0)
    result, msgs, served = run_paced(video, 10.0, device="cpu", max_staleness_ms=2000)
    dets = check_live_messages(msgs, (320, 240), min_frames=45)
    print(
        f"cpu route: {len(dets)} frames published of 90 served ({served.strip()}); dropped {result.stats['cam'].dropped}"
    )


# -- the NVDEC route's plumbing on the CPU: PyNvVideoCodec and CuPy stand-ins --------------------------------
class _Ns:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class _Ctx:
    def __init__(self, *a: Any, **k: Any) -> None:
        self.ptr = 1234

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass


def fake_cupy() -> Any:
    """numpy dressed as CuPy: what DeviceRows, NvdecDecoder and nv12_to_row call, on the host."""
    import types

    m = types.ModuleType("fakecupy")  # its own name: the conversion's caches never mix it with real CuPy
    for name in (
        "zeros",
        "empty",
        "full",
        "asarray",
        "ascontiguousarray",
        "concatenate",
        "sum",
        "clip",
        "floor",
        "multiply",
        "float32",
        "uint8",
        "from_dlpack",
        "ndarray",
    ):
        setattr(m, name, getattr(np, name))
    m.freed_streams = []  # free_all_blocks(stream=...) calls on the default pool, in order
    m.get_default_memory_pool = lambda: _Ns(free_all_blocks=lambda stream=None: m.freed_streams.append(stream))
    m.cuda = _Ns(
        Device=_Ctx,
        Stream=_Ctx,
        Event=_Ctx,
        runtime=_Ns(getDeviceCount=lambda: 1, getDevice=lambda: 0, free=lambda p: None),
        driver=_Ns(ctxGetCurrent=lambda: 777),
        Memory=bytearray,  # an allocation of its own: ndarray(shape, dtype, MemoryPointer(mem, 0)) is numpy's buffer
        MemoryPointer=lambda mem, offset: memoryview(mem)[offset:],
    )
    return m


class FakeNvc:
    """PyNvVideoCodec's API as decode_nvdec uses it, decoding the Annex-B bytes at `bsl_data` with FFmpeg."""

    cudaVideoCodec = _Ns(H264="H264", HEVC="HEVC")
    DisplayDecodeLatencyType = _Ns(NATIVE="NATIVE", LOW="LOW", ZERO="ZERO")
    VideoPacketFlag = _Ns(ENDOFPICTURE="ENDOFPICTURE")

    class PacketData:
        def __init__(self) -> None:
            self.bsl_data, self.bsl, self.pts, self.decode_flag = 0, 0, 0, None

    def __init__(self, fail_after: int | None = None) -> None:
        self.created: list[dict[str, Any]] = []
        self.packets: list[tuple[int, Any, bytes]] = []  # (pts, decode_flag, first bytes)
        self.out_ts: list[int] = []  # timestamps of the frames handed out
        self.fail_after = fail_after

    def CreateDecoder(self, **kw: Any) -> Any:
        import av

        self.created.append(kw)
        nvc = self
        ctx = av.CodecContext.create("h264" if kw["codec"] == "H264" else "hevc", "r")

        class Frame:
            def __init__(self, arr: np.ndarray, ts: int) -> None:
                self._arr, self.timestamp, self.format = arr, ts, "Pixel_Format.NV12"

            def __dlpack__(self, **k: Any) -> Any:
                return self._arr.__dlpack__()

            def __dlpack_device__(self) -> Any:
                return self._arr.__dlpack_device__()

        class Decoder:
            def Decode(self, pd: Any) -> list[Any]:
                import ctypes

                if nvc.fail_after is not None and len(nvc.packets) >= nvc.fail_after:
                    raise RuntimeError("fake NVDEC failure")
                if pd.bsl == 0:
                    frames = ctx.decode(None)
                else:
                    data = ctypes.string_at(pd.bsl_data, pd.bsl)  # read at the pointer, during the call
                    nvc.packets.append((pd.pts, pd.decode_flag, data[:4]))
                    pkt = av.Packet(data)
                    pkt.pts = pd.pts
                    frames = ctx.decode(pkt)
                out = []
                for f in frames:
                    y, uv = nv12_planes(f)
                    out.append(Frame(np.concatenate([y, uv]), f.pts))
                    nvc.out_ts.append(f.pts)
                return out

        return Decoder()


@pytest.fixture
def fake_nvdec(monkeypatch: pytest.MonkeyPatch) -> FakeNvc:
    if GPU_REASON is None:
        pytest.skip("the real NVDEC path is here: the GPU tests cover it")
    import stream.sources.nvdec as dn

    nvc = FakeNvc()
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", nvc)
    monkeypatch.setattr(dn, "nvdec_unavailable_reason", lambda device, device_id=0: None)
    return nvc


@pytest.mark.parametrize("clip, low", [("hd", True), ("vga", False)])
def test_nvdec_plumbing_with_stand_ins(
    fake_nvdec: FakeNvc, clips: dict[str, Path], model_info: Any, clip: str, low: bool
) -> None:
    """NvdecDecoder + DeviceRows with CuPy/PyNvVideoCodec stand-ins: Annex-B packets (start codes, SPS/PPS from
    the MP4's avcC) at the pointer, pts, the low-latency flag, every frame in order, the rows of the NV12 path."""
    import av

    from stream.sources.nvdec import DeviceRows, NvdecDecoder, nv12_to_row

    rows = DeviceRows(model_info)
    rows.warm_up()
    batch = rows.new_batch()
    pts, got = [], []
    with av.open(str(clips[clip])) as c:
        vs = c.streams.video[0]
        dec = NvdecDecoder(vs, stream_id="t", cuda_stream=rows.stream)
        for packet in c.demux(vs):
            for f, p in dec.decode(packet):
                rows.fill(batch, 0, f)
                got.append(batch[0].copy())
                pts.append(p)
    kw = fake_nvdec.created[0]
    assert kw["cudastream"] == rows.stream.ptr and kw["cudacontext"] == 777 and kw["usedevicememory"] is True
    assert kw["latency"] == ("LOW" if low else "NATIVE") and dec.low_latency is low
    assert fake_nvdec.packets[0][2] == b"\x00\x00\x00\x01", "not Annex-B"
    assert all(flag == ("ENDOFPICTURE" if low else None) for _, flag, _ in fake_nvdec.packets)
    ref = first_frames(clips[clip], 1000)
    assert pts == pytest.approx([f.time for f in ref]), "every frame, in display order, with its pts"
    out = np.zeros_like(got[0])
    for row, f in zip(got, ref):
        y, uv = nv12_planes(f)
        nv12_to_row(np, y, uv, out, model_info, **tags_of(f))
        assert np.array_equal(row, out)


def test_nvdec_route_end_to_end_with_stand_ins(fake_nvdec: FakeNvc, tmp_path: Path) -> None:
    """sources/live.py's NVDEC route (stand-ins for CuPy and PyNvVideoCodec, the CPU engine) on the paced feed of
    90 frames, with a staleness budget (2 s) that no frame of a working route reaches on a slow machine."""
    from stream.tools.sample import make_sample_video

    video = make_sample_video(tmp_path / "feed.mp4", width=320, height=240, seconds=3.0)
    result, msgs, _ = run_paced(video, 10.0, device="cpu", live_decode="nvdec", max_staleness_ms=2000)
    dets = check_live_messages(msgs, (320, 240), min_frames=45)
    assert fake_nvdec.created and len(fake_nvdec.packets) >= len(dets)
    print(f"stand-in nvdec route: {len(dets)} frames; dropped {result.stats['cam'].dropped}")


def test_nvdec_route_detect_fps_skips_frames_before_the_row_kernels(
    fake_nvdec: FakeNvc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """detect_fps 5 on the NVDEC route (stand-ins) over a 30 fps feed: every 6th frame by pts is made into a model
    row, the others leave the decoder and are dropped as "detect_fps" before the NV12 kernels run on them."""
    from stream.sources.nvdec import DeviceRows
    from stream.tools.sample import make_sample_video

    fills: list[int] = []
    real_fill = DeviceRows.fill
    monkeypatch.setattr(
        DeviceRows, "fill", lambda self, data, row, f: fills.append(row) or real_fill(self, data, row, f)
    )
    video = make_sample_video(tmp_path / "feed.mp4", width=320, height=240, seconds=3.0)
    result, msgs, _ = run_paced(video, 10.0, device="cpu", live_decode="nvdec", max_staleness_ms=2000, detect_fps=5)
    dets = check_live_messages(msgs, (320, 240), min_frames=5)
    st = result.stats["cam"]
    frames = [m["frame"] for m in dets]
    assert all(5 <= b - a <= 7 for a, b in zip(frames, frames[1:])), frames
    decoded = len(fake_nvdec.out_ts)
    assert st.dropped.get("detect_fps", 0) >= decoded - len(dets) - 8, (st.dropped, decoded, len(dets))
    assert len(fills) == len(dets) + st.dropped.get("stale", 0), "a frame skipped by the rate went through the rows"
    assert msgs[-1]["read"] == decoded, (msgs[-1], decoded)


def test_nvdec_failure_falls_back_to_the_cpu(
    fake_nvdec: FakeNvc, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NVDEC fails mid-feed: logged, the feed goes on on the CPU from its next keyframe; the stream never fails."""
    from stream.tools.sample import make_sample_video

    fake_nvdec.fail_after = 30  # every packet from the 31st on fails: 30 in a row and the feed goes to the CPU
    caplog.set_level(logging.INFO)
    video = make_sample_video(tmp_path / "feed.mp4", width=320, height=240, seconds=5.0)
    result, msgs, _ = run_paced(video, 8.0, device="cpu", live_decode="nvdec")
    assert "NVDEC decoding failed" in caplog.text and "packets in a row" in caplog.text
    assert "decoding this feed on the CPU" in caplog.text
    dets = check_live_messages(msgs, (320, 240), min_frames=20)
    assert result.stats["cam"].state == "completed"
    last_nvdec = max(fake_nvdec.out_ts) / 90000  # MPEG-TS timestamps: 90 kHz
    late = [m for m in dets if m["pts_s"] > last_nvdec + 1e-6]  # decoded on the CPU after the fallback
    print(f"fallback: {len(dets)} frames, {len(late)} decoded on the CPU after NVDEC's last at {last_nvdec:.2f} s")
    assert fake_nvdec.out_ts and late, "no frame after the fallback"


# -- GPU ------------------------------------------------------------------------------------------------------------
def _gpu_reason() -> str | None:
    from stream.engines.device import cuda_unavailable_reason
    from stream.sources.nvdec import nvdec_unavailable_reason

    return cuda_unavailable_reason() or nvdec_unavailable_reason("cuda")


GPU_REASON = _gpu_reason()


@pytest.fixture(scope="module")
def gpu_clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from stream.tools.sample import make_sample_video
    from tests.conftest import make_resolution_change

    d = tmp_path_factory.mktemp("nvdec_gpu")
    clips = {
        "gop30": make_sample_video(d / "gop30.mp4", width=1280, height=720, seconds=2.0),  # GOP 30, no B-frames
        "bframes": make_sample_video(d / "bframes.mp4", width=640, height=360, seconds=1.5, bframes=2),
        "feed": make_sample_video(d / "feed.mp4", width=1280, height=720, seconds=10.0),  # the live feed
        "shrink": make_resolution_change(d / "shrink.mkv"),  # 320x240 x10, then 160x96 x8
        "grow": make_resolution_change(d / "grow.mkv", sizes=((160, 96, 8), (320, 240, 10))),
    }
    try:
        clips["hevc"] = make_sample_video(d / "hevc.mp4", width=640, height=360, seconds=1.0, codec="libx265")
    except Exception as exc:  # a PyAV build without libx265: the HEVC case is skipped, not the others
        logging.getLogger(__name__).warning("no HEVC clip: %s", exc)
    return clips


def nvdec_pass(path: Path, info: Any) -> dict[str, Any]:
    """Every packet of `path` (PyAV demux) through NvdecDecoder and the device rows; what came out, and timings."""
    import av
    import cupy as cp

    from stream.sources.nvdec import DeviceRows, NvdecDecoder

    rows = DeviceRows(info)
    rows.warm_up()
    batch = rows.new_batch()
    out: dict[str, Any] = {
        "pts": [],
        "sizes": [],
        "rows": [],
        "nv12": [],
        "lat_ms": [],
        "lag": [],
        "low": None,
        "flushed": 0,
    }
    with av.open(str(path)) as c:
        vs = c.streams.video[0]
        dec = NvdecDecoder(vs, stream_id="t", cuda_stream=rows.stream)
        out["low"] = dec.low_latency
        packets = frames = 0
        for packet in c.demux(vs):
            real = packet.size > 0
            t0 = time.perf_counter()
            got = dec.decode(packet)
            kept = []
            with rows.stream:
                for f, _ in got:
                    rows.fill(batch, 0, f)
                    kept.append((batch[0].copy(), f.data.copy()))  # device copies: the surface is reused
            rows.stream.synchronize()
            if got and real:  # decode + the model row, finished on the device
                out["lat_ms"].append(1000 * (time.perf_counter() - t0))
            for row, nv12 in kept:  # test-side copies to the host, for the comparison
                out["rows"].append(row.get(stream=rows.stream))
                out["nv12"].append(nv12.get(stream=rows.stream))
            packets += real
            frames += len(got)
            out["flushed"] += 0 if real else len(got)  # PyAV's empty packet at the end flushes the decoder
            out["lag"].append(packets - frames)
            out["pts"] += [p for _, p in got]
            out["sizes"] += [(f.width, f.height) for f, _ in got]
        assert dec.flush() == [], "flushed twice"
    cp.cuda.runtime.deviceSynchronize()
    return out


@pytest.mark.parametrize("clip", ["gop30", "bframes", "hevc"])
@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path here: {GPU_REASON}")
def test_nvdec_every_frame_in_order_and_rows_match_the_cpu_route(
    gpu_clips: dict[str, Path], model_info: Any, clip: str
) -> None:
    """(i) and (ii): NvdecDecoder on PyAV-demuxed packets: every frame, in display order, with PyAV's pts; the
    device rows equal nv12_to_row (numpy) on PyAV's own NV12 of the same frame (H.264/HEVC decoding is bit-exact)
    and match the CPU route's rows (one arithmetic: mean <= 0.5, p99.9 <= 3 levels); per-packet latency printed."""
    import av

    from stream.sources.host import HostPreprocessor
    from stream.sources.nvdec import nv12_to_row

    info = model_info
    if clip not in gpu_clips:
        pytest.skip(f"no {clip} clip (no encoder for it here)")
    got = nvdec_pass(gpu_clips[clip], info)
    with av.open(str(gpu_clips[clip])) as c:
        ref_frames = list(c.decode(video=0))
    assert len(got["rows"]) == len(ref_frames), f"{len(got['rows'])} frames from NVDEC, {len(ref_frames)} from PyAV"
    assert got["pts"] == pytest.approx([f.time for f in ref_frames], abs=1e-6), "frames out of order or pts wrong"
    assert got["sizes"] == [(f.width, f.height) for f in ref_frames]
    pre = HostPreprocessor(info)
    exact, cpu = [], []
    host = np.zeros((3, info.height, info.width), np.float32)
    for i, f in enumerate(ref_frames):
        y, uv = nv12_planes(f)
        h = f.height
        if i < 5:  # the decoded NV12 itself
            assert np.array_equal(got["nv12"][i][:h], y) or np.abs(got["nv12"][i][:h].astype(int) - y).mean() < 0.5
        nv12_to_row(np, y, uv, host, info, **tags_of(f))
        exact.append(levels(got["rows"][i] - host, info))
        cpu.append(levels(got["rows"][i] - cpu_route_row(pre, f), info))
    e, d = np.stack(exact), np.stack(cpu)
    lat = np.array(got["lat_ms"])
    print(
        f"{clip}: {len(ref_frames)} frames ({'LOW' if got['low'] else 'NATIVE'} latency, {got['flushed']} at the flush); "
        f"device vs numpy on PyAV's NV12: mean {e.mean():.4f} max {e.max():.3f} levels; vs the CPU route: mean "
        f"{d.mean():.3f} p99 {np.percentile(d, 99):.2f} levels; per packet decode+rows p50 {np.percentile(lat, 50):.2f} "
        f"ms p99 {np.percentile(lat, 99):.2f} ms; packets-in minus frames-out max {max(got['lag'])}"
    )
    assert e.mean() <= 0.05 and np.percentile(e, 99) <= 1.0, "device rows differ from the same conversion on the host"
    assert d.mean() <= 0.5 and np.percentile(d, 99.9) <= 3.0, f"mean {d.mean():.2f} levels from the CPU route"
    assert np.percentile(lat, 50) < 25.0, f"decode latency p50 {np.percentile(lat, 50):.1f} ms"
    if clip == "gop30":
        assert got["low"], "a stream without B-frames decodes with LOW latency"
        assert max(got["lag"]) <= 1, "LOW latency: a frame leaves with its packet (or the next)"
    if clip == "bframes":
        assert not got["low"], "B-frames: NATIVE latency"


@pytest.mark.parametrize("size", [(1920, 1080), (640, 360), (322, 182)])
@pytest.mark.parametrize("dtype, normalized", [("float16", False), ("float32", True), ("float16", True)])
@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path here: {GPU_REASON}")
def test_fused_row_kernel_equals_the_array_code(
    model_info: Any, size: tuple[int, int], dtype: str, normalized: bool
) -> None:
    """nv12_to_row's one-kernel CuPy form against its array code (fused=False, CuPy) and numpy, on random NV12
    planes: the same taps and weights, so within float rounding (the kernel may fuse multiply-adds; a sample at a
    half level may round the other way), with
    tagged BT.709 full range and centred chroma too, in the model's dtype."""
    from dataclasses import replace

    import cupy as cp

    from stream.sources.nvdec import nv12_to_row

    w, h = size
    info = replace(
        model_info, dtype=dtype, **({"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)} if normalized else {})
    )
    rng = np.random.default_rng(w)
    y = rng.integers(0, 256, (h, w), dtype=np.uint8)
    uv = rng.integers(0, 256, (h // 2, w), dtype=np.uint8)
    tol = 2e-3 if dtype == "float16" else 2e-5
    level = float(np.max(np.float32(info.scale) / np.asarray(info.std, np.float32)))  # one 8-bit level, in the row
    for tags in ({}, {"colorspace": 1, "full_range": True, "siting": "center"}):
        rows = {}
        for name, fused in (("fused", True), ("array", False)):
            out = cp.full((3, info.height, info.width), -7.0, dtype=dtype)
            nv12_to_row(cp, cp.asarray(y), cp.asarray(uv), out, info, fused=fused, **tags)
            rows[name] = out.get().astype(np.float32)
        host = np.zeros((3, info.height, info.width), dtype)
        nv12_to_row(np, y, uv, host, info, **tags)
        assert (rows["fused"] != -7.0).all(), "pixels left unwritten"
        for other in (rows["array"], host.astype(np.float32)):
            # within float rounding, but for a converted sample that sits at a half level: the one form rounds
            # it up and the other down, a level (times its blend weight) apart, at a handful of values
            d = np.abs(rows["fused"] - other)
            off = d > tol * max(1.0, float(np.abs(other).max()))
            assert off.mean() <= 1e-4, f"{int(off.sum())} values differ beyond float rounding"
            assert float(d.max()) <= level * 1.01 + tol, f"a value {float(d.max()) / level:.2f} levels off"
        same = float((rows["fused"] == rows["array"]).mean())
        print(
            f"{w}x{h} {dtype} {'normalized' if normalized else 'plain'} {tags or 'untagged'}: {same:.4f} of values identical"
        )


@pytest.mark.parametrize(
    "clip, sizes", [("shrink", [(320, 240)] * 10 + [(160, 96)] * 8), ("grow", [(160, 96)] * 8 + [(320, 240)] * 10)]
)
@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path here: {GPU_REASON}")
def test_nvdec_resolution_changes(
    gpu_clips: dict[str, Path], model_info: Any, clip: str, sizes: list[tuple[int, int]]
) -> None:
    got = nvdec_pass(gpu_clips[clip], model_info)
    print(f"{clip}: sizes {got['sizes']}")
    assert got["sizes"] == sizes


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path here: {GPU_REASON}")
def test_device_rows_shift_and_ready(model_info: Any) -> None:
    """The stale-drop's row shift on a CuPy batch (overlapping rows: copied through a temporary)."""
    import cupy as cp

    from stream.sources.nvdec import DeviceRows

    info = dataclasses.replace(model_info, batch=4)
    rows = DeviceRows(info)
    data = rows.new_batch()
    with rows.stream:
        data[...] = cp.arange(4, dtype=data.dtype).reshape(4, 1, 1, 1)
    rows.shift(data, 1, 3)
    ev = rows.ready()
    ev.synchronize()
    assert data[:, 0, 0, 0].get().tolist() == [1.0, 2.0, 3.0, 3.0]


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path here: {GPU_REASON}")
def test_nvdec_live_feed_end_to_end(
    gpu_clips: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """(iii) A paced 1280x720 MPEG-TS feed (10 s: the first run of the CUDA kernels and sessions takes seconds,
    and a 4 s feed published only 21 frames on the H200, 2026-12-02) over tcp://, device cuda, live_decode nvdec: detections of the
    source's size arrive, the NVDEC route decoded them, and no frame-sized tensor reached the host."""
    from tests.gpu.test_gpu import HostCopyGuard

    caplog.set_level(logging.INFO)
    guard = HostCopyGuard(monkeypatch)
    result, msgs, served = run_paced(gpu_clips["feed"], 14.0, device="cuda", live_decode="nvdec")
    assert result.device == "cuda"
    assert "on NVDEC" in caplog.text, "the feed was not decoded on NVDEC"
    assert "decoding this feed on the CPU" not in caplog.text, "the NVDEC route fell back to the CPU"
    dets = check_live_messages(msgs, (1280, 720), min_frames=30)  # of 300 served (the first GOP goes to probing)
    frame_bytes = 1280 * 720 * 3  # as in test_gpu.py: a frame-sized copy is far above 1% of it
    print(
        f"nvdec route: {len(dets)} frames published of 300 served ({served.strip()}); dropped "
        f"{result.stats['cam'].dropped}; largest host copy {guard.largest} bytes of {len(guard.copies)}"
    )
    assert guard.copies, "the guard saw no copy at all: it is not wired to the path"
    assert guard.largest < frame_bytes // 100, (
        f"a large device-to-host copy: {sorted(guard.copies, key=lambda c: -c[1])[:3]}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path here: {GPU_REASON}")
def test_nvdec_live_detections_match_the_cpu_route(gpu_clips: dict[str, Path], model_info: Any) -> None:
    """The same paced feed decoded on NVDEC and on the CPU (both inferred on the GPU): detections of the frames
    both published (matched by pts) agree as in test_gpu.py (label, IoU >= 0.8, score within 0.03 for those
    0.03 over the threshold), at most 30% unmatched; a channel swap or a wrong box mapping leaves most unmatched."""
    from tests.conftest import unmatched

    _, nv, _ = run_paced(gpu_clips["feed"], 14.0, device="cuda", live_decode="nvdec")
    _, cpu, _ = run_paced(gpu_clips["feed"], 8.0, device="cuda", live_decode="cpu")
    by_pts = {round(m["pts_s"], 3): m for m in cpu if m["type"] == "detections"}
    pairs = [
        (m, by_pts[round(m["pts_s"], 3)]) for m in nv if m["type"] == "detections" and round(m["pts_s"], 3) in by_pts
    ]
    floor = (model_info.score_thresh or 0.0) + 0.03
    compared = missed = 0
    for a, b in pairs:
        missed += len(unmatched(a["detections"], b["detections"], min_iou=0.8, score_tol=0.03, floor=floor))
        missed += len(unmatched(b["detections"], a["detections"], min_iou=0.8, score_tol=0.03, floor=floor))
        compared += sum(d["score"] >= floor for d in a["detections"]) + sum(
            d["score"] >= floor for d in b["detections"]
        )
    print(f"nvdec vs cpu route on {len(pairs)} common frames: {missed} of {compared} detections unmatched")
    assert len(pairs) >= 10, f"only {len(pairs)} frames published by both routes"
    assert compared > 50 and missed <= 0.3 * compared, f"{missed} of {compared} unmatched"


# -- files on NVDEC frame by frame (stream/sources/nvdec_file.py), with the stand-ins -----------------------------
def _file_source(path: Path, info: Any, **kw: Any) -> Any:
    from stream.sources.naming import Source
    from stream.sources.nvdec_file import NvdecFileSource
    from stream.sources.pyav import probe

    src = Source("f", str(path))
    return NvdecFileSource(src, info, probe(src), **kw)


def _rows(source: Any) -> tuple[list[int], list[np.ndarray], list[float | None], list[Any]]:
    """Each batch's rows copied and its buffer handed back at once, as the engine does (the pool is small)."""
    index, rows, pts, batches = [], [], [], []
    for b in source:
        data = np.asarray(b.data)
        for i, m in enumerate(b.frames):
            index.append(m.index)
            rows.append(data[i].copy())
            pts.append(m.pts_s)
        batches.append((len(b.frames), b.ready, isinstance(b.data, np.ndarray)))
        b.done()
    return index, rows, pts, batches


@pytest.mark.parametrize("clip", ["hd", "vga"])
def test_every_frame_once_in_order_as_the_kernel_makes_it(
    fake_nvdec: FakeNvc, clips: dict[str, Path], model_info: Any, clip: str
) -> None:
    from stream.sources.nvdec import nv12_to_row

    index, rows, pts, batches = _rows(_file_source(clips[clip], model_info, pool=2))
    assert all(n == model_info.batch for n, _, _ in batches[:-1]) and batches[-1][0]
    ref = first_frames(clips[clip], 1000)
    assert index == list(range(len(ref))), "every frame once, in order"
    assert pts == pytest.approx([f.time for f in ref])
    out = np.zeros_like(rows[0])
    for row, f in zip(rows, ref):
        y, uv = nv12_planes(f)
        nv12_to_row(np, y, uv, out, model_info, **tags_of(f))
        assert np.array_equal(row, out)
    assert fake_nvdec.created, "NVDEC (the stand-in) decoded it"


def test_nvdec_failing_part_way_hands_the_rest_to_the_cpu(
    fake_nvdec: FakeNvc, clips: dict[str, Path], model_info: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake_nvdec.fail_after = 7  # the 8th packet fails: NVDEC has handed out fewer frames than that
    index, rows, _, batches = _rows(_file_source(clips["vga"], model_info))
    n = len(first_frames(clips["vga"], 1000))
    assert index == list(range(n)), "nothing lost, nothing twice"
    assert any(ready is None for _, ready, _ in batches), "the rest came from PyAV (host batches, no event)"
    assert "decoding the rest on the CPU" in caplog.text


def test_the_registry_takes_it_for_files_on_cuda_by_default(
    fake_nvdec: FakeNvc, clips: dict[str, Path], model_info: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stream import config
    from stream.sources.naming import Source
    from stream.sources.nvdec_file import NvdecFileSource
    from stream.sources.registry import make_source

    src = Source("f", str(clips["vga"]))
    assert config.load(None, {}).file_decode == "auto"
    for asked in ("auto", "nvdec"):
        nvdec = make_source(src, model_info, "cuda", config.load(None, {"file_decode": asked}))
        assert isinstance(nvdec, NvdecFileSource), asked
        nvdec.close()
    cpu = make_source(src, model_info, "cuda", config.load(None, {"file_decode": "cpu"}))
    assert type(cpu).__name__ == "HostBatchSource"


@pytest.mark.parametrize("asked, level", [("auto", logging.INFO), ("nvdec", logging.WARNING)])
def test_where_nvdec_cannot_run_a_file_goes_to_dali_and_the_log_says_why(
    clips: dict[str, Path],
    model_info: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    asked: str,
    level: int,
) -> None:
    """Without PyNvVideoCodec the file route is DALI's (a stand-in here): a note at info by default, a warning
    where frame by frame was asked for."""
    from stream import config
    from stream.sources import dali, nvdec
    from stream.sources.naming import Source
    from stream.sources.registry import make_source

    class DaliStandIn:
        def __init__(self, src: Source, *a: Any, **k: Any) -> None:
            self.stream = src.id

    monkeypatch.setattr(nvdec, "nvdec_unavailable_reason", lambda *a: "PyNvVideoCodec is not installed")
    monkeypatch.setattr(dali, "DaliBatchSource", DaliStandIn)
    caplog.set_level(logging.INFO)
    bsrc = make_source(Source("f", str(clips["vga"])), model_info, "cuda", config.load(None, {"file_decode": asked}))
    assert isinstance(bsrc, DaliStandIn)
    notes = [r for r in caplog.records if "cannot decode it frame by frame" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == level, [(r.levelname, r.getMessage()) for r in caplog.records]
    assert "stream f" in notes[0].getMessage() and "PyNvVideoCodec is not installed" in notes[0].getMessage()


if (
    __name__ == "__main__"
):  # python -m tests.sources.test_nvdec VIDEO PORT: serve VIDEO once, paced, as MPEG-TS over TCP
    serve_ts(sys.argv[1], int(sys.argv[2]))


def test_sequence_parameter_sets_change_where_the_resolution_does(tmp_path: Path) -> None:
    """The NVDEC route makes a new decoder when a keyframe brings new SPS bytes (a resolution change): the
    scan finds the SPS of each part of a real H.264 stream whose size changes, and they differ."""
    import av
    from av.bitstream import BitStreamFilterContext

    from stream.sources.pyav import sequence_parameter_sets
    from tests.conftest import make_resolution_change

    path = make_resolution_change(tmp_path / "rc.mkv")
    seen = []
    with av.open(str(path)) as c:
        vs = c.streams.video[0]
        bsf = BitStreamFilterContext("h264_mp4toannexb", vs)
        for pkt in c.demux(vs):
            if pkt.size == 0:
                continue
            key = pkt.is_keyframe
            for fp in bsf.filter(pkt):
                sps = sequence_parameter_sets(bytes(fp), "h264")
                if key:
                    seen.append(sps)
    assert len(seen) == 2 and all(seen) and seen[0] != seen[1]
    assert sequence_parameter_sets(b"\x00\x00\x01\x65\x88\x84", "h264") == b""  # an IDR slice alone


def test_a_nvdec_file_source_leaves_no_device_memory_behind(
    fake_nvdec: FakeNvc, clips: dict[str, Path], model_info: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NvdecFileSource (stand-ins for CuPy and PyNvVideoCodec): every frame in order; its lane (CUDA stream and
    batches) goes to the idle lanes only once iteration has ended and the last batch is back, and the next
    file's source decodes on that same stream into the same batches (CuPy reuses a freed block only on its own
    stream: a new stream per file or per looped pass left every pass's blocks in the pool). Past IDLE_LANES a
    finished lane is retired: its stream's cached blocks freed."""
    import sys

    import stream.sources.nvdec_file as nf
    from stream.sources.naming import Source
    from stream.sources.pyav import probe

    monkeypatch.setattr(nf, "_idle", {})
    cp = sys.modules["cupy"]
    src = Source("f", str(clips["vga"]))
    source = nf.NvdecFileSource(src, model_info, probe(src), pool=3)
    made = list(source._lane.batches)
    frames: list[int] = []
    held: list[Any] = []
    for b in source:  # inference's part: each batch released once the next one is out
        frames += [m.index for m in b.frames]
        held.append(b)
        if len(held) > 1:
            held.pop(0).release()
    assert frames == list(range(len(frames))) and len(frames) > 3 * model_info.batch
    assert nf._idle == {}  # iteration has ended, but one batch is still out
    held[0].release()
    assert [lane.rows for lane in nf._idle[source._key]] == [source.rows]
    again = nf.NvdecFileSource(src, model_info, probe(src), pool=3)
    assert again.rows is source.rows and [id(d) for d in again._lane.batches] == [id(d) for d in made]
    assert nf._idle[source._key] == []
    assert sum(len(b.frames) for b in _released(again)) == len(frames)
    assert [lane.rows for lane in nf._idle[source._key]] == [source.rows] and cp.freed_streams == []

    monkeypatch.setattr(nf, "IDLE_LANES", 0)
    third = nf.NvdecFileSource(src, model_info, probe(src), pool=3)
    assert third.rows is source.rows
    third.close()  # never iterated: its lane is done at once, and with no room among the idle ones, retired
    deadline = time.monotonic() + 5
    while not cp.freed_streams and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cp.freed_streams == [third.rows.stream]


def _released(source: Any) -> Iterator[Any]:
    for b in source:
        b.release()
        yield b


def test_a_live_feed_read_here_gives_its_device_memory_back_once_it_ends(
    fake_nvdec: FakeNvc, model_info: Any, tmp_path: Path
) -> None:
    """sources/live.py's NVDEC route read in this process (`live_workers = 0`), stand-ins for CuPy and
    PyNvVideoCodec, a real paced feed: once the feed is closed, its reader has left and the last batch handed out
    is back, the cached blocks of its CUDA stream are freed, once. Not before: a batch still in inference is
    written on that stream. (Without it every live feed removed from such a daemon left its batches in CuPy's pool
    on a stream nothing uses again.)"""
    from stream import config
    from stream.sources.live import LiveBatchSource
    from stream.sources.naming import Source
    from stream.tools.sample import make_sample_video

    cp = sys.modules["cupy"]
    video = make_sample_video(tmp_path / "feed.mp4", width=320, height=240, seconds=3.0)
    cfg = config.load(None, {"live_decode": "nvdec", "max_staleness_ms": 10_000, "reconnect_initial_s": 0.2})
    with PacedFeed(video) as feed:
        src = LiveBatchSource(Source("cam", feed.url, live=True), model_info, cfg, device="cuda")
        assert src.route == "nvdec"
        stream = src._dev_rows.stream
        batches = iter(src)
        held = [next(batches), next(batches)]  # in inference, as far as the source knows
        src.close()
        assert src.reader is not None
        src.reader.join(10)
        assert not src.reader.is_alive()
        time.sleep(0.2)
        assert cp.freed_streams == [], "freed while two batches are out"
        held.pop(0).release()
        time.sleep(0.2)
        assert cp.freed_streams == [], "freed while a batch is out"
        held.pop(0).release()
        deadline = time.monotonic() + 5
        while not cp.freed_streams and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cp.freed_streams == [stream]
        src.close()  # again: nothing more
        time.sleep(0.2)
        assert cp.freed_streams == [stream] and src._free == []


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path here: {GPU_REASON}")
def test_live_feeds_read_here_one_after_another_leave_no_device_memory(
    gpu_clips: dict[str, Path], model_info: Any
) -> None:
    """The real NVDEC route read in this process, three feeds one after another, each read for a few batches and
    closed with every batch back: CuPy's pool holds no more after the third than after the first (each feed's
    batches were allocated on its own stream; without the retire every feed left them in the pool)."""
    import cupy as cp

    from stream import config
    from stream.sources.live import LiveBatchSource
    from stream.sources.naming import Source

    pool = cp.get_default_memory_pool()
    cfg = config.load(None, {"live_decode": "nvdec", "max_staleness_ms": 10_000, "reconnect_initial_s": 0.2})
    held_after: list[int] = []
    for _ in range(3):
        with PacedFeed(gpu_clips["feed"]) as feed:
            src = LiveBatchSource(Source("cam", feed.url, live=True), model_info, cfg, device="cuda")
            assert src.route == "nvdec"
            batches = iter(src)
            for _ in range(3):
                next(batches).release()
            src.close()
            assert src.reader is not None
            src.reader.join(10)
            deadline = time.monotonic() + 10
            while not src._retired and time.monotonic() < deadline:
                time.sleep(0.05)
            assert src._retired
            time.sleep(0.5)  # the retire thread frees after a synchronize
            held_after.append(pool.total_bytes())
    batch_bytes = model_info.batch * 3 * model_info.height * model_info.width * np.dtype(model_info.dtype).itemsize
    print(f"CuPy pool after each of three live feeds: {held_after} bytes (a batch: {batch_bytes})")
    assert held_after[-1] - held_after[0] < batch_bytes, held_after
