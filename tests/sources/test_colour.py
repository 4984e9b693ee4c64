"""Colour fidelity on the CPU: every CPU decode route's model input against a numpy reference computed from the
decoded planes (tests/colour_ref.py), on videos made here with known signalling (BT.601 and BT.709, limited and
full range, tagged in the bitstream, in the container only, or not at all) and a 4:2:0 chroma edge pattern.

Tolerance (every route): mean absolute difference <= 0.5 level, 99.9th percentile <= 3 levels, at the model's
size (320x320, resized) and at the source's own size (no resize). Measured here: the NVDEC route's arithmetic
(numpy) and the CPU routes' conversion from the planes (the HD clips, and every clip with the planes forced)
mean 0.000, p99.9 0.000, max 0.000; the CPU routes' whole-frame conversion of smaller frames (swscale's
accurate path in its own integer arithmetic, then resized) mean 0.000-0.005, p99.9 at most 1, max 1 (a
sample whose value sits near a half level rounds the other way). A wrong matrix or range fails by
far (mean 6-9 levels), and so does swscale's default conversion (PyAV's `to_ndarray("rgb24")`, mean about 6.5,
p99.9 above 100 at the edges).

The GPU routes are measured against the same reference by tests/gpu/test_gpu_colour.py (`pytest -m gpu`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream.sources.colour import StreamColour, frame_colour, resolve, to_rgb
from stream.sources.naming import Source
from tests.colour_ref import (
    CLIPS,
    MEAN_MAX,
    P999_MAX,
    Clip,
    decoded,
    levels,
    make_clip,
    reference_rgb,
    reference_row,
    stats,
    yuv_planes,
)

BY_NAME = {c.name: c for c in CLIPS}


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("colour")
    return {c.name: make_clip(d, c) for c in CLIPS}


def sizes(model_info: Any, clip: Clip) -> list[Any]:
    """The shipped model (320x320: a resize) and a model of the source's own size (no resize)."""
    return [model_info, dataclasses.replace(model_info, width=clip.width, height=clip.height)]


def within(name: str, d: np.ndarray) -> None:
    mean, p999, mx = stats(d)
    print(f"{name}: mean {mean:.3f} p99.9 {p999:.3f} max {mx:.3f} levels")
    assert mean <= MEAN_MAX and p999 <= P999_MAX, f"{name}: mean {mean:.3f}, p99.9 {p999:.3f} levels"


def reference_rows(path: Path, clip: Clip, info: Any) -> list[np.ndarray]:
    return [reference_row(reference_rgb(*yuv_planes(f), clip.matrix, clip.full_range), info) for f in decoded(path)]


# -- the signalling ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [c.name for c in CLIPS])
def test_the_signalling_is_read(clips: dict[str, Path], name: str) -> None:
    import av

    clip = BY_NAME[name]
    with av.open(str(clips[name])) as c:
        vs = c.streams.video[0]
        colour = StreamColour("stream t", vs.codec_context, quiet=True).of(next(c.decode(vs)))
    assert colour.matrix == clip.matrix and colour.full_range == clip.full_range, colour
    text = colour.describe()
    print(f"{name}: {text}")
    if clip.tag_matrix:
        assert colour.matrix_from in ("frame", "stream") and f"colour {clip.matrix}" in text
    else:
        assert colour.matrix_from == "default" and text.startswith("colour untagged") and "default" in text


def test_the_default_follows_the_size() -> None:
    """Untagged: BT.709 for HD (width >= 1280 or height > 576), BT.601 for SD; limited range."""
    for (w, h), matrix in (
        ((1920, 1080), "BT.709"),
        ((1280, 720), "BT.709"),
        ((1024, 768), "BT.709"),
        ((720, 576), "BT.601"),
        ((640, 480), "BT.601"),
        ((352, 288), "BT.601"),
    ):
        c = resolve(None, None, w, h)
        assert (c.matrix, c.full_range, c.matrix_from, c.range_from) == (matrix, False, "default", "default"), (w, h)
    assert resolve(2, 0, 1920, 1080, pix_fmt="yuvj420p").full_range  # full range by pixel format
    assert resolve(5, 1, 1920, 1080).matrix == "BT.601"  # a tag wins over the size
    assert resolve(0, 3, 640, 360).matrix == "BT.601"  # unusable tags (RGB, reserved): the default


