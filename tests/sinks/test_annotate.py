"""Annotated video: `stream annotate`, `stream run --annotate DIR` and AnnotatingSink, on real H.264 files.

The files are made by the tests (conftest's `videos`), the detections come from the shipped model, the output is
decoded again with PyAV and compared with the source pixel by pixel. A full disk is the real thing: /dev/full.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest

from stream import config
from stream.core.build import resolve
from stream.core.runner import Runner
from stream.engines.device import make_engine
from stream.sinks.annotate import AnnotatingSink, Annotator, safe_name
from stream.sources.naming import Source
from tests.conftest import Collector, free_port, run_cli


class ListSink:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def send(self, msg: dict[str, Any]) -> None:
        self.messages.append(msg)


def run_annotating(
    sources: list[str], out_dir: Path, **settings: Any
) -> tuple[dict[str, list[dict[str, Any]]], AnnotatingSink, Any]:
    """The pipeline in process with an AnnotatingSink over a list: (messages by stream, the sink, the stats)."""

    async def go() -> tuple[ListSink, AnnotatingSink, Any]:
        cfg = config.load(None, {"sources": sources, "device": "cpu", "progress": "off", **settings})
        srcs, info, _ = resolve(cfg)
        engine = make_engine("cpu", info, cfg)
        inner = ListSink()
        sink = AnnotatingSink(inner, out_dir, lambda sid: next((s for s in reversed(srcs) if s.id == sid), None))
        try:
            stats = await Runner(cfg, srcs, info, engine, sink).run()
            await sink.close()
        finally:
            engine.close()
        return inner, sink, stats

    inner, sink, stats = asyncio.run(go())
    by: dict[str, list[dict[str, Any]]] = {}
    for m in inner.messages:
        by.setdefault(m["stream"], []).append(m)
    return by, sink, stats


def frames_rgb(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def video_facts(path: Path) -> dict[str, Any]:
    with av.open(str(path)) as c:
        vs = c.streams.video[0]
        frames = list(c.decode(vs))
        return {
            "codec": vs.codec_context.name,
            "pix_fmt": vs.codec_context.pix_fmt,
            "frames": len(frames),
            "size": (frames[0].width, frames[0].height),
            "pts": [f.pts for f in frames],
            "rate": vs.average_rate,
        }


def fake_messages(sid: str, n: int) -> list[dict[str, Any]]:
    """Detection messages without detections for frames 0..n-1, then the eos: no model needed."""
    from stream import messages

    out = [messages.detections(sid, i, pts_s=None, captured_at=0.0, width=0, height=0, dets=[]) for i in range(n)]
    return [*out, messages.eos(sid, n)]


def feed(sink: AnnotatingSink, msgs: list[dict[str, Any]]) -> None:
    async def go() -> None:
        for m in msgs:
            await sink.send(m)
        await sink.close()

    asyncio.run(go())


def near_and_edges(shape: tuple[int, int], dets: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Masks: pixels near a detection (its box, a margin, its label above) and the pixels of the box outlines."""
    h, w = shape
    near = np.zeros((h, w), bool)
    edges = np.zeros((h, w), bool)
    for d in dets:
        x1, y1, x2, y2 = (int(round(v)) for v in d["box"])
        near[max(0, y1 - 30) : y2 + 6, max(0, x1 - 6) : max(x2, x1 + 160) + 6] = True
        x2, y2 = min(max(x1, x2 - 1), w - 1), min(max(y1, y2 - 1), h - 1)
        x1, y1 = min(x1, w - 1), min(y1, h - 1)
        edges[y1 : y2 + 1, [x1, x2]] = True
        edges[[y1, y2], x1 : x2 + 1] = True
    return near, edges


