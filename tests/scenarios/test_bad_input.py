"""Bad input: a clear error line naming the stream and the file, a status message, the other streams complete."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import Collector, collect_run, free_port, run_cli
from tests.scenarios.test_e2e import check_stream


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory, videos: dict[str, Path]) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    text = d / "notes.mp4"
    text.write_text("this is not a video\n" * 100)
    empty = d / "empty.mp4"
    empty.write_bytes(b"")
    data = videos["plain"].read_bytes()
    truncated = d / "truncated.mp4"  # moov at the end (FFmpeg's default): cut off, the index is gone
    truncated.write_bytes(data[: len(data) // 2])
    # An MP4 with its index first (faststart) cut mid-GOP: the first frames still decode, and the header
    # says how many frames there should have been.
    import av

    cut = d / "cut.mp4"
    with av.open(str(videos["plain"])) as src, av.open(str(cut), "w", options={"movflags": "faststart"}) as dst:
        vs = src.streams.video[0]
        out = dst.add_stream_from_template(vs)
        for pkt in src.demux(vs):
            if pkt.dts is not None:
                pkt.stream = out
                dst.mux(pkt)
    raw = cut.read_bytes()
    cut.write_bytes(raw[: int(len(raw) * 0.6)])
    audio = d / "audio.m4a"
    with av.open(str(audio), "w") as c:
        s = c.add_stream("aac", rate=16000)
        for i in range(20):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 16000
            frame.pts = i * 1024
            c.mux(s.encode(frame))
        c.mux(s.encode())
    return {
        "missing": d / "missing.mp4",
        "notes": text,
        "empty": empty,
        "truncated": truncated,
        "cut": cut,
        "audio": audio,
    }


def test_bad_sources_fail_alone(videos: dict[str, Path], bad_files: dict[str, Path], model_info: Any) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    streams = {"good": videos["plain"], **bad_files}
    col = Collector(endpoint, expect_streams=len(streams))
    args = [a for sid, p in streams.items() for a in ("--source", f"{sid}={p}")]
    proc = run_cli(
        ["run", *args, "--device", "cpu", "--publish", endpoint, "--wait-subscribers", "1", "--progress", "off"]
    )
    col.join()
    by = col.by_stream()
    assert proc.returncode == 1, proc.stderr
    check_stream(by["good"], "good", videos["plain"], model_info.label_names)
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    for sid, path in bad_files.items():
        last = by[sid][-1]
        assert last["type"] == "status" and last["state"] == "failed", (sid, last)
        assert f"stream {sid}" in last["error"] and str(path) in last["error"], last["error"]
        mine = [e for e in errors if f"stream {sid}:" in e]
        assert len(mine) == 1, (sid, errors)
        frames = [m for m in by[sid] if m["type"] == "detections"]
        assert [m["frame"] for m in frames] == list(range(len(frames)))
        assert last["frames"] == len(frames)
    assert "does not exist" in by["missing"][-1]["error"]
    assert "empty" in by["empty"][-1]["error"]
    assert "no video stream" in by["audio"][-1]["error"]
    assert "truncated" in by["truncated"][-1]["error"]
    # a file cut mid-GOP publishes what it could decode, then reports the loss
    assert by["cut"][-1]["frames"] > 0 and "truncated" in by["cut"][-1]["error"]


def test_wrong_model_inputs_exit_2(tmp_path: Path, videos: dict[str, Path]) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [1, 320, 320])
    y = helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 320, 320])
    graph = helper.make_graph([helper.make_node("Identity", ["pixels"], ["boxes"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    bad = tmp_path / "rank3.onnx"
    onnx.save(model, str(bad))
    proc = run_cli(
        [
            "run",
            "--source",
            str(videos["plain"]),
            "--model",
            str(bad),
            "--device",
            "cpu",
            "--publish",
            f"tcp://127.0.0.1:{free_port()}",
            "--progress",
            "off",
        ]
    )
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert str(bad) in line and "rank 3" in line and "stream export-model" in line


def test_missing_model_exit_2(tmp_path: Path) -> None:
    proc = run_cli(["run", "--model", str(tmp_path / "nope.onnx"), "--device", "cpu", "--progress", "off"])
    assert proc.returncode == 2
    assert "nope.onnx" in proc.stderr and "no such file" in proc.stderr


def test_unknown_url_scheme_fails_alone(videos: dict[str, Path], model_info: Any) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    col = Collector(endpoint, expect_streams=2)
    proc = run_cli(
        [
            "run",
            "--source",
            f"good={videos['plain']}",
            "--source",
            "odd=gopher://user:pw@host/x",
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
    by = col.by_stream()
    assert proc.returncode == 1
    check_stream(by["good"], "good", videos["plain"], model_info.label_names)
    last = by["odd"][-1]
    assert last["state"] == "failed" and "unknown URL scheme 'gopher'" in last["error"] and "pw" not in last["error"]
    assert "pw@" not in proc.stderr


def test_resolution_change_mid_stream_publishes_every_frame_at_its_size(tmp_path: Path, model_info: Any) -> None:
    from tests.conftest import make_resolution_change

    path = make_resolution_change(tmp_path / "res_change.mkv")
    _, by = collect_run([f"rc={path}"], f"tcp://127.0.0.1:{free_port()}")
    dets = [m for m in by["rc"] if m["type"] == "detections"]
    assert [m["frame"] for m in dets] == list(range(18))
    assert [(m["width"], m["height"]) for m in dets] == [(320, 240)] * 10 + [(160, 96)] * 8
    for m in dets:  # boxes are mapped with each frame's own size
        for d in m["detections"]:
            x1, y1, x2, y2 = d["box"]
            assert 0 <= x1 <= x2 <= m["width"] and 0 <= y1 <= y2 <= m["height"]
    assert by["rc"][-1]["type"] == "eos" and by["rc"][-1]["frames"] == 18