def test_tags_come_from_the_stream_where_the_frame_has_none(clips: dict[str, Path]) -> None:
    """A frame without tags takes its stream's (codec context's); FFmpeg's decoders also copy the container's
    tags to every frame (the MKV whose bitstream carries none: its frames are tagged)."""
    frame = decoded(clips["untagged_sd"])[0]
    assert (int(frame.colorspace), int(frame.color_range)) == (2, 0)

    class Ctx:
        colorspace, color_range = 1, 2

    c = frame_colour(frame, Ctx())
    assert (c.matrix, c.full_range, c.matrix_from, c.range_from) == ("BT.709", True, "stream", "stream")
    assert "colour BT.709, full range (tagged)" in c.describe()
    tagged = decoded(clips["container_tags"])[0]
    c = frame_colour(tagged)
    assert (c.matrix, c.full_range) == ("BT.709", True) and c.matrix_from == "frame"


# -- the routes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [c.name for c in CLIPS])
def test_the_file_route_matches_the_reference(
    clips: dict[str, Path], model_info: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """HostBatchSource (PyAV decode, colour.yuv420_to_row), the shipped model's size and the source's."""
    from stream.sources.host import HostBatchSource

    clip = BY_NAME[name]
    caplog.set_level(logging.INFO, logger="stream.sources.colour")
    for info in sizes(model_info, clip):
        src = HostBatchSource(Source(name, str(clips[name])), info)
        rows = [b.data[i].copy() for b in src for i in range(len(b.frames))]
        refs = reference_rows(clips[name], clip, info)
        assert len(rows) == len(refs) == 3
        within(f"{name} file route -> {info.width}x{info.height}", levels(np.stack(rows), np.stack(refs), info))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"stream {name}: colour")]
    assert len(lines) == 2, lines  # once per stream (two sources were made)
    assert f"converted {clip.matrix} {'full' if clip.full_range else 'limited'} range" in lines[0], lines[0]