# -- the annotated file --------------------------------------------------------------------------------------
def test_annotated_video_draws_the_published_detections(videos: dict[str, Path], tmp_path: Path) -> None:
    by, sink, stats = run_annotating([f"lobby={videos['plain']}"], tmp_path / "out")
    msgs = by["lobby"]
    dets = [m["detections"] for m in msgs if m["type"] == "detections"]
    assert msgs[-1]["type"] == "eos" and len(dets) == msgs[-1]["frames"]  # every message forwarded, unchanged
    out = tmp_path / "out" / "lobby.mp4"
    assert [a.output for a in sink.annotators] == [out] and sink.annotators[0].state == "done"

    src, ann = video_facts(videos["plain"]), video_facts(out)
    assert ann["codec"] == "h264" and ann["pix_fmt"] == "yuv420p"
    assert ann["frames"] == src["frames"] == len(dets)
    assert ann["size"] == src["size"] == (320, 240)
    assert ann["rate"] == src["rate"] and ann["pts"] == src["pts"]  # the source's own timestamps

    # the shipped model (random weights) finds "objects" on most frames of the sample and none on some
    counts = [len(d) for d in dets]
    assert sum(c > 0 for c in counts) > len(counts) // 2 and 0 in counts, counts
    drawn, empty = 0, 0
    for i, (a, b, d) in enumerate(zip(frames_rgb(videos["plain"]), frames_rgb(out), dets)):
        diff = np.abs(a.astype(np.int16) - b.astype(np.int16)).max(axis=2)
        if not d:  # nothing to draw: the frame is the source's, up to the encoder's loss
            assert diff.mean() < 4, (i, diff.mean())
            empty += 1
            continue
        near, edges = near_and_edges(diff.shape, d)
        far = ~near
        assert diff[far].mean() < 5, (i, diff[far].mean())  # away from the boxes: unchanged
        assert diff[edges].mean() > 40, (i, diff[edges].mean())  # on the boxes: drawn over
        assert diff[edges].mean() > 10 * max(diff[far].mean(), 0.5)
        drawn += 1
    assert drawn and empty


def test_frames_match_on_bframes_and_odd_sizes(videos: dict[str, Path], tmp_path: Path) -> None:
    """Frame i of the annotated file is frame i of the source (B-frames reorder decoding); odd sizes become even."""
    by, sink, _ = run_annotating([str(videos["bframes"]), str(videos["odd_bframes"])], tmp_path)
    for sid, size in (("bframes", (352, 288)), ("odd_bframes", (322, 242))):
        facts = video_facts(tmp_path / f"{sid}.mp4")
        src = frames_rgb(videos[sid])
        assert facts["frames"] == len(src) == by[sid][-1]["frames"] and facts["size"] == size
        out = frames_rgb(tmp_path / f"{sid}.mp4")
        dets = [m["detections"] for m in by[sid] if m["type"] == "detections"]
        h, w = src[0].shape[:2]
        for i in range(1, len(src) - 1):
            far = ~near_and_edges((h, w), dets[i])[0]
            if far.mean() < 0.2:
                continue

            def err(a: np.ndarray, b: np.ndarray) -> float:  # called within this iteration only
                return float(np.abs(a[:h, :w].astype(np.int16) - b.astype(np.int16)).max(axis=2)[far].mean())  # noqa: B023

            assert err(out[i], src[i]) < 5, (sid, i, err(out[i], src[i]))
            for j in (i - 1, i + 1):  # the moving shapes make neighbouring frames differ (not in the dark stretch)
                if err(src[i], src[j]) > 2:
                    assert err(out[i], src[i]) < err(out[i], src[j]), (sid, i, j)


def test_a_cut_off_file_is_playable_up_to_the_cut(videos: dict[str, Path], tmp_path: Path) -> None:
    """Fragmented MP4: what a full disk or a kill leaves behind still plays up to where it stops."""
    from stream.tools.sample import make_sample_video

    video = make_sample_video(tmp_path / "long.mp4", width=320, height=240, seconds=4.0)
    sink = AnnotatingSink(ListSink(), tmp_path / "out", {"long": Source("long", str(video))})
    feed(sink, fake_messages("long", 120))
    data = (tmp_path / "out" / "long.mp4").read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: int(len(data) * 0.75)])
    n = 0
    with av.open(str(cut)) as c:
        try:
            for _ in c.decode(video=0):
                n += 1
        except av.error.FFmpegError:  # the last, cut-off frame
            pass
    assert 60 <= n < 120  # at least the first complete 2-second fragment