@pytest.mark.parametrize("name", ["bt601_limited_sd", "bt709_full_yuvj", "untagged_sd"])
def test_the_planes_arithmetic_matches_the_reference(
    clips: dict[str, Path], model_info: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU routes' conversion from the planes (colour.yuv420_to_row), forced for frames it would convert
    whole with swscale: the same reference, within float rounding."""
    import stream.sources.host as host

    monkeypatch.setattr(host, "SWSCALE_MAX_RATIO", 0)
    clip = BY_NAME[name]
    for info in sizes(model_info, clip):
        src = host.HostBatchSource(Source(name, str(clips[name])), info)
        rows = [b.data[i].copy() for b in src for i in range(len(b.frames))]
        d = levels(np.stack(rows), np.stack(reference_rows(clips[name], clip, info)), info)
        within(f"{name} from the planes -> {info.width}x{info.height}", d)
        assert float(d.max()) < 0.01


@pytest.mark.parametrize("name", ["bt709_limited_hd", "bt601_full_sd", "untagged_hd"])
def test_the_live_route_rows_match_the_reference(clips: dict[str, Path], model_info: Any, name: str) -> None:
    """The live CPU route's row strategy (live.HostRows), fed frames as its reader feeds them: each with the
    conversion the source's StreamColour resolves for it."""
    import av

    from stream.sources.live import HostRows

    clip = BY_NAME[name]
    for info in sizes(model_info, clip):
        rows = HostRows(info)
        data = rows.new_batch()
        got = []
        with av.open(str(clips[name])) as c:
            vs = c.streams.video[0]
            colours = StreamColour(f"stream {name}", vs.codec_context, quiet=True)
            for f in c.decode(vs):
                rows.fill(data, 0, (f, colours.of(f)))
                got.append(data[0].copy())
        refs = reference_rows(clips[name], clip, info)
        within(f"{name} live route -> {info.width}x{info.height}", levels(np.stack(got), np.stack(refs), info))


def test_a_live_feed_end_to_end(tmp_path: Path, model_info: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A clip served as a live MPEG-TS feed over TCP and read by LiveBatchSource on the CPU route: its rows
    match the reference, and the colour it found and applied is logged once."""
    from stream import config
    from stream.sources.live import LiveBatchSource
    from tests.sources.test_nvdec import PacedFeed

    name = "bt709_limited_sd"
    clip = BY_NAME[name]
    caplog.set_level(logging.INFO)
    path = make_clip(tmp_path, clip, frames=75)  # 3 s: the feed's first packets may go to the demuxer's probe
    refs = reference_rows(path, clip, model_info)
    cfg = config.load(None, {"max_reconnects": 5, "max_staleness_ms": 60_000, "reconnect_initial_s": 0.2})
    got: dict[int, np.ndarray] = {}
    with PacedFeed(path) as feed:
        src = LiveBatchSource(Source("cam", feed.url, live=True), model_info, cfg, pool=4, device="cpu")
        deadline = time.monotonic() + 60
        try:
            for batch in src:
                got.update((m.index, batch.data[i].copy()) for i, m in enumerate(batch.frames))
                batch.release()
                if len(got) >= len(refs) or time.monotonic() > deadline:
                    break
        except Exception as exc:  # the feed ends: the source gives up after max_reconnects
            print(f"live source ended: {exc}")
        finally:
            src.close()
    print(f"{len(got)} of {len(refs)} frames; dropped {src.dropped}")
    assert len(got) >= 20, sorted(got)
    # each frame that arrived against the reference frame nearest to it: the pattern repeats every 22 frames,
    # and a live feed starts at the first keyframe after the demuxer's probe, a few frames in
    d = [
        min((levels(row, ref, model_info) for ref in refs[:22]), key=lambda x: float(x.mean())) for row in got.values()
    ]
    within(f"{name} live feed -> 320x320", np.stack(d))
    lines = [r.getMessage() for r in caplog.records if ": colour " in r.getMessage()]
    print(lines)
    assert len(lines) == 1 and lines[0].startswith("stream cam: url tcp://"), lines
    assert "colour BT.709, limited range (tagged), converted BT.709 limited range, chroma bilinear" in lines[0]


@pytest.mark.parametrize("name", ["bt601_limited_sd", "bt709_limited_hd", "bt709_full_yuvj", "untagged_hd"])
def test_the_nvdec_arithmetic_matches_the_reference(clips: dict[str, Path], model_info: Any, name: str) -> None:
    """nvdec.nv12_to_row with numpy (the array code the CUDA kernel is checked against, in
    tests/engines/test_kernel_sources.py) on the frames' NV12 planes, with the conversion NvdecDecoder resolves
    from the stream's tags and the frame size."""
    import av

    from stream.sources.nvdec import nv12_to_row

    clip = BY_NAME[name]
    for info in sizes(model_info, clip):
        got = []
        with av.open(str(clips[name])) as c:
            ctx = c.streams.video[0].codec_context
            for f in c.decode(video=0):
                col = resolve(ctx.colorspace, ctx.color_range, f.width, f.height, pix_fmt=ctx.pix_fmt)
                y, u, v = yuv_planes(f)
                out = np.zeros((3, info.height, info.width), np.float32)
                nv12_to_row(
                    np, y, np.stack([u, v], -1), out, info, colorspace=col.colorspace, full_range=col.full_range
                )
                got.append(out)
        refs = reference_rows(clips[name], clip, info)
        within(f"{name} NVDEC arithmetic -> {info.width}x{info.height}", levels(np.stack(got), np.stack(refs), info))


@pytest.mark.parametrize("name", ["bt601_limited_sd", "bt709_limited_hd", "bt601_full_sd", "untagged_hd"])
def test_the_rgb_conversion_matches_the_reference(clips: dict[str, Path], name: str) -> None:
    """colour.to_rgb (swscale's accurate path with the signalled matrix and range, rounded to uint8): the route
    of pixel formats other than 4:2:0, at the source's size."""
    clip = BY_NAME[name]
    frames = decoded(clips[name])
    d = [
        np.abs(to_rgb(f, frame_colour(f)) - reference_rgb(*yuv_planes(f), clip.matrix, clip.full_range)) for f in frames
    ]
    within(f"{name} to_rgb", np.stack(d))


# -- the tests can fail ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bt601_limited_sd", "bt709_limited_hd", "bt601_full_sd"])
def test_a_wrong_conversion_is_caught(clips: dict[str, Path], model_info: Any, name: str) -> None:
    """The measure fails a route that converts with the other matrix, the other range, or as swscale's default
    does (PyAV's to_ndarray("rgb24"): nearest chroma, BT.601 for untagged video)."""
    from stream.sources.host import HostBatchSource

    clip = BY_NAME[name]
    info = model_info
    rows = np.stack(
        [b.data[i].copy() for b in HostBatchSource(Source(name, str(clips[name])), info) for i in range(len(b.frames))]
    )
    frames = decoded(clips[name])
    wrong = {
        "other matrix": dataclasses.replace(clip, matrix="BT.601" if clip.matrix == "BT.709" else "BT.709"),
        "other range": dataclasses.replace(clip, full_range=not clip.full_range),
    }
    for why, bad in wrong.items():
        refs = np.stack(
            [reference_row(reference_rgb(*yuv_planes(f), bad.matrix, bad.full_range), info) for f in frames]
        )
        mean, p999, _ = stats(levels(rows, refs, info))
        print(f"{name} against a reference with the {why}: mean {mean:.2f} p99.9 {p999:.2f}")
        assert mean > MEAN_MAX or p999 > P999_MAX
    ref = np.stack([reference_rgb(*yuv_planes(f), clip.matrix, clip.full_range) for f in frames])
    default = np.stack([f.to_ndarray(format="rgb24") for f in frames])
    mean, p999, _ = stats(np.abs(default - ref))
    print(f"{name}: swscale's default conversion: mean {mean:.2f} p99.9 {p999:.2f}")
    assert mean > MEAN_MAX or p999 > P999_MAX


def test_swscale_stands_in_only_for_left_sited_decoders(tmp_path: Path) -> None:
    """swscale's accurate path takes the chroma siting from the frame's tag: only H.264/HEVC frames (tagged
    left, the siting the conversion assumes) may take it; an MPEG-4 Part 2 file's frames are converted from
    their planes."""
    import av

    from stream.sources.colour import frame_colour
    from stream.tools.sample import make_sample_video

    for codec, name, sited in (("libx264", "h.mp4", True), ("mpeg4", "m.mkv", False)):
        path = make_sample_video(tmp_path / name, width=197, height=143, seconds=0.2, codec=codec)
        with av.open(str(path)) as c:
            vs = c.streams.video[0]
            assert frame_colour(next(c.decode(vs)), vs.codec_context).left_sited is sited, codec


def test_both_cpu_conversions_give_the_same_detections(
    tmp_path: Path, model_info: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two ways the CPU routes convert a frame (swscale whole, or from the planes) give the shipped model the
    same detections: both round the converted samples to 8-bit levels before the resize. The shipped model has
    random weights and is sensitive to its input: when the planes kept the unrounded value (within half a
    level of swscale's), 19% of the detections on this clip matched."""
    import stream.sources.host as host
    from stream.core.frames import Batch
    from stream.engines.cpu import CpuEngine
    from stream.messages import detection_list
    from stream.tools.sample import make_sample_video
    from tests.conftest import unmatched

    video = make_sample_video(tmp_path / "plain.mp4", width=640, height=360, seconds=3.0)
    engine = CpuEngine(model_info)
    runs = []
    for ratio in (host.SWSCALE_MAX_RATIO, 0):  # 640x360 is converted whole by default; 0 forces the planes
        monkeypatch.setattr(host, "SWSCALE_MAX_RATIO", ratio)
        dets = []
        for b in host.HostBatchSource(Source("plain", str(video)), model_info):
            data = np.array(b.data, copy=True)
            n = len(b.frames)
            b.done()
            for r in engine.infer(Batch("plain", b.frames, data))[:n]:
                dets.append(
                    detection_list(r.boxes.tolist(), r.scores.tolist(), r.labels.tolist(), model_info.label_names)
                )
        runs.append(dets)
    engine.close()
    whole, from_planes = runs
    floor = (model_info.score_thresh or 0.0) + 0.03
    compared = missed = 0
    for a, b in zip(whole, from_planes):
        for x, y in ((a, b), (b, a)):
            missed += len(unmatched(x, y, min_iou=0.9, score_tol=0.01, floor=floor))
        compared += sum(d["score"] >= floor for d in a) + sum(d["score"] >= floor for d in b)
    print(f"swscale whole vs from the planes: {compared - missed} of {compared} detections matched")
    assert len(whole) == len(from_planes) == 90 and compared > 1000
    assert missed <= 0.01 * compared, f"{missed} of {compared} detections unmatched at IoU >= 0.9, score within 0.01"