def test_close_stops_an_annotator_that_is_not_done_in_time(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """close() with timeout_s=0 stops an annotator with frames still queued; what it wrote is a proper file.

    Deterministic: the first 20 frames are written (the annotator then waits for more), the other 100 and
    the eos are queued and close() is called at once: writing 100 frames takes far longer than close()
    takes to abort, so the annotator stops between frame 20 and 120."""
    from stream.tools.sample import make_sample_video

    video = make_sample_video(tmp_path / "long.mp4", width=320, height=240, seconds=4.0)
    sink = AnnotatingSink(ListSink(), tmp_path / "out", {"long": Source("long", str(video))}, timeout_s=0.0)
    msgs = fake_messages("long", 120)

    async def go() -> Annotator:
        for m in msgs[:20]:
            await sink.send(m)
        (ann,) = sink.annotators
        deadline = time.monotonic() + 60
        while ann.frames < 20 and ann.active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ann.frames == 20 and ann.active, (ann.frames, ann.state, ann.error)
        for m in msgs[20:]:
            await sink.send(m)
        await sink.close()
        return ann

    with caplog.at_level(logging.ERROR):
        ann = asyncio.run(go())
    assert ann.state == "aborted" and 20 <= ann.frames < 120, (ann.state, ann.frames)
    assert any("stopped unfinished" in r.getMessage() and "long.mp4" in r.getMessage() for r in caplog.records)
    assert video_facts(tmp_path / "out" / "long.mp4")["frames"] == ann.frames  # closed properly: every frame in it


# -- the command ---------------------------------------------------------------------------------------------
def test_cli_annotate_end_to_end(videos: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "new folder" / "lobby annotated.mp4"
    proc = run_cli(
        ["annotate", "--source", str(videos["plain"]), "--output", str(out), "--device", "cpu", "--progress", "off"]
    )
    assert proc.returncode == 0, proc.stderr
    facts, src = video_facts(out), video_facts(videos["plain"])
    assert facts["frames"] == src["frames"] and facts["size"] == src["size"] and facts["codec"] == "h264"
    assert proc.stdout.startswith(f"{out}: {src['frames']} frames, "), proc.stdout


@pytest.mark.parametrize("case", ["missing", "not_a_video", "folder", "url", "same_file"])
def test_cli_annotate_bad_source_exits_2(videos: dict[str, Path], tmp_path: Path, case: str) -> None:
    notes = tmp_path / "notes.mp4"
    notes.write_text("not a video\n")
    source, output, words = {
        "missing": (tmp_path / "nope.mp4", tmp_path / "o.mp4", "does not exist"),
        "not_a_video": (notes, tmp_path / "o.mp4", "cannot be opened as a video"),
        "folder": (tmp_path, tmp_path / "o.mp4", "is a folder"),
        "url": ("rtsp://127.0.0.1:1/cam", tmp_path / "o.mp4", "is a URL"),
        "same_file": (videos["plain"], videos["plain"], "would overwrite the source"),
    }[case]
    before = videos["plain"].read_bytes() if case == "same_file" else None
    proc = run_cli(["annotate", "--source", str(source), "--output", str(output), "--device", "cpu"], timeout_s=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines()[-1].startswith("stream annotate: ") and words in proc.stderr, proc.stderr
    assert not output.exists() or case == "same_file"
    if before is not None:
        assert videos["plain"].read_bytes() == before


def test_cli_annotate_truncated_source_keeps_what_decoded(videos: dict[str, Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut.mp4"
    with av.open(str(videos["plain"])) as src, av.open(str(cut), "w", options={"movflags": "faststart"}) as dst:
        vs = src.streams.video[0]
        out = dst.add_stream_from_template(vs)
        for pkt in src.demux(vs):
            if pkt.dts is not None:
                pkt.stream = out
                dst.mux(pkt)
    raw = cut.read_bytes()
    cut.write_bytes(raw[: int(len(raw) * 0.6)])
    out = tmp_path / "cut-annotated.mp4"
    proc = run_cli(["annotate", "--source", str(cut), "--output", str(out), "--device", "cpu", "--progress", "off"])
    assert proc.returncode == 1, proc.stderr
    assert "truncated" in proc.stderr
    n = video_facts(out)["frames"]
    assert 0 < n < video_facts(videos["plain"])["frames"] and f"holds the {n} frames" in proc.stderr


def test_cli_annotate_disk_full_exits_1(videos: dict[str, Path]) -> None:
    proc = run_cli(
        ["annotate", "--source", str(videos["plain"]), "--output", "/dev/full", "--device", "cpu", "--progress", "off"]
    )
    assert proc.returncode == 1, proc.stderr
    assert "the disk is full" in proc.stderr and "/dev/full" in proc.stderr and "free space" in proc.stderr


# -- errors while annotating never reach the pipeline ------------------------------------------------------
def test_disk_full_stops_that_stream_only(
    videos: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "full.mp4").symlink_to("/dev/full")  # writes to it fail with ENOSPC, as on a full disk
    with caplog.at_level(logging.INFO):
        by, sink, stats = run_annotating([f"full={videos['plain']}", f"fine={videos['plain']}"], out)
    n = video_facts(videos["plain"])["frames"]
    for sid in ("full", "fine"):  # every frame published for both
        assert stats[sid].state == "completed"
        assert [m["frame"] for m in by[sid] if m["type"] == "detections"] == list(range(n))
        assert by[sid][-1] == {"v": 1, "type": "eos", "stream": sid, "frames": n, "read": n, "dropped": 0}
    states = {a.src.id: a for a in sink.annotators}
    assert states["full"].state == "failed" and states["fine"].state == "done"
    assert video_facts(out / "fine.mp4")["frames"] == n
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors  # one clear error, for that stream
    assert "stream full" in errors[0] and str(out / "full.mp4") in errors[0] and "the disk is full" in errors[0]
    assert "free space" in errors[0] and "--annotate" in errors[0] and "still published" in errors[0]
    assert os.readlink(out / "full.mp4") == "/dev/full"  # nothing deleted


def test_unwritable_folder_is_a_clear_error(
    videos: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way\n")
    with caplog.at_level(logging.ERROR):
        by, sink, stats = run_annotating([f"cam={videos['plain']}"], blocker / "out")
    assert stats["cam"].state == "completed" and by["cam"][-1]["type"] == "eos"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "stream cam" in errors[0] and str(blocker / "out" / "cam.mp4") in errors[0], errors
    assert "not a folder" in errors[0] and "--annotate" in errors[0]
    assert blocker.read_text() == "in the way\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_a_clear_error(videos: dict[str, Path], tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        ann = Annotator(Source("cam", str(videos["plain"])), ro / "cam.mp4").start()
        ann.finish()
        assert ann.join(30)
    finally:
        ro.chmod(0o700)
    assert ann.state == "failed" and "not writable" in (ann.error or "") and "make that folder writable" in ann.error


def test_run_annotate_flag_disk_full_publishes_everything(videos: dict[str, Path], tmp_path: Path) -> None:
    """`stream run --annotate DIR`: one stream's file on a full disk, the other written; every frame published."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "full.mp4").symlink_to("/dev/full")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    col = Collector(endpoint, expect_streams=2)
    proc = run_cli(
        [
            "run",
            "--source",
            f"full={videos['plain']}",
            "--source",
            f"fine={videos['bframes']}",
            "--annotate",
            str(out),
            "--device",
            "cpu",
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--progress",
            "off",
        ]
    )
    col.join()
    assert proc.returncode == 0, proc.stderr
    by = col.by_stream()
    for sid, video in (("full", videos["plain"]), ("fine", videos["bframes"])):
        n = video_facts(video)["frames"]
        assert [m["frame"] for m in by[sid] if m["type"] == "detections"] == list(range(n))
        assert by[sid][-1]["type"] == "eos"
    assert video_facts(out / "fine.mp4")["frames"] == video_facts(videos["bframes"])["frames"]
    assert "stream full" in proc.stderr and "the disk is full" in proc.stderr and str(out / "full.mp4") in proc.stderr


def test_config_key_annotate_dir(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('annotate_dir = "annotated"\n')
    assert config.load(p).annotate_dir == "annotated"
    assert config.load(None, {"annotate_dir": "x"}).annotate_dir == "x"
    p.write_text("annotate_dir = 3\n")
    with pytest.raises(config.ConfigError, match="'annotate_dir'.*must be str"):
        config.load(p)


# -- the sink's bookkeeping (real files, messages without a model) -------------------------------------------
def test_live_and_unknown_streams_are_not_annotated(
    videos: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stream import messages

    inner = ListSink()
    live = Source("cam", "rtsp://user:secret@127.0.0.1:8554/cam", live=True)
    sink = AnnotatingSink(inner, tmp_path, {"cam": live})
    msgs = [messages.status("cam", "connecting"), *fake_messages("cam", 5), *fake_messages("ghost", 3)]
    with caplog.at_level(logging.WARNING):
        feed(sink, msgs)
    assert inner.messages == msgs and not sink.annotators and not list(tmp_path.iterdir())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per stream, not one per message
    assert "stream cam" in warnings[0] and "live feed" in warnings[0] and "secret" not in warnings[0]
    assert "stream ghost" in warnings[1]


def test_file_names_are_safe_and_unique(videos: dict[str, Path], tmp_path: Path) -> None:
    assert safe_name("lobby") == "lobby" and safe_name("cams/gate 2") == "cams_gate_2"
    assert safe_name("../../etc/passwd") == "etc_passwd" and safe_name("..") == "stream"
    src = str(videos["plain"])
    lookup = {sid: Source(sid, src) for sid in ("a/b", "a_b", "../x")}
    sink = AnnotatingSink(ListSink(), tmp_path / "out", lookup)
    # a/b and a_b sanitize alike; "a/b" ends and is added again: a third file
    msgs = [*fake_messages("a/b", 3), *fake_messages("a_b", 3), *fake_messages("a/b", 2), *fake_messages("../x", 1)]
    feed(sink, msgs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a_b-2.mp4", "a_b-3.mp4", "a_b.mp4", "x.mp4"]
    assert [(a.src.id, a.output.name, a.frames) for a in sink.annotators] == [
        ("a/b", "a_b.mp4", 3),
        ("a_b", "a_b-2.mp4", 3),
        ("a/b", "a_b-3.mp4", 2),
        ("../x", "x.mp4", 1),
    ]


def test_a_backlog_past_the_limit_stops_that_stream(
    videos: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inner = ListSink()
    sink = AnnotatingSink(inner, tmp_path, {"s": Source("s", str(videos["plain"]))}, max_backlog=5)
    msgs = fake_messages("s", 60)
    with caplog.at_level(logging.ERROR):
        feed(sink, msgs)
    assert inner.messages == msgs
    (ann,) = sink.annotators
    assert ann.state == "aborted" and ann.frames < 60
    assert any("fell" in r.getMessage() and "behind" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("detect_fps", [5.0, 0.0])
def test_a_detection_rate_holds_the_last_boxes_between_picks(
    videos: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, detect_fps: float
) -> None:
    """Messages for every 6th frame (detect_fps 5 on 30 fps): the frames between are drawn with the last boxes,
    without a warning; without a rate such frames are gaps, written as they are (and warned about once)."""
    from stream import messages

    box = {"label": 1, "name": "person", "score": 0.9, "box": [40.0, 40.0, 200.0, 180.0]}
    picked = list(range(0, 60, 6))
    msgs = [
        messages.detections("cam", i, pts_s=None, captured_at=0.0, width=320, height=240, dets=[box]) for i in picked
    ]
    out = tmp_path / "out"
    sink = AnnotatingSink(ListSink(), out, {"cam": Source("cam", str(videos["plain"]))}, detect_fps=detect_fps)
    with caplog.at_level(logging.WARNING):
        feed(sink, [*msgs, messages.eos("cam", len(picked))])
    assert sink.annotators[0].state == "done"
    assert ("had no detections message" in caplog.text) == (detect_fps == 0)
    src, ann = frames_rgb(videos["plain"]), frames_rgb(out / "cam.mp4")
    assert len(ann) == picked[-1] + 1
    _, edges = near_and_edges((240, 320), [box])
    for i in (0, 3, 6, 11, 53):
        diff = np.abs(src[i].astype(np.int16) - ann[i].astype(np.int16)).max(axis=2)
        drawn = diff[edges].mean() > 40
        assert drawn == (i in picked or detect_fps > 0), (i, diff[edges].mean())
